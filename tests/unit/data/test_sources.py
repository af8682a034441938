"""The driver-side checks of a data source (raytrain.data.sources): formats, parquet, save_to_disk
directories, and the one-line errors naming the key."""


import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import ConfigError, DataConfig, RunConfig
from raytrain.data.sources import inspect_source


def resolve_format(data, path=None):
    return inspect_source(data, data.path if path is None else path).format


def test_format_detection(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    assert resolve_format(DataConfig(path=str(tmp_path / "a.jsonl"))) == "json"
    assert resolve_format(DataConfig(path=str(tmp_path))) == "json"
    (tmp_path / "b.bin").write_text("x")
    with pytest.raises(ConfigError, match="cannot tell the format"):
        resolve_format(DataConfig(path=str(tmp_path / "b.bin")))
    assert resolve_format(DataConfig(path=str(tmp_path / "b.bin"), format="text")) == "text"
    with pytest.raises(ConfigError, match="data.format must be"):
        DataConfig(format="csv")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ConfigError, match="mixes formats \\(json, text\\)"):
        resolve_format(DataConfig(path=str(tmp_path)))


def test_parquet_with_input_ids_is_pretokenized(tmp_path):
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "t.parquet")
    source = inspect_source(DataConfig(), str(tmp_path))
    assert (source.format, source.column) == ("tokenized", "input_ids")
    pq.write_table(pa.table({"input_ids": ["not ids"]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match="needs an input_ids column of integer lists"):
        inspect_source(DataConfig(format="tokenized"), str(tmp_path))


@pytest.mark.parametrize("make, key, message", [
    (lambda p: None, "missing", "data.path: .*missing does not exist"),
    (lambda p: (p / "d").mkdir(), "d", "directory .*d has no .* files"),
    (lambda p: (p / "e.txt").write_text(""), "e.txt", "every file of .*e.txt is empty"),
    (lambda p: (p / "f.jsonl").write_text('{"body": "x"}\n'), "f.jsonl",
     "data.text_column='text' is not a key of the records in .*f.jsonl \\(keys: body\\)"),
    (lambda p: pq.write_table(pa.table({"body": ["x"]}), p / "g.parquet"), "g.parquet",
     "data.text_column='text' is not a column of .*g.parquet \\(columns: body\\)"),
    (lambda p: pq.write_table(pa.table({"text": [1]}), p / "h.parquet"), "h.parquet", "holds int64, not strings"),
    (lambda p: pq.write_table(pa.table({"text": pa.array([], pa.string())}), p / "i.parquet"), "i.parquet",
     "the parquet files have no rows"),
])
def test_bad_sources_fail_on_the_driver_naming_the_key(tmp_path, make, key, message):
    make(tmp_path)
    with pytest.raises(ConfigError, match=message):
        inspect_source(DataConfig(path=str(tmp_path / key)), str(tmp_path / key))


def test_hf_save_to_disk_directories(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"body": ["x", "y"]}).save_to_disk(str(tmp_path / "one"))
    source = inspect_source(DataConfig(text_column="body"), str(tmp_path / "one"))
    assert source.format == "hf" and len(source.files) == 1 and source.files[0].endswith(".arrow")
    with pytest.raises(ConfigError, match="data.text_column='text' is not a column of .*one \\(columns: body\\)"):
        inspect_source(DataConfig(), str(tmp_path / "one"))
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match="data.hf_split='train' is not a split of .*dd \\(splits: validation\\)"):
        inspect_source(DataConfig(), str(tmp_path / "dd"))
    assert inspect_source(DataConfig(hf_split="validation"), str(tmp_path / "dd")).files[0].endswith(".arrow")
    datasets.Dataset.from_dict({"text": []}).save_to_disk(str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="has no rows"):
        inspect_source(DataConfig(), str(tmp_path / "empty"))


def test_data_config_checks_its_own_fields():
    for kwargs, message in [({"position_ids": "doc"}, "data.position_ids must be packed or per_document"),
                            ({"text_document": "para"}, "data.text_document must be file or line"),
                            ({"eval_fraction": 1.0}, "data.eval_fraction must be a number in \\[0, 1\\)"),
                            ({"eval_fraction": 0.1, "eval_path": "x"}, "both set"),
                            ({"eval_max_batches": 0}, "data.eval_max_batches must be an integer >= 1"),
                            ({"progress_every_s": -1}, "data.progress_every_s must be a number >= 0")]:
        with pytest.raises(ConfigError, match=message):
            DataConfig(**kwargs)
    with pytest.raises(ConfigError, match="data.invalid_utf8 must be replace or error"):
        RunConfig.from_dict({"data": {"invalid_utf8": "ignore"}})
