"""The run's own copy of the model's files: config, tokenizer, generation config and, for a model with
remote code (model.trust_remote_code=true), its Python files (STORAGE/RUN/model/).

Written by the driver when a run starts, before any worker (`write_model_files`), on any storage
(a local directory or a pyarrow URI); read by the export (raytrain.checkpoint.export), which so
works after the model directory and tokenizer the run was started from are moved or deleted. The
weights are not copied: the checkpoints hold them.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import shutil
import tempfile
from collections.abc import Iterator

from raytrain.checkpoint.layout import MODEL_DIR, filesystem, set_aside
from raytrain.config import ModelConfig
from raytrain.model import (GENERATION_CONFIG, config_from_facts, load_generation_config, load_tokenizer,
                            token_id_warning_held)


def model_files_uri(run_uri: str) -> str:
    return f"{run_uri.rstrip('/')}/{MODEL_DIR}"


def write_model_files(run_uri: str, model: ModelConfig, facts) -> str | None:
    """STORAGE/RUN/model/: the config as the run resolved it (raytrain.run_spec.ModelFacts), the
    tokenizer the data is tokenized with, and the model's generation config when it has one.

    An earlier session of the run wrote the same files: they are left as they are. Anything else
    found there (a directory that was the user's before it became a run, a tokenizer edited between
    sessions, files another transformers version wrote) is set aside under model.replaced-TIME, never
    deleted; returns the note saying so, None when nothing was moved."""
    import pyarrow.fs

    with tempfile.TemporaryDirectory(prefix="raytrain-model-") as tmp:
        hf_config = config_from_facts(facts, model)
        with token_id_warning_held():  # save_pretrained validates it again: the driver's note says it once
            hf_config.save_pretrained(tmp)  # a config with remote code copies its own module, not the model's
        if model.trust_remote_code:
            _copy_model_code(model.name_or_path, hf_config, tmp)
        load_tokenizer(model).save_pretrained(tmp)
        generation = load_generation_config(model)
        if generation is not None:
            # generate() reads the generation config's token ids, not config.json's: it takes the run's where the
            # run set them, the tokenizer's that random init learns (raytrain.model.token_ids_from_tokenizer) and
            # any model.config sets (the fixes raytrain.planning.resolve.advice names); every other value, and
            # every other id, stays as the model's file has it
            synced = {key for key in model.config if key.endswith("_token_id") and hasattr(generation, key)}
            if not model.pretrained:
                synced |= {"eos_token_id", "bos_token_id"}
            for key in sorted(synced):
                setattr(generation, key, getattr(hf_config, key))
            save_generation_config(generation, tmp)
        uri = model_files_uri(run_uri)
        fs, path = filesystem(uri)
        found = fs.get_file_info(path).type
        note = None
        if found != pyarrow.fs.FileType.NotFound:
            differ = _differences(fs, path, tmp) if found == pyarrow.fs.FileType.Directory else [MODEL_DIR]
            if not differ:
                return None
            aside = set_aside(uri)
            shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
            note = (f"{uri} held files other than this run's model files ({shown}): moved to {aside}; the run "
                    f"writes its own there (the export reads them)")
        fs.create_dir(path, recursive=True)
        pyarrow.fs.copy_files(tmp, path, source_filesystem=pyarrow.fs.LocalFileSystem(), destination_filesystem=fs)
        return note


def _differences(fs, path: str, written: str) -> list[str]:
    """The files that differ between directory `path` on `fs` and the local directory `written`:
    missing on either side or not byte-equal, by their relative names."""
    import pyarrow.fs

    infos = fs.get_file_info(pyarrow.fs.FileSelector(path, recursive=True))
    there = {i.path[len(path.rstrip("/")) + 1:]: i for i in infos if i.type == pyarrow.fs.FileType.File}
    here = {os.path.relpath(os.path.join(root, f), written)
            for root, _, files in os.walk(written) for f in files}
    differ = list(there.keys() ^ here)
    for name in sorted(there.keys() & here):
        local = os.path.join(written, name)
        if there[name].size != os.path.getsize(local):
            same = False
        elif isinstance(fs, pyarrow.fs.LocalFileSystem):
            same = filecmp.cmp(there[name].path, local, shallow=False)
        else:  # equal sizes: read whole (a config and a tokenizer, a few MB; a user's weights differ in size)
            with fs.open_input_stream(there[name].path) as f, open(local, "rb") as mine:
                same = f.read() == mine.read()
        if not same:
            differ.append(name)
    return sorted(differ)


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


def _copy_model_code(name_or_path: str, hf_config, out_dir: str) -> None:
    """The Python files of the classes the config's auto_map names (and what they import relatively),
    as save_pretrained copies them: the export imports the model's class from the run's copy."""
    from transformers.dynamic_module_utils import custom_object_save, get_class_from_dynamic_module

    for ref in (getattr(hf_config, "auto_map", None) or {}).values():
        if isinstance(ref, str):  # a tokenizer's entry is a (slow, fast) pair: the tokenizer saves its own
            custom_object_save(get_class_from_dynamic_module(ref, name_or_path), out_dir)


def save_generation_config(generation, out_dir: str) -> None:
    """generation_config.json as GenerationConfig.save_pretrained writes it (the values that differ from
    transformers' defaults), with the model's own values kept: save_pretrained refuses a generation config
    changed since it was loaded that has a flag transformers only warns about as it loads one (a ValueError,
    "Fix these issues to save the configuration"), such as the pad_token_id=-1 that save_pretrained derives
    from a hub config.json's. raytrain changes only token ids (write_model_files, the export); the values
    transformers warns about are the user's, and stay as written (the driver's note names the fix)."""
    generation.to_json_file(os.path.join(out_dir, GENERATION_CONFIG), use_diff=True, keys_to_pop=["compile_config"])
