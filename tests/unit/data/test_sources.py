"""The driver-side checks of a data source (raytrain.data.sources): formats, parquet, save_to_disk
directories, and the one-line errors naming the key."""


import gzip
import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from raytrain.config import ConfigError, DataConfig, RunConfig
from raytrain.data.sources import inspect_source
from raytrain.run_spec import DataFacts


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
    (tmp_path / "_csv").mkdir()  # "_": not listed with tmp_path below
    for name in ("d.csv", "e.TSV.gz"):  # as Hugging Face's load_dataset("csv") reads them
        (tmp_path / "_csv" / name).write_bytes(gzip.compress(b"text\tx\n") if name.endswith(".gz") else b"text,x\n")
        assert resolve_format(DataConfig(path=str(tmp_path / "_csv" / name))) == "csv"
    with pytest.raises(ConfigError, match="data.format must be"):
        DataConfig(format="xml")
    (tmp_path / "c.txt").write_text("x")
    with pytest.raises(ConfigError, match="mixes formats: 1 json file \\(.*a.jsonl\\) and 1 text file "
                                          "\\(.*c.txt\\): give one format per path list"):
        resolve_format(DataConfig(path=str(tmp_path)))


def test_parquet_with_input_ids_is_pretokenized(tmp_path):
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), tmp_path / "t.parquet")
    source = inspect_source(DataConfig(), str(tmp_path))
    assert (source.format, source.column) == ("tokenized", "input_ids")
    pq.write_table(pa.table({"input_ids": ["not ids"]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match=re.escape(f"needs an input_ids column of integer lists in "
                                                    f"{tmp_path / 't.parquet'} (its input_ids is string): write token "
                                                    f"ids there, or set data.format=parquet") + "$"):
        inspect_source(DataConfig(format="tokenized"), str(tmp_path))
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")  # no input_ids at all: its columns are named
    with pytest.raises(ConfigError, match="needs an input_ids column of integer lists in .*t.parquet "
                                          "\\(columns: text\\)"):
        inspect_source(DataConfig(format="tokenized"), str(tmp_path))


@pytest.mark.parametrize("make, key, message", [
    (lambda p: None, "missing", "data.path: .*missing does not exist; give an existing file or directory \\(local, "
                                "s3://, gs://, ...\\)$"),
    (lambda p: (p / "d").mkdir(), "d", "directory .*d has no .* files"),
    (lambda p: (p / "e.txt").write_text(""), "e.txt", "every file of .*e.txt is empty"),
    (lambda p: (p / "f.jsonl").write_text('{"body": "x"}\n'), "f.jsonl",
     "data.text_column='text' is not a key of the records in .*f.jsonl \\(keys: body\\)"),
    (lambda p: pq.write_table(pa.table({"body": ["x"]}), p / "g.parquet"), "g.parquet",
     "data.text_column='text' is not a column of .*g.parquet \\(columns: body\\)"),
    (lambda p: pq.write_table(pa.table({"text": [1]}), p / "h.parquet"), "h.parquet", "holds int64, not strings"),
    (lambda p: pq.write_table(pa.table({"text": pa.array([], pa.string())}), p / "i.parquet"), "i.parquet",
     "the parquet files have no rows"),
    # a path the filesystem refuses to look up (a name over 255 bytes): its error, not a traceback
    (lambda p: None, "n" * 300, "^data.path: cannot read .*n{300} \\(.*File name too long\\): check the path and "
                                "credentials$"),
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


def test_compression_by_suffix_in_any_case_and_archives_refused(tmp_path):
    import gzip
    import lzma

    (tmp_path / "a.TXT.GZ").write_bytes(gzip.compress(b"x"))
    (tmp_path / "b.txt.xz").write_bytes(lzma.compress(b"x"))
    assert inspect_source(DataConfig(), str(tmp_path)).files == [str(tmp_path / "a.TXT.GZ"), str(tmp_path / "b.txt.xz")]
    (tmp_path / "c.jsonl.gz").write_text('{"text": "not gzip"}\n')
    with pytest.raises(ConfigError, match="data.path: cannot read .*c.jsonl.gz \\(zlib inflate failed.*\\): its name "
                                          "says gzip-compressed"):
        inspect_source(DataConfig(), str(tmp_path / "c.jsonl.gz"))
    (tmp_path / "d.tar.gz").write_bytes(gzip.compress(b"x"))
    for config in (DataConfig(), DataConfig(format="text")):
        with pytest.raises(ConfigError, match="d.tar.gz is an archive, which raytrain does not unpack: extract it"):
            inspect_source(config, str(tmp_path))


def test_explicit_format_reads_every_file_of_a_directory(tmp_path):
    (tmp_path / "a.log").write_text("x")
    (tmp_path / "_SUCCESS").write_text("")
    (tmp_path / "b.json.txt").write_text("x")  # named text, read as the format set
    assert inspect_source(DataConfig(format="text"), str(tmp_path)).files == [str(tmp_path / "a.log"),
                                                                              str(tmp_path / "b.json.txt")]
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "c.parquet")
    with pytest.raises(ConfigError, match="holds .*c.parquet, a parquet file, and data.format=text: move it out"):
        inspect_source(DataConfig(format="text"), str(tmp_path))
    # named alone it was read as text: its bytes trained, each invalid one a U+FFFD
    with pytest.raises(ConfigError, match="^data.path: .*c.parquet is a parquet file, and data.format=text: set "
                                          "data.format=auto"):
        inspect_source(DataConfig(format="text"), str(tmp_path / "c.parquet"))
    with pytest.raises(ConfigError, match="^data.path: .*a.jsonl is a json file, and data.format=parquet: "):
        (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
        inspect_source(DataConfig(format="parquet"), str(tmp_path / "a.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="directory .*empty has no files .*: point it at your data$"):
        inspect_source(DataConfig(format="text"), str(tmp_path / "empty"))


def test_json_check_reads_past_files_without_records(tmp_path):
    (tmp_path / "a.jsonl").write_text("\n\n")
    (tmp_path / "b.json").write_text(" [ ] ")
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(ConfigError, match="data.text_column='text' is not a key of the records in .*c.jsonl"):
        inspect_source(DataConfig(), str(tmp_path))


def test_every_local_parquet_schema_is_checked_and_a_named_text_column_is_not_ignored(tmp_path):
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "b.parquet")
    with pytest.raises(ConfigError, match="data.text_column='text' is not a column of .*b.parquet"):
        inspect_source(DataConfig(), str(tmp_path))
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), tmp_path / "b.parquet")
    (tmp_path / "a.parquet").unlink()
    with pytest.raises(ConfigError, match="data.text_column='body' is not a column of .*b.parquet"):
        inspect_source(DataConfig(text_column="body"), str(tmp_path))
    pq.write_table(pa.table({"text": pa.array(["x", "y", "x"]).dictionary_encode()}), tmp_path / "b.parquet")
    assert inspect_source(DataConfig(), str(tmp_path)).format == "parquet"  # categorical strings are text
    (tmp_path / "c.parquet").write_bytes(b"not parquet")
    with pytest.raises(ConfigError, match="^data.path: .*c.parquet is not a readable parquet file \\(.+\\)$"):
        inspect_source(DataConfig(), str(tmp_path))
    pq.write_table(pa.table({"text": ["z"]}), tmp_path / "c.parquet")  # strings beside categorical ones: both read
    assert len(inspect_source(DataConfig(), str(tmp_path)).files) == 2  # as Python strings (read_parquet_rows)
    pq.write_table(pa.table({"text": [b"z"]}), tmp_path / "c.parquet")
    with pytest.raises(ConfigError, match="c.parquet holds binary, not strings"):
        inspect_source(DataConfig(), str(tmp_path))
    # a file whose every row is null has an untyped (null) column: Ray Data merges it with any type
    (tmp_path / "c.parquet").unlink()
    pq.write_table(pa.table({"text": pa.array([None, None])}), tmp_path / "a.parquet")
    assert pa.types.is_null(pq.read_schema(tmp_path / "a.parquet").field("text").type)
    assert inspect_source(DataConfig(), str(tmp_path)).format == "parquet"
    # so is an empty file's, as a writer that splits a list into parts leaves past its end
    ids = tmp_path / "ids"
    ids.mkdir()
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), ids / "part-000.parquet")
    pq.write_table(pa.table({"input_ids": []}), ids / "part-001.parquet")
    assert inspect_source(DataConfig(), str(ids)).format == "tokenized"


def test_save_to_disk_directory_damage_is_one_line(tmp_path, monkeypatch):
    import datasets

    datasets.Dataset.from_dict({"text": ["x", "y"]}).save_to_disk(str(tmp_path / "d"), num_shards=2)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert inspect_source(DataConfig(), "~/d").format == "hf"  # detected as save_to_disk through ~
    (tmp_path / "d" / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(ConfigError, match="data-00001-of-00002.arrow, a data file its state.json lists, is missing"):
        inspect_source(DataConfig(), str(tmp_path / "d"))
    (tmp_path / "d" / "state.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read .*state.json \\(Expecting property name.*\\): give a directory"):
        inspect_source(DataConfig(), str(tmp_path / "d"))


def test_a_hub_id_or_a_pattern_as_a_path_gets_a_hint(tmp_path):
    with pytest.raises(ConfigError, match="org/name does not exist; .*for a Hugging Face hub dataset set "
                                          "data.format=hf"):
        inspect_source(DataConfig(), "org/name")
    with pytest.raises(ConfigError, match="patterns are not expanded"):
        inspect_source(DataConfig(), str(tmp_path / "*.jsonl"))


def _unprivileged():
    """A command prefix under which permission bits apply: none for a normal user; for root (CI
    containers) setpriv without the capabilities that bypass them. None: not possible here."""
    import os
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return []
    drop = "-dac_override,-dac_read_search"
    prefix = ["setpriv", "--bounding-set", drop, "--inh-caps", drop]
    if shutil.which("setpriv") and subprocess.run(prefix + ["true"], capture_output=True).returncode == 0:
        return prefix
    return None


def test_unreadable_directories_and_files_are_one_line(tmp_path):
    import subprocess
    import sys

    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("root without setpriv: permission bits cannot apply")
    (tmp_path / "d" / "locked").mkdir(parents=True)
    (tmp_path / "d" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "d" / "locked").chmod(0)
    (tmp_path / "f").mkdir()
    (tmp_path / "f" / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "f" / "a.jsonl").chmod(0)
    code = ("import sys\nfrom raytrain.config import ConfigError, DataConfig\n"
            "from raytrain.data.sources import inspect_source\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n        inspect_source(DataConfig(), path)\n"
            "    except ConfigError as e:\n        print(e)\n")
    out = subprocess.run(prefix + [sys.executable, "-c", code, str(tmp_path / "d"), str(tmp_path / "f")],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.splitlines() == [
        f"data.path: cannot list directory {tmp_path / 'd'} ([Errno 13] Cannot list directory "
        f"'{tmp_path / 'd' / 'locked'}'. Detail: [errno 13] Permission denied): make it readable, or point "
        f"data.path at the readable files",
        f"data.path: cannot read {tmp_path / 'f' / 'a.jsonl'} (permission denied): make it readable, or leave it "
        f"out of data.path"], out.stderr


def test_every_local_json_file_has_its_first_record_checked(tmp_path):
    """Only the first file was checked: a second file keyed "content" trained as empty documents."""
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"content": "y"}\n' * 3)
    with pytest.raises(ConfigError, match="data.text_column='text' is not a key of the records in .*b.jsonl "
                                          "\\(keys: content\\)"):
        inspect_source(DataConfig(), str(tmp_path))
    # what that costs per file: one 64 KiB read, not the 1 MiB read of a first record that may be long
    from raytrain.data import sources

    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n' * 100_000)
    source = inspect_source(DataConfig(), str(tmp_path))
    assert source.files == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]
    head = sources._read_head(source, str(tmp_path / "b.jsonl"), "data.path", enough=sources._has_first_line)
    assert len(head) == 1 << 16


def test_a_file_read_twice_is_refused_naming_both_paths(tmp_path):
    import os

    d = tmp_path / "d"
    d.mkdir()
    (d / "a.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match=f"data.path: {d / 'a.jsonl'} is read twice \\(data.path names it twice, "
                                          f"or names it and a directory holding it\\): list each file"):
        inspect_source(DataConfig(), [str(d), str(d / "a.jsonl")])
    os.symlink(d / "a.jsonl", d / "latest.jsonl")
    with pytest.raises(ConfigError, match=f"{d / 'latest.jsonl'} and {d / 'a.jsonl'} are the same file, through "
                                          f"the symbolic link {d / 'latest.jsonl'}: read each file once"):
        inspect_source(DataConfig(), str(d))
    (d / "latest.jsonl").unlink()
    os.symlink(d, d / "self")  # a link to its own directory: pyarrow lists a.jsonl ~40 times
    with pytest.raises(ConfigError, match=f"{d / 'self' / 'a.jsonl'} and {d / 'a.jsonl'} are the same file, "
                                          f"through the symbolic link {d / 'self'}:"):
        inspect_source(DataConfig(), str(d))
    (d / "self").unlink()
    os.link(d / "a.jsonl", d / "b.jsonl")
    with pytest.raises(ConfigError, match="b.jsonl and .*a.jsonl are the same file \\(hard links\\)"):
        inspect_source(DataConfig(), str(d))
    (d / "b.jsonl").unlink()
    # data.path itself a link to d, and in d a link to a file: both files pass through the first link, so the second
    # one is what reads the file twice
    os.symlink(d / "a.jsonl", d / "latest.jsonl")
    os.symlink(d, tmp_path / "current")
    current = tmp_path / "current"
    with pytest.raises(ConfigError, match=f"{current / 'latest.jsonl'} and {current / 'a.jsonl'} are the same file, "
                                          f"through the symbolic link {current / 'latest.jsonl'}: read each file once"):
        inspect_source(DataConfig(), str(current))


def test_eval_files_that_are_training_files_are_refused(tmp_path):
    from raytrain.data.sources import inspect_sources

    (tmp_path / "train.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "val.jsonl").write_text('{"text": "v"}\n')
    with pytest.raises(ConfigError, match=f"data.eval_path: {tmp_path / 'val.jsonl'} is also in data.path: "
                                          f"evaluate on files that are not trained on"):
        inspect_sources(DataConfig(path=str(tmp_path), eval_path=str(tmp_path / "val.jsonl")))
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "train.jsonl")
    with pytest.raises(ConfigError, match="link.jsonl is also in data.path \\(as .*train.jsonl\\)"):
        inspect_sources(DataConfig(path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "link.jsonl")))
    apart = inspect_sources(DataConfig(path=str(tmp_path / "train.jsonl"), eval_path=str(tmp_path / "val.jsonl")))
    assert apart.eval.files == [str(tmp_path / "val.jsonl")]


def test_a_csv_files_header_must_name_the_text_column(tmp_path):
    from raytrain.data.sources import csv_delimiter

    (tmp_path / "a.csv").write_bytes(b"\xef\xbb\xbfid,body\r\n1,x\r\n")
    with pytest.raises(ConfigError, match=re.escape(f"data.text_column='text' is not a column of {tmp_path / 'a.csv'} "
                                                    f"(its header: 'id', 'body'): set data.text_column")):
        inspect_source(DataConfig(), str(tmp_path / "a.csv"))
    assert inspect_source(DataConfig(text_column="body"), str(tmp_path / "a.csv")).format == "csv"
    (tmp_path / "b.tsv").write_text("id,text\n")  # commas in a .tsv: one column named "id,text"
    with pytest.raises(ConfigError, match="b.tsv \\(tab-separated: the file's name ends in .tsv\\) "
                                          "\\(its header: 'id,text'\\)"):
        inspect_source(DataConfig(), str(tmp_path / "b.tsv"))
    # headers pyarrow reads: \r alone (Excel for Mac), a quoted newline in a name, a blank line first
    for i, raw in enumerate((b"id,text\r1,hello\r", b'"a\nb",text\n1,x\n', b"\nid,text\n1,x\n")):
        (tmp_path / f"h{i}.csv").write_bytes(raw)
        assert inspect_source(DataConfig(), str(tmp_path / f"h{i}.csv")).format == "csv"
    (tmp_path / "wide.csv").write_text(",".join(f"c{i}" for i in range(200_000)) + ",text\nx\n")  # 1.5 MB: the reader's
    assert inspect_source(DataConfig(), str(tmp_path / "wide.csv")).format == "csv"
    (tmp_path / "many.csv").write_text(",".join(f"c{i}" for i in range(30)) + "\n")
    with pytest.raises(ConfigError, match="'c18', 'c19' and 10 more\\): set data.text_column$"):
        inspect_source(DataConfig(), str(tmp_path / "many.csv"))
    for n, tail in ((20, "'c18', 'c19'"), (21, "'c18', 'c19' and 1 more")):  # at most 20 names, then a count
        (tmp_path / "many.csv").write_text(",".join(f"c{i}" for i in range(n)) + "\n")
        with pytest.raises(ConfigError, match=re.escape("(its header: 'c0', 'c1', ") + ".*"
                           + re.escape(f"{tail}): set data.text_column") + "$"):
            inspect_source(DataConfig(), str(tmp_path / "many.csv"))
    (tmp_path / "huge.csv").write_text("x" * 200_000 + ",text\n")  # a name over Python csv's 131072-byte field limit
    with pytest.raises(ConfigError, match=re.escape(f"data.path: the header of {tmp_path / 'huge.csv'} is not valid "
                                                    f"CSV (field larger than field limit (131072)): fix it") + "$"):
        inspect_source(DataConfig(), str(tmp_path / "huge.csv"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.csv").write_text("text\nx\n")
    (tmp_path / "d" / "b.csv").write_text("body\nx\n")  # the second file's header: checked too
    with pytest.raises(ConfigError, match="is not a column of .*b.csv \\(its header: 'body'\\)"):
        inspect_source(DataConfig(), str(tmp_path / "d"))
    assert [csv_delimiter(p) for p in ("a.csv", "a.TSV", "a.tsv.zst", "a.txt")] == [",", "\t", "\t", ","]


def test_a_tab_separated_file_named_csv_is_told_to_be_named_tsv(tmp_path):
    """Read with commas, its header is one column holding the tabs: "set data.text_column" could never fix it."""
    (tmp_path / "t.csv").write_text("id\ttext\n1\thello world\n")
    with pytest.raises(ConfigError, match=re.escape(
            f"data.path: {tmp_path / 't.csv'} looks tab-separated (its header 'id\\ttext' has tabs and no commas), "
            f"but only a file whose name ends in .tsv (compressed or not) is read with tabs: rename it to end in "
            f".tsv") + "$"):
        inspect_source(DataConfig(), str(tmp_path / "t.csv"))
    (tmp_path / "t.csv").rename(tmp_path / "t.tsv")  # the fix
    assert inspect_source(DataConfig(), str(tmp_path / "t.tsv")).format == "csv"
    (tmp_path / "c.csv").write_text("id,body\tnote\n")  # commas too: a CSV whose column names hold a tab
    with pytest.raises(ConfigError, match="\\(its header: 'id', 'body\\\\tnote'\\): set data.text_column$"):
        inspect_source(DataConfig(), str(tmp_path / "c.csv"))


def test_an_eval_fraction_of_one_text_file_read_as_one_document_is_refused(tmp_path):
    """One document is all trained on or all held out: the run stopped only once it was tokenized."""
    from raytrain.data.sources import inspect_sources

    (tmp_path / "corpus.txt").write_text("line one\nline two\n")
    with pytest.raises(ConfigError, match=f"^data.eval_fraction=0.05 holds out whole documents, and data.path "
                                          f"holds one text file, {tmp_path / 'corpus.txt'}, read as one document "
                                          f"\\(data.text_document=file\\): set data.text_document=line"):
        inspect_sources(DataConfig(path=str(tmp_path / "corpus.txt"), eval_fraction=0.05))
    lines = inspect_sources(DataConfig(path=str(tmp_path / "corpus.txt"), eval_fraction=0.05, text_document="line"))
    assert lines.eval is lines.train
    (tmp_path / "empty.txt").write_text("")  # an empty file is no second document
    with pytest.raises(ConfigError, match="holds one text file"):
        inspect_sources(DataConfig(path=str(tmp_path), eval_fraction=0.05))
    (tmp_path / "more.txt").write_text("another document")
    assert inspect_sources(DataConfig(path=str(tmp_path), eval_fraction=0.5)).eval is not None  # two documents


def test_an_eval_fraction_expecting_less_than_one_of_a_few_text_documents_is_refused(tmp_path):
    """3 files x 0.1 is 0.3 of a document held out: the dry run passed and the run stopped once tokenized."""
    from raytrain.data.sources import inspect_sources

    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(f"document {i}\n" * 2)
    with pytest.raises(ConfigError, match=re.escape(
            "data.eval_fraction=0.1 holds out whole documents, and data.path holds 3 text files, read as one "
            "document each (data.text_document=file): 0.3 of a document is expected held out, often none: set "
            "data.text_document=line (each line a document), or give held-out text in data.eval_path") + "$"):
        inspect_sources(DataConfig(path=str(tmp_path), eval_fraction=0.1))
    lines = inspect_sources(DataConfig(path=str(tmp_path), eval_fraction=0.1, text_document="line"))  # the fix
    assert lines.eval is lines.train
    assert inspect_sources(DataConfig(path=str(tmp_path), eval_fraction=0.34)).eval is not None  # 1.02 expected


def test_a_raytrain_checkpoint_among_the_data_is_refused_naming_it(tmp_path):
    """An earlier run inside data.path: under data.format=text its .pt shards, events and JSON trained as text
    (exit 0); under auto the listing ended in "mixes formats", whose advice named the run's model directory."""
    from raytrain.data.sources import inspect_sources

    (tmp_path / "a.txt").write_text("a document\n")
    run = tmp_path / "runs" / "s1"
    (run / "model").mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"):
        (run / "model" / name).write_text("{}")
    (run / "summary.md").write_text("# run s1\n")
    checkpoint = run / "checkpoint_step_00000002"
    (checkpoint / "step_00000002").mkdir(parents=True)
    (checkpoint / "raytrain.json").write_text("{}")
    (checkpoint / "step_00000002" / "mp_rank_00_model_states.pt").write_bytes(b"\x80\x02")
    for fmt in ("text", "auto"):
        with pytest.raises(ConfigError, match=re.escape(
                f"data.path: {tmp_path} holds a raytrain checkpoint ({checkpoint}), which would be read as data: "
                f"point data.path at a directory holding only the data (move run directories out; "
                f"checkpoint.storage_path must be outside the data)") + "$"):
            inspect_sources(DataConfig(path=str(tmp_path), format=fmt))
    with pytest.raises(ConfigError, match=re.escape(f"data.eval_path: {checkpoint} holds a raytrain checkpoint "
                                                    f"({checkpoint})")):
        inspect_sources(DataConfig(path=str(tmp_path / "a.txt"), eval_path=str(checkpoint), format="text"))
    (tmp_path / "runs").rename(tmp_path / "_runs")  # names starting with "_" are not read: the run is not data
    assert inspect_sources(DataConfig(path=str(tmp_path), format="text")).train.files == [str(tmp_path / "a.txt")]
    (tmp_path / "checkpoint_step_1.txt").write_text("a file, not a checkpoint directory\n")
    assert len(inspect_sources(DataConfig(path=str(tmp_path), format="text")).train.files) == 2
    cut = tmp_path / "old" / "checkpoint_step_00000007"  # no raytrain.json: the save stopped part way
    cut.mkdir(parents=True)
    (cut / "latest").write_text("step_00000007")
    refused = re.escape(f"data.path: {tmp_path} holds a raytrain checkpoint ({cut}), which would be read as data")
    with pytest.raises(ConfigError, match=refused):
        inspect_sources(DataConfig(path=str(tmp_path), format="text"))
    (cut / "latest").unlink()
    (cut / "step_00000007").mkdir()
    (cut / "step_00000007" / "mp_rank_00_model_states.pt").write_bytes(b"\x80\x02")  # named by cut, not its subdir
    with pytest.raises(ConfigError, match=refused):
        inspect_sources(DataConfig(path=str(tmp_path), format="text"))
    (tmp_path / "old").rename(tmp_path / "_old")
    (tmp_path / "run" / "s2").mkdir(parents=True)
    (tmp_path / "run" / "s2" / "raytrain.json").write_text("{}")  # a run's own record, no checkpoint directory
    with pytest.raises(ConfigError, match=re.escape(f"holds a raytrain checkpoint ({tmp_path / 'run' / 's2'}), ")):
        inspect_sources(DataConfig(path=str(tmp_path), format="text"))


def test_eval_files_without_the_training_column_are_told_to_use_it(tmp_path):
    """There is no eval column of its own: "set data.text_column" (to the eval files' key) broke data.path."""
    from raytrain.data.sources import inspect_sources

    (tmp_path / "train.jsonl").write_text('{"content": "a training document"}\n')
    (tmp_path / "eval.jsonl").write_text('{"text": "a held-out document"}\n')
    pq.write_table(pa.table({"text": ["a held-out document"]}), tmp_path / "eval.parquet")
    (tmp_path / "eval.csv").write_text("text\na held-out document\n")
    fix = ("data.eval_path's files must use the same column as data.path's (data.text_column='content'; there is no "
           "separate eval column): write the eval text under 'content'")
    for name in ("eval.jsonl", "eval.parquet", "eval.csv"):
        with pytest.raises(ConfigError, match=f"^data.text_column='content' is not a .* of .*{name} .*: "
                                              f"{re.escape(fix)}$"):
            inspect_sources(DataConfig(path=str(tmp_path / "train.jsonl"), text_column="content",
                                       eval_path=str(tmp_path / name)))
    (tmp_path / "train.txt").write_text("text files have no column: data.text_column is the eval files' only\n")
    with pytest.raises(ConfigError, match="is not a key of the records in .*eval.jsonl \\(keys: text\\): "
                                          "set data.text_column$"):
        inspect_sources(DataConfig(path=str(tmp_path / "train.txt"), text_column="content",
                                   eval_path=str(tmp_path / "eval.jsonl")))


def test_a_dangling_link_in_a_directory_is_refused_naming_it(tmp_path):
    """pyarrow's listing leaves links to nothing out (an unfetched git-annex or DVC file)."""
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "notes.bak").symlink_to(tmp_path / "gone")  # not data under data.format=auto: not read
    (tmp_path / "_old.jsonl").symlink_to(tmp_path / "gone")  # names starting with "_" or "." are not read either
    assert inspect_source(DataConfig(), str(tmp_path)).files == [str(tmp_path / "a.jsonl")]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.jsonl").symlink_to("../.git/annex/objects/b")
    with pytest.raises(ConfigError, match=f"data.path: {tmp_path / 'sub' / 'b.jsonl'} is a symbolic link to "
                                          f"../.git/annex/objects/b, which does not exist: fetch the file"):
        inspect_source(DataConfig(), str(tmp_path))


def test_a_hub_snapshot_directory_names_the_odd_file_and_the_data_directory(tmp_path):
    (tmp_path / "README.md").write_text("# Dataset card\n")
    (tmp_path / "data").mkdir()
    for i in range(2):
        pq.write_table(pa.table({"text": ["x"]}), tmp_path / "data" / f"train-{i:05d}.parquet")
    with pytest.raises(ConfigError, match=f"mixes formats: 1 text file \\({tmp_path / 'README.md'}\\) and 2 parquet "
                                          f"files \\(.*train-00000.parquet, ...\\): point data.path at "
                                          f"{tmp_path / 'data'}, which holds the parquet files only$"):
        inspect_source(DataConfig(), str(tmp_path))
    assert inspect_source(DataConfig(), str(tmp_path / "data")).format == "parquet"  # the advice works


@pytest.mark.parametrize("encoding, name", [("utf-16", "UTF-16 LE"), ("utf-16-be", "UTF-16 BE"),
                                            ("utf-32", "UTF-32 LE")])
def test_utf16_and_utf32_files_are_refused_on_the_driver(tmp_path, encoding, name):
    bom = {"utf-16-be": "\ufeff"}.get(encoding, "")  # utf-16 and utf-32 write their BOM themselves
    (tmp_path / "a.txt").write_text("first file\n")
    (tmp_path / "b.txt").write_bytes((bom + "hello\n").encode(encoding))  # not the first file: read all the same
    with pytest.raises(ConfigError, match=f"data.path: .*b.txt is {name} text \\(it starts with a {name} byte order "
                                          f"mark\\), not UTF-8: re-encode it as UTF-8 \\(iconv -f "
                                          f"{name.split()[0]} -t UTF-8\\)"):
        inspect_source(DataConfig(), str(tmp_path))
    with pytest.raises(ConfigError, match=f"b.txt is {name} text"):  # the first (here only) text file: read as well
        inspect_source(DataConfig(), str(tmp_path / "b.txt"))
    (tmp_path / "c.jsonl").write_bytes((bom + '{"text": "x"}\n').encode(encoding))
    with pytest.raises(ConfigError, match=f"c.jsonl is {name} text"):
        inspect_source(DataConfig(), str(tmp_path / "c.jsonl"))


def test_a_directory_of_hub_named_shards_reads_only_data_hf_split(tmp_path):
    """A hub snapshot's data/ holds every split, as {split}-NNNNN-of-NNNNN files: reading them all
    trained on the test and validation splits."""
    from raytrain.data.sources import inspect_sources

    for split in ("train", "test", "validation"):
        (tmp_path / f"{split}-00000-of-00001.jsonl").write_text(f'{{"text": "{split}"}}\n')
    sources = inspect_sources(DataConfig(path=str(tmp_path)))
    assert sources.train.files == [str(tmp_path / "train-00000-of-00001.jsonl")] and sources.train.split == "train"
    assert sources.notes == (f"data.path: reading the 'train' split of {tmp_path} (1 file: data.hf_split); left "
                             f"out the splits test (1 file), validation (1 file)",)
    with pytest.raises(ConfigError, match="^data.hf_split='dev' is not a split of data.path=.*: its files are named "
                                          "for the splits test \\(1 file\\), train \\(1 file\\), "
                                          "validation \\(1 file\\): set data.hf_split$"):
        inspect_sources(DataConfig(path=str(tmp_path), hf_split="dev"))
    # the same directory as eval_path: its validation split (data.eval_hf_split), never the training files
    both = inspect_sources(DataConfig(path=str(tmp_path), eval_path=str(tmp_path)))
    assert both.eval.files == [str(tmp_path / "validation-00000-of-00001.jsonl")]
    with pytest.raises(ConfigError, match="is also in data.path \\(the split 'train' of both: set data.eval_hf_split"):
        inspect_sources(DataConfig(path=str(tmp_path), eval_path=str(tmp_path), eval_hf_split="train"))
    with pytest.raises(ConfigError, match="^data.eval_hf_split='dev' is not a split of data.eval_path=.*: set "
                                          "data.eval_hf_split$"):
        inspect_sources(DataConfig(path=str(tmp_path / "train-00000-of-00001.jsonl"), eval_path=str(tmp_path),
                                   eval_hf_split="dev"))
    (tmp_path / "beam").mkdir()  # one shard prefix that names no split: a job's output, read whole
    for i in range(2):
        (tmp_path / "beam" / f"output-{i:05d}-of-00002.jsonl").write_text('{"text": "x"}\n')
    beam = inspect_sources(DataConfig(path=str(tmp_path / "beam"))).train
    assert len(beam.files) == 2 and beam.split is None  # no split read: data.hf_split is not what chose them
    (tmp_path / "only").mkdir()  # the split asked for, alone: read, and said to be that split
    (tmp_path / "only" / "train-00000-of-00001.jsonl").write_text('{"text": "x"}\n')
    assert inspect_sources(DataConfig(path=str(tmp_path / "only"))).train.split == "train"
    (tmp_path / "only" / "train-00000-of-00001.jsonl").rename(tmp_path / "only" / "test-00000-of-00001.jsonl")
    with pytest.raises(ConfigError, match="^data.hf_split='train' is not a split of data.path=.*only: its files are "
                                          "named for the splits test \\(1 file\\): set data.hf_split$"):
        inspect_sources(DataConfig(path=str(tmp_path / "only")))  # one split word alone: not read as the training set


def test_a_hub_datasets_eval_split_is_its_own_and_its_training_split_is_refused():
    from raytrain.data.sources import Source, _refuse_eval_in_train

    assert DataConfig().eval_hf_split == "validation"
    train = Source("hf", hub_id="org/corpus", split="train")
    _refuse_eval_in_train(train, Source("hf", hub_id="org/corpus", split="validation"))
    with pytest.raises(ConfigError, match="^data.eval_path: the hub dataset 'org/corpus' split 'train' is the "
                                          "training data .*: evaluate on another split \\(data.eval_hf_split"):
        _refuse_eval_in_train(train, Source("hf", hub_id="org/corpus", split="train"))


def test_files_left_out_of_a_directory_and_settings_without_effect_get_a_note(tmp_path, capsys):
    from raytrain.data.sources import inspect_sources

    for name in ("a.jsonl", "b.jsonlines", "c.jsonl.zstd"):
        (tmp_path / name).write_text('{"text": "x"}\n')
    sources = inspect_sources(DataConfig(path=str(tmp_path)))
    assert sources.train.files == [str(tmp_path / "a.jsonl")]
    assert sources.notes == (f"data.path: reading 1 file of {tmp_path}; left out 2 with other extensions (first: "
                             f"{tmp_path / 'b.jsonlines'}): set data.format to read every file, or rename them "
                             f"(.jsonl, .txt, .csv, .parquet, compressed .gz/.zst/...)",)
    pq.write_table(pa.table({"input_ids": [[1, 2]], "labels": [[-100, 2]]}), tmp_path / "t.parquet")
    notes = inspect_sources(DataConfig(path=str(tmp_path / "t.parquet"), hf_split="test", text_document="line")).notes
    assert [n.split(" has no effect")[0].split(" is not read")[0] for n in notes] == [
        f"data.path: the labels column of {tmp_path / 't.parquet'}", "data.hf_split='test'",
        "data.text_document='line'"]
    notes = inspect_sources(DataConfig(path=str(tmp_path / "a.jsonl"), eval_hf_split="test")).notes
    assert notes == ("data.eval_hf_split='test' has no effect: there is no data.eval_path",)
    assert capsys.readouterr().err == ""  # the caller prints them, once every check has passed (test_main.py)


def test_parquet_shards_of_either_string_or_id_list_width_are_one_type(tmp_path):
    """read_parquet_rows yields Python strings and int64 arrays whatever the Arrow width."""
    pq.write_table(pa.table({"text": pa.array(["x"], pa.string())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": pa.array(["y"], pa.large_string())}), tmp_path / "b.parquet")
    assert len(inspect_source(DataConfig(), str(tmp_path)).files) == 2
    (tmp_path / "ids").mkdir()
    pq.write_table(pa.table({"input_ids": pa.array([[1]], pa.list_(pa.int32()))}), tmp_path / "ids" / "a.parquet")
    pq.write_table(pa.table({"input_ids": pa.array([[2]], pa.large_list(pa.int64()))}), tmp_path / "ids" / "b.parquet")
    assert inspect_source(DataConfig(), str(tmp_path / "ids")).format == "tokenized"
    pq.write_table(pa.table({"input_ids": pa.array([1], pa.int64())}), tmp_path / "ids" / "c.parquet")
    with pytest.raises(ConfigError, match="needs an input_ids column of integer lists"):
        inspect_source(DataConfig(), str(tmp_path / "ids"))


def test_a_pre_tokenized_save_to_disk_directory_is_refused_in_one_line_with_the_export(tmp_path):
    import datasets

    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]}).save_to_disk(str(tmp_path / "tok"))
    for data in (DataConfig(), DataConfig(format="tokenized")):
        with pytest.raises(ConfigError, match=f"^data.path: {tmp_path / 'tok'} is a datasets save_to_disk directory "
                                              f"of token ids .*: export it with datasets.load_from_disk"):
            inspect_source(data, str(tmp_path / "tok"))


def test_the_built_in_corpus_an_empty_path_list_and_what_each_source_says_it_read(tmp_path):
    from raytrain.data.sources import data_facts, inspect_sources

    builtin = inspect_sources(DataConfig())
    assert (builtin.train.format, builtin.eval, builtin.notes) == ("builtin", None, ())
    # DataConfig's default num_builtin_documents is 4000
    assert data_facts(DataConfig(), builtin) == DataFacts(source="built-in corpus (4000 documents)", format="builtin")
    for key, tail in (("data.path", " (or null for the built-in corpus)"), ("data.eval_path", "")):
        with pytest.raises(ConfigError, match=re.escape(f"{key} is an empty list: give at least one file or "
                                                        f"directory{tail}") + "$"):
            inspect_source(DataConfig(), [], key)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "b.jsonl").write_text('{"text": "y"}\n')
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert inspect_sources(DataConfig(path=a)).eval is None  # no eval_path, no eval_fraction: nothing held out
    data = DataConfig(path=a, eval_fraction=0.1)
    assert data_facts(data, inspect_sources(data)) == DataFacts(
        source=a, format="json", eval_source=f"0.1 of the documents of {a} (by content hash)", eval_format="json")
    data = DataConfig(path=a, eval_path=b)
    assert data_facts(data, inspect_sources(data)) == DataFacts(source=a, format="json", eval_source=b,
                                                                eval_format="json")
    shards = tmp_path / "_shards"
    shards.mkdir()
    for split in ("train", "validation"):
        (shards / f"{split}-00000-of-00001.jsonl").write_text('{"text": "x"}\n')
    data = DataConfig(path=str(shards), eval_path=str(shards))
    assert data_facts(data, inspect_sources(data)) == DataFacts(
        source=f"{shards} (split train)", format="json", eval_source=f"{shards} (split validation)", eval_format="json")


def test_uris_pyarrow_opens_and_a_path_list_on_two_filesystems(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    assert inspect_source(DataConfig(), f"file://{tmp_path / 'a.jsonl'}").files == [str(tmp_path / "a.jsonl")]
    with pytest.raises(ConfigError, match=re.escape("data.path: cannot open nosuch://bucket/x (Unrecognized filesystem "
                                                    "type in URI: nosuch://bucket/x): check the URI")):
        inspect_source(DataConfig(), "nosuch://bucket/x")
    # pyarrow's in-memory "mock" filesystem: another filesystem than the local one, offline
    with pytest.raises(ConfigError, match=re.escape("data.path mixes filesystems (local and mock): read from one "
                                                    "filesystem per path list") + "$"):
        inspect_source(DataConfig(), [str(tmp_path / "a.jsonl"), "mock:///bucket/b.jsonl"])


def test_remote_sources_compare_by_path_and_read_parquet_footers_until_one_has_rows(tmp_path):
    """A remote filesystem (here pyarrow's in-memory mock one): no stat, and each footer is a request."""
    import pyarrow.fs as pafs

    from raytrain.data.sources import Source, _check_parquet, _refuse_eval_in_train

    fs = pafs.FileSystem.from_uri("mock:///")[0]
    fs.create_dir("bucket")
    train = Source("json", filesystem=fs, files=["bucket/a.jsonl"])
    _refuse_eval_in_train(train, Source("json", filesystem=fs, files=["bucket/b.jsonl"]))
    with pytest.raises(ConfigError, match="^data.eval_path: bucket/a.jsonl is also in data.path: evaluate on"):
        _refuse_eval_in_train(train, Source("json", filesystem=fs, files=["bucket/a.jsonl"]))
    pq.write_table(pa.table({"text": ["x"]}), "bucket/a.parquet", filesystem=fs)
    pq.write_table(pa.table({"body": ["y"]}), "bucket/b.parquet", filesystem=fs)  # a local source refuses it
    source = Source("parquet", filesystem=fs, files=["bucket/a.parquet", "bucket/b.parquet"])
    assert _check_parquet(source, DataConfig(), "data.path", [], None) is source  # b's footer is not fetched


def test_the_hf_format_needs_one_existing_save_to_disk_directory_of_strings(tmp_path, monkeypatch):
    import datasets

    hf = DataConfig(format="hf")
    monkeypatch.chdir(tmp_path)
    for path in ("x/y/z", "./gone"):  # relative, and no hub id (org/name): not looked up on the hub
        with pytest.raises(ConfigError, match="^" + re.escape(f"data.path: {path} does not exist; give a save_to_disk "
                                                              f"directory or a hub id (org/name)") + "$"):
            inspect_source(hf, path)
    (tmp_path / "a.jsonl").write_text('{"text": "x"}\n')
    (tmp_path / "empty").mkdir()
    for path, message in [
            ([str(tmp_path / "empty")] * 2, "data.format=hf reads one dataset; give one directory or hub id"),
            (str(tmp_path / "gone"), f"{tmp_path / 'gone'} does not exist; give a save_to_disk directory or a hub id "
                                     f"(org/name)"),
            (str(tmp_path / "a.jsonl"), f"{tmp_path / 'a.jsonl'} is a file; data.format=hf needs a save_to_disk "
                                        f"directory"),
            (str(tmp_path / "empty"), f"{tmp_path / 'empty'} has no state.json: give a directory written by datasets' "
                                      f"save_to_disk")]:
        with pytest.raises(ConfigError, match="^" + re.escape(f"data.path: {message}") + "$"):
            inspect_source(hf, path)
    (tmp_path / "empty" / "state.json").write_text('{"_data_files": [{"path": "x.arrow"}]}')
    with pytest.raises(ConfigError, match=re.escape(f"data.path: {tmp_path / 'empty'}/state.json has no list of "
                                                    f"_data_files with a filename each")):
        inspect_source(hf, str(tmp_path / "empty"))
    datasets.Dataset.from_dict({"text": [1, 2]}).save_to_disk(str(tmp_path / "ints"))
    with pytest.raises(ConfigError, match=re.escape(f"data.text_column='text' in {tmp_path / 'ints'} holds int64, not "
                                                    f"strings: set data.text_column to the text column") + "$"):
        inspect_source(DataConfig(), str(tmp_path / "ints"))
    shard = tmp_path / "ints" / "data-00000-of-00001.arrow"
    shard.write_bytes(b"not arrow")
    with pytest.raises(ConfigError, match=re.escape(f"data.path: {shard} is not a readable Arrow stream (")
                       + ".*" + re.escape("): copy the save_to_disk directory again") + "$"):
        inspect_source(DataConfig(), str(tmp_path / "ints"))


def test_a_hub_id_under_the_hf_format_is_opened_on_the_hub_for_the_split_of_its_key(tmp_path, monkeypatch):
    """data.format=hf and an org/name that is no local path: a hub dataset, not "does not exist" (a path of more
    parts is one). Offline here, with the libraries' own switch (what HF_HUB_OFFLINE=1 sets when they are
    imported): no request is made and the load fails at once, naming the split read and the key that chose it."""
    import datasets.config
    import huggingface_hub.constants

    for module in (huggingface_hub.constants, datasets.config):
        monkeypatch.setattr(module, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local raytrain-test/ directory: the id is not a path
    for key, split, split_key in (("data.path", "train", "data.hf_split"),
                                  ("data.eval_path", "validation", "data.eval_hf_split")):
        with pytest.raises(ConfigError, match="^" + re.escape(f"{key}: cannot open the hub dataset "
                                                              f"'raytrain-test/absent' split '{split}' (") + ".+"
                           + re.escape(f"): check the id, {split_key} and your network/token") + "$"):
            inspect_source(DataConfig(format="hf"), "raytrain-test/absent", key)


def test_a_save_to_disk_directory_whose_first_shard_has_no_rows_is_read_past_it(tmp_path):
    """The driver reads the shards' headers until one holds a row: rows in a later shard are a dataset with rows."""
    import datasets

    datasets.Dataset.from_dict({"text": ["x", "y"]}).save_to_disk(str(tmp_path / "d"), num_shards=2)
    first = tmp_path / "d" / "data-00000-of-00002.arrow"
    with pa.ipc.open_stream(pa.OSFile(str(first))) as reader:
        schema = reader.schema
    with pa.ipc.new_stream(str(first), schema):  # the same schema, no record batch
        pass
    source = inspect_source(DataConfig(), str(tmp_path / "d"))
    assert (source.format, [f.rsplit("/", 1)[-1] for f in source.files]) == (
        "hf", ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"])
    (tmp_path / "d" / "data-00001-of-00002.arrow").write_bytes(first.read_bytes())  # now no shard has a row
    with pytest.raises(ConfigError, match=re.escape(f"data.path: the dataset at {tmp_path / 'd'} has no rows: give a "
                                                    f"non-empty dataset") + "$"):
        inspect_source(DataConfig(), str(tmp_path / "d"))


def test_a_json_files_first_record_is_checked_wherever_it_starts(tmp_path):
    from raytrain.data.sources import _check_json_column

    def refused(raw, message, name="a.jsonl"):
        (tmp_path / name).write_bytes(raw)
        with pytest.raises(ConfigError, match=message):
            inspect_source(DataConfig(), str(tmp_path / name))
        (tmp_path / name).unlink()

    refused(b'[{"body": "x"}, {"text": "y"}]', "data.text_column='text' is not a key of the records in .*a.json "
                                               "\\(keys: body\\)", "a.json")  # an array: its first record
    refused(b'[{"text": }]', "data.path: .*a.json is not a valid JSON array \\(Expecting value in its first record\\)",
            "a.json")
    refused(b'["x"]', "data.path: .*a.json \\(its first record\\) is a str, not a JSON object", "a.json")
    refused(b'"just text"\n', "data.path: .*a.jsonl line 1 is a str, not a JSON object: give JSON lines")
    refused(b'{"text": 5}\n', "data.text_column='text' holds int values in .*a.jsonl line 1, not text: set "
                              "data.text_column to the text key$")
    # the line a record is on counts the blank lines before it (line 3 here), as an editor does
    refused(b'\n\n{"text": oops}\n', "data.path: .*a.jsonl line 3 is not valid JSON \\(Expecting value\\)")
    # valid JSON, pretty-printed: was "line 1 is not valid JSON (Expecting property name ...)" for a `{` line
    refused(b'{\n  "data": [\n    {"text": "x"}\n  ]\n}\n', "^data.path: .*a.json holds JSON written over several "
            "lines \\(pretty-printed\\), which is neither JSON lines nor one array of records: write one object per "
            "line", "a.json")
    # the same past the first read (only the head of a file is read): the `{` line alone says it
    big = json.dumps({"data": [{"text": "x" * 50}] * 5000}, indent=2).encode()
    assert len(big) > 1 << 18
    refused(big, "^data.path: .*a.json holds JSON written over several lines \\(pretty-printed\\)", "a.json")
    refused(b'{"text": "x",\n', "a.jsonl line 1 is not valid JSON")  # the file ends there: cut short, not spread
    refused(b'{"text": "x"},\n{"text": "y"}\n', "a.jsonl line 1 is not valid JSON \\(Extra data\\)")
    refused(b'{"body": "x"}', "is not a key of the records in .*a.jsonl")  # no newline at the end: read all the same
    # a first line longer than one 64 KiB read: read on to its end (up to 1 MiB)
    (tmp_path / "long.jsonl").write_text('{"text": "' + "x" * 100_000 + '"}\n{"text": "y"}\n')
    source = inspect_source(DataConfig(), str(tmp_path / "long.jsonl"))
    assert source.format == "json"
    # whether a file held a record: on a remote filesystem the check stops at the first file that does
    for raw, held in ((b"\n\n", False), (b" [ ] ", False), (b'{"text": "x"}\n', True), (b'[{"text": "x"}]', True)):
        (tmp_path / "b.json").write_bytes(raw)
        assert _check_json_column(source, str(tmp_path / "b.json"), DataConfig(), "data.path", None) is held, raw


def test_invalid_utf8_in_a_head_and_first_records_longer_than_the_head(tmp_path):
    """data.invalid_utf8=error: the driver decodes what it reads (the first MiB at most), and a character cut by
    that MiB's end is not an error: the rest of the record is beyond it, left to the reader."""
    from raytrain.data.sources import _check_json_column

    error = DataConfig(invalid_utf8="error")
    fix = ": fix the file, or set data.invalid_utf8=replace to decode such bytes as U+FFFD (counted and reported)"
    (tmp_path / "a.txt").write_bytes(b"ok \xff\n")  # byte 3 of line 1 (the file's byte 3 too)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'a.txt'} line 1: invalid UTF-8 at byte 3{fix}")):
        inspect_source(DataConfig(invalid_utf8="error", text_document="line"), str(tmp_path / "a.txt"))
    assert inspect_source(DataConfig(), str(tmp_path / "a.txt")).format == "text"  # replace: read as U+FFFD
    (tmp_path / "a.txt").write_bytes(b"ok\nok \xff\n")
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'a.txt'} line 2: invalid UTF-8 at byte 3{fix}")):
        inspect_source(DataConfig(invalid_utf8="error", text_document="line"), str(tmp_path / "a.txt"))
    (tmp_path / "a.txt").unlink()
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')  # Latin-1: the 14th byte (byte 13) of line 1
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'b.jsonl'} line 1: invalid UTF-8 at byte 13{fix}")):
        inspect_source(error, str(tmp_path / "b.jsonl"))
    assert inspect_source(DataConfig(), str(tmp_path / "b.jsonl")).format == "json"
    (tmp_path / "b.jsonl").write_bytes(b'{"text": "caf\xc3')  # a file cut inside a character, as a failed download
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'b.jsonl'} line 1: invalid UTF-8 at byte 13{fix}")):
        inspect_source(error, str(tmp_path / "b.jsonl"))
    (tmp_path / "b.jsonl").unlink()
    (tmp_path / "c.json").write_bytes(b'[{"text": "caf\xe9"}]')  # an array: the file's byte 14 ('[' is byte 0)
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path / 'c.json'}: invalid UTF-8 at byte 14{fix}")):
        inspect_source(error, str(tmp_path / "c.json"))
    # ~2.2 MB each, "é" two bytes: a 1 MiB head ends inside an "é" in the text file ("a" first: 1 + 2k bytes) and the
    # array ('[{"text": "' is 11 bytes); the JSON line's 1 MiB holds no newline
    (tmp_path / "c.json").unlink()
    big = "é" * 1_100_000
    for name, text in (("d.txt", "a" + big), ("e.jsonl", '{"text": "' + big + '"}\n'),
                       ("f.json", '[{"text": "' + big + '"}]')):
        (tmp_path / name).write_text(text, encoding="utf-8")
        source = inspect_source(error, str(tmp_path / name))
        assert source.files == [str(tmp_path / name)]
        if source.format == "json":  # a record, though not read whole: a remote source's check stops at this file
            assert _check_json_column(source, str(tmp_path / name), error, "data.path", None) is True
        (tmp_path / name).unlink()


@pytest.mark.parametrize("name, raw, text_document, where", [
    # a document a line: the line, and the byte within it (not the file's byte 9)
    ("a.txt", b"fine\nbad \xff here\n", "line", "line 2: invalid UTF-8 at byte 4"),
    # a file a document: the file's byte, its byte order mark counted (the driver had dropped it: byte 9)
    ("b.txt", b"\xef\xbb\xbffine\nbad \xff\n", "file", ": invalid UTF-8 at byte 12"),
    ("c.txt.gz", gzip.compress(b"fine\nbad \xff\n"), "file", ": invalid UTF-8 at byte 9 of the decompressed text"),
    # an array: the file's byte, after the blank line and "[" (the driver had said line 1, byte 13)
    ("d.json", b'\n[{"text": "caf\xe9"}]', "file", ": invalid UTF-8 at byte 15"),
    # a JSON line: its byte from the line's start, leading blanks counted (the driver had said 13)
    ("e.jsonl", b'\n  {"text": "caf\xe9"}\n', "file", "line 2: invalid UTF-8 at byte 15"),
    # a blank first line: counted as a line, and the byte is counted from the start of the bad byte's own line
    ("f.txt", b"\nbad \xff\n", "line", "line 2: invalid UTF-8 at byte 4"),
], ids=["text-line", "text-file-bom", "text-file-gz", "json-array", "json-lines",
        "text-line-after-a-blank-line"])  # not gzip's bytes: xdist
def test_the_driver_names_the_invalid_byte_where_the_reader_does(tmp_path, name, raw, text_document, where):
    """data.invalid_utf8=error: the driver's check of the first MiB is "the readers' one-line error, found here
    first", so it names the line and byte the reader names for the same file (they differed in session 52)."""
    import pyarrow.fs as pafs

    from raytrain.data.readers import read_documents

    path = tmp_path / name
    path.write_bytes(raw)
    config = DataConfig(invalid_utf8="error", text_document=text_document)
    with pytest.raises(ConfigError) as driver:
        inspect_source(config, str(path))
    fmt = "json" if ".json" in name else "text"
    with pytest.raises(ConfigError) as reader:
        list(read_documents({"path": str(path)}, format=fmt, filesystem=pafs.LocalFileSystem(), text_column="text",
                            text_document=text_document, invalid_utf8="error"))
    assert str(driver.value) == str(reader.value)
    assert str(driver.value).startswith(f"{path}{' ' if where.startswith('line') else ''}{where}: fix the file")


def test_compressed_text_is_read_through_and_a_file_that_cannot_be_read_gets_a_fix_by_its_name(tmp_path):
    import lzma

    import pyarrow.fs as pafs

    from raytrain.data.sources import open_text, unreadable_fix

    # truncated: its first bytes decompress, its end does not; a compressed text file is read on (up to 1 MiB)
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(b"x" * 200_000)[:-20])
    with pytest.raises(ConfigError, match=re.escape(f"data.path: cannot read {tmp_path / 'a.txt.gz'} (Truncated "
                                                    f"compressed stream): its name says gzip-compressed")):
        inspect_source(DataConfig(), str(tmp_path / "a.txt.gz"))
    assert unreadable_fix("a.txt") == "check that it is readable, or leave it out of the data"
    assert unreadable_fix("a.JSONL.ZST") == ("its name says zstd-compressed: re-compress it whole (or fix its name), "
                                             "or leave it out of the data")
    (tmp_path / "b.txt.xz").write_bytes(lzma.compress(b"all of it"))
    with open_text(pafs.LocalFileSystem(), str(tmp_path / "b.txt.xz")) as f:
        assert f.read() == b"all of it" and not f.closed  # read() with no size: to the end, as a file's
    assert f.closed  # pyarrow's PythonFile (the CSV reader's stream) asks
    (tmp_path / "b.txt.xz").write_bytes(b"not xz at all")  # lzma's own error, made the OSError of any other codec
    with pytest.raises(ConfigError, match=re.escape(f"cannot read {tmp_path / 'b.txt.xz'} (xz: Input format not "
                                                    f"supported by decoder): its name says xz-compressed")):
        inspect_source(DataConfig(), str(tmp_path / "b.txt.xz"))
    (tmp_path / "c.parquet.gz").write_bytes(gzip.compress(b"x"))  # parquet compresses inside: not a format's name
    with pytest.raises(ConfigError, match="cannot tell the format of .*c.parquet.gz: set data.format to one of"):
        inspect_source(DataConfig(), str(tmp_path / "c.parquet.gz"))


def test_mixed_formats_point_at_the_subdirectory_holding_one_format_only(tmp_path):
    """The message's advice: the directory that holds one format's files and none of the others'."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "README.md").write_text("# card\n")
    for part, shard in (("a", "train-00000-of-00002.parquet"), ("b", "train-00001-of-00002.parquet")):
        (tmp_path / "data" / part).mkdir(parents=True)  # two subdirectories: pointed at their common parent
        pq.write_table(pa.table({"text": ["x"]}), tmp_path / "data" / part / shard)
    read = " (of its hub-named shards, those of the split 'train': data.hf_split)"
    with pytest.raises(ConfigError, match=re.escape(f"point data.path at {tmp_path / 'data'}, which holds the parquet "
                                                    f"files only{read}") + "$"):
        inspect_source(DataConfig(), str(tmp_path))  # the most files first: not docs/, which holds the text ones
    (tmp_path / "data" / "b" / "train-00001-of-00002.parquet").unlink()
    # one file each: on the tie the text file's directory comes last (.md and .txt beside data are usually its docs)
    with pytest.raises(ConfigError, match=re.escape(f"point data.path at {tmp_path / 'data' / 'a'}, which holds")):
        inspect_source(DataConfig(), str(tmp_path))
    (tmp_path / "data" / "a" / "notes.md").write_text("how it was made\n")  # text there too: no directory to name
    with pytest.raises(ConfigError, match="mixes formats: .*: give one format per path list"):
        inspect_source(DataConfig(), str(tmp_path))
    # counts tie: formats by name, json before text, whatever the files are called
    (tmp_path / "_two").mkdir()
    (tmp_path / "_two" / "a.txt").write_text("x")
    (tmp_path / "_two" / "z.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="mixes formats: 1 json file \\(.*z.jsonl\\) and 1 text file \\(.*a.txt\\)"):
        inspect_source(DataConfig(), str(tmp_path / "_two"))


def test_notes_say_what_a_source_leaves_unread_or_a_setting_changes_nothing(tmp_path, capsys):
    from raytrain.data.sources import inspect_sources

    (tmp_path / "a.txt").write_text("a document\n")
    (tmp_path / "README.md").write_text("# about this corpus\n")
    readme = (f"data.path: {tmp_path / 'README.md'} is read as a training document, like the text files beside it: "
              f"move it out, or list the files to read in data.path")
    assert inspect_sources(DataConfig(path=str(tmp_path))).notes == (readme,)
    inspect_sources(DataConfig(path=str(tmp_path))).say_notes()
    assert capsys.readouterr() == ("", f"raytrain: note: {readme}\n")  # diagnostics: on stderr
    assert inspect_sources(DataConfig(path=str(tmp_path / "README.md"))).notes == ()  # named alone: meant
    (tmp_path / "README.md").unlink()
    plain = inspect_sources(DataConfig(path=str(tmp_path)))
    assert (plain.notes, plain.train.split) == ((), None)
    assert inspect_sources(DataConfig(path=str(tmp_path), text_column="body")).notes == (
        "data.text_column='body' has no effect: text files have no columns (a file or a line is a document)",)
    (tmp_path / "sub").mkdir()  # a subdirectory is listed through, not a file "with another extension"
    (tmp_path / "sub" / "b.txt").write_text("another\n")
    assert inspect_sources(DataConfig(path=str(tmp_path))).notes == ()
    # a crawler's state.json beside text files: under data.format=text a file like any other (only data.format=
    # tokenized refuses a save_to_disk directory up front)
    (tmp_path / "state.json").write_text('{"page": 3}\n')
    assert len(inspect_sources(DataConfig(path=str(tmp_path), format="text")).train.files) == 3
    (tmp_path / "state.json").unlink()
    (tmp_path / "e.jsonl").write_text('{"body": "held out"}\n')
    # data.text_column names the eval records' key: not idle while one source has columns
    assert inspect_sources(DataConfig(path=str(tmp_path / "a.txt"), eval_path=str(tmp_path / "e.jsonl"),
                                      text_column="body")).notes == ()
    assert inspect_sources(DataConfig(path=str(tmp_path / "a.txt"), eval_path=str(tmp_path / "sub" / "b.txt"),
                                      eval_hf_split="test")).notes == (
        "data.eval_hf_split='test' has no effect: data.eval_path has no splits",)
    pq.write_table(pa.table({"input_ids": [[1, 2]]}), tmp_path / "t.parquet")
    assert inspect_sources(DataConfig(path=str(tmp_path / "t.parquet"))).notes == ()  # no labels column: no note
    assert inspect_sources(DataConfig(path=str(tmp_path / "t.parquet"), format="tokenized",
                                      text_column="body")).notes == (
        "data.text_column='body' has no effect: pre-tokenized data is read from its input_ids column",)
    pq.write_table(pa.table({"body": ["x"], "labels": ["y"]}), tmp_path / "p.parquet")  # labels of text: not a note
    parquet = inspect_sources(DataConfig(path=str(tmp_path / "p.parquet"), text_column="body"))
    assert (parquet.notes, parquet.train.column) == ((), "body")
    json_body = inspect_source(DataConfig(text_column="body"), str(tmp_path / "e.jsonl"))
    assert json_body.column == "text"  # the JSON reader yields its documents as "text", whatever the key
