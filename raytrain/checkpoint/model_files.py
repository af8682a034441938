"""The run's own copy of the model's files: config, tokenizer and generation config (STORAGE/RUN/model/).

Written by the driver when a run starts, before any worker (`write_model_files`), on any storage
(a local directory or a pyarrow URI); read by the export (raytrain.checkpoint.export), which so
works after the model directory and tokenizer the run was started from are moved or deleted. The
weights are not copied: the checkpoints hold them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

from raytrain.checkpoint.layout import MODEL_DIR, filesystem
from raytrain.config import ModelConfig
from raytrain.model import config_from_facts, load_tokenizer

GENERATION_CONFIG = "generation_config.json"


def model_files_uri(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/{MODEL_DIR}"


def write_model_files(run_uri: str, model: ModelConfig, facts) -> None:
    """STORAGE/RUN/model/: the config as the run resolved it (raytrain.run_spec.ModelFacts), the
    tokenizer the data is tokenized with, and the model's generation config when it has one.
    Replaces what an earlier session of the run wrote (the same files, unless the model changed)."""
    import pyarrow.fs

    with tempfile.TemporaryDirectory(prefix="raytrain-model-") as tmp:
        config_from_facts(facts, model).save_pretrained(tmp)
        load_tokenizer(model).save_pretrained(tmp)
        generation = _generation_config(model)
        if generation is not None:
            generation.save_pretrained(tmp)
        fs, path = filesystem(model_files_uri(run_uri))
        if fs.get_file_info(path).type != pyarrow.fs.FileType.NotFound:
            fs.delete_dir(path)
        fs.create_dir(path, recursive=True)
        pyarrow.fs.copy_files(tmp, path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)


@contextlib.contextmanager
def local_model_files(run_uri: str) -> Iterator[str | None]:
    """STORAGE/RUN/model/ as a local directory (a cloud one copied into a temporary one), or None
    when the run has none (a run started before raytrain wrote it)."""
    import pyarrow.fs

    fs, path = filesystem(model_files_uri(run_uri))
    if fs.get_file_info(path).type != pyarrow.fs.FileType.Directory:
        yield None
    elif isinstance(fs, pyarrow.fs.LocalFileSystem):
        yield path
    else:
        tmp = tempfile.mkdtemp(prefix="raytrain-model-")
        try:
            pyarrow.fs.copy_files(path, tmp, source_filesystem=fs, destination_filesystem=pyarrow.fs.LocalFileSystem())
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def _generation_config(model: ModelConfig):
    """The model's GenerationConfig (generation_config.json of a local directory or hub repo), or None."""
    if model.name_or_path is None:
        return None
    if os.path.isdir(model.name_or_path) and not os.path.isfile(os.path.join(model.name_or_path, GENERATION_CONFIG)):
        return None
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model.name_or_path)
    except OSError:  # a hub model without one
        return None
