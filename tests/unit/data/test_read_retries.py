"""A read error that may pass (a dropped connection, S3's throttling) reads the file again instead of
stopping the run as a damaged file (raytrain.data.readers._with_retries, raytrain.data.sources.transient).

The storage is a real pyarrow filesystem over fsspec's local one (what pyarrow wraps for gcsfs, adlfs and the
like) whose reads fail like S3's after some bytes, for a number of opens: object storage is not reachable
here, and its errors are what this is about."""

import errno
import gzip
import io
import json
import logging

import fsspec.implementations.local
import pyarrow as pa
import pyarrow.fs as pafs
import pytest

from raytrain.config import ConfigError
from raytrain.data import readers
from raytrain.data.sources import transient

S3_DROP = ("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 56, Failure when receiving data "
           "from the peer")


class _Dropped(io.FileIO):
    """A file whose reads fail with `error` once `after` bytes were read through this handle. A read across
    that point returns the bytes before it (a stream's short read), or (`whole_reads`: a random-access read,
    which pyarrow takes short as a file too short) fails."""

    def __init__(self, path, after, error, whole_reads):
        super().__init__(path, "rb")
        self._left, self._error, self._whole = after, error, whole_reads

    def read(self, n=-1):
        if self._left <= 0 or (self._whole and (n is None or n < 0 or n > self._left)):
            raise self._error
        data = super().read(self._left if n is None or n < 0 else min(n, self._left))
        self._left -= len(data)
        return data

    def readinto(self, buffer):
        data = self.read(len(buffer))
        buffer[:len(data)] = data
        return len(data)


class _Flaky(fsspec.implementations.local.LocalFileSystem):
    cachable = False  # fsspec keeps one instance per arguments otherwise: the counts would be shared

    def __init__(self, failures, after=4096, error=OSError(S3_DROP), whole_reads=False):
        super().__init__()
        self.failures, self.after, self.error, self.whole, self.opens = failures, after, error, whole_reads, 0

    def _open(self, path, mode="rb", **kwargs):
        self.opens += 1
        if "r" in mode and self.opens <= self.failures:
            return _Dropped(path, self.after, self.error, self.whole)
        return super()._open(path, mode, **kwargs)


def flaky(failures, **kwargs):
    fs = _Flaky(failures, **kwargs)
    return fs, pafs.PyFileSystem(pafs.FSSpecHandler(fs))


@pytest.fixture(autouse=True)
def no_backoff(monkeypatch):
    monkeypatch.setattr(readers, "_MAX_BACKOFF_S", 0.001)  # Ray Data's backoff, shortened: minutes at 10 tries


def documents(path, fmt, filesystem, **kwargs):
    options = {"text_column": "text", "text_document": "line", "invalid_utf8": "replace", **kwargs}
    return [r["text"] for r in readers.read_documents({"path": str(path)}, format=fmt, filesystem=filesystem,
                                                      **options)]


def test_what_may_pass_and_what_does_not():
    assert transient(ConnectionResetError(errno.ECONNRESET, "Connection reset by peer"))
    assert transient(TimeoutError("timed out")) and transient(OSError(errno.ENETUNREACH, "Network is unreachable"))
    assert transient(OSError(S3_DROP)) and transient(OSError("AWS Error SLOW_DOWN during GetObject operation"))
    assert not transient(OSError("zlib inflate failed: incorrect header check"))
    assert not transient(OSError("Couldn't deserialize thrift: TProtocolException: Invalid data"))
    assert not transient(PermissionError(errno.EACCES, "Permission denied"))
    # the user's own storage's errors, added where Ray Data takes them for its own reads
    from ray.data import DataContext

    context = DataContext.get_current()
    error = OSError("google::cloud::Status(UNAVAILABLE: Connection closed)")
    assert not transient(error)
    context.retried_io_errors.append(r"Status\(UNAVAILABLE")
    try:
        assert transient(error)
    finally:
        context.retried_io_errors.remove(r"Status\(UNAVAILABLE")


@pytest.mark.parametrize("name", ["a.jsonl", "a.jsonl.gz", "a.csv", "a.txt"])
def test_a_dropped_read_reads_the_file_again_and_every_document_comes_once(tmp_path, caplog, name):
    lines = [f"document {i} " + "x" * (i % 50) for i in range(3000)]
    fmt = {"a.jsonl": "json", "a.jsonl.gz": "json", "a.csv": "csv", "a.txt": "text"}[name]
    if fmt == "json":
        data = "".join(json.dumps({"text": t}) + "\n" for t in lines).encode()
    elif fmt == "csv":
        data = ("text\n" + "".join(f"{t}\n" for t in lines)).encode()
    else:
        data = "".join(f"{t}\n" for t in lines).encode()
    (tmp_path / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    fs, filesystem = flaky(failures=2, after=2000)  # twice, after some documents came out
    with caplog.at_level(logging.WARNING, logger="raytrain.data"):
        assert documents(tmp_path / name, fmt, filesystem) == lines
    assert fs.opens == 3
    assert caplog.text.count(f"{tmp_path / name}: cannot be read (") == 2
    assert "reading it again in" in caplog.text and "(attempt 3 of 10)" in caplog.text


def test_a_file_that_fails_every_time_is_one_bad_record_after_ten_reads(tmp_path, monkeypatch):
    f = tmp_path / "a.jsonl"
    f.write_text("".join(json.dumps({"text": f"d{i}"}) + "\n" for i in range(500)))
    fs, filesystem = flaky(failures=100, after=100)
    with pytest.raises(ConfigError) as e:
        documents(f, "json", filesystem)
    assert fs.opens == readers.READ_ATTEMPTS == 10
    assert str(e.value) == (f"{f}: cannot be read ({S3_DROP}), 10 times: check the storage (its connection, "
                            f"credentials and limits), then run again")
    # in a run: one bad record for the counter (which stops the run), the documents before it only once
    told = []
    monkeypatch.setattr("raytrain.data.bad_records.bad_record", lambda name, record: told.append(record))
    monkeypatch.setattr(readers, "skipped", lambda name, where, **counts: None)  # the counter actor's, not Ray's
    fs, filesystem = flaky(failures=100, after=300)
    got = documents(f, "json", filesystem, counter="c")
    assert got == [f"d{i}" for i in range(len(got))] and 0 < len(got) < 500
    assert [r.what for r in told] == [f"cannot be read ({S3_DROP}), 10 times"]


def test_a_damaged_file_is_read_once(tmp_path):
    f = tmp_path / "a.jsonl.gz"
    full = gzip.compress(b"".join(b'{"text": "line %d"}\n' % i for i in range(2000)))
    f.write_bytes(full[:len(full) // 2])  # cut short: the same at every read
    fs, filesystem = flaky(failures=0)
    with pytest.raises(ConfigError, match=f"^{f}: cannot be read \\(.*\\): its name says gzip-compressed"):
        documents(f, "json", filesystem)
    assert fs.opens == 1
    # an error that does not pass by its type or message, read once too
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n' * 100)
    fs, filesystem = flaky(failures=5, after=10, error=PermissionError(errno.EACCES, "Permission denied"))
    with pytest.raises(ConfigError, match="Permission denied\\): check that it is readable"):
        documents(tmp_path / "b.jsonl", "json", filesystem)
    assert fs.opens == 1


@pytest.mark.parametrize("pretokenized", [False, True])
def test_parquet_rows_after_a_dropped_read(tmp_path, pretokenized):
    import pyarrow.parquet as pq

    column = "input_ids" if pretokenized else "text"
    values = [[i, i + 1, i + 2] for i in range(20_000)] if pretokenized else [f"doc {i}" for i in range(20_000)]
    pq.write_table(pa.table({column: values}), tmp_path / "a.parquet", row_group_size=2_000, compression="none")
    size = (tmp_path / "a.parquet").stat().st_size
    fs, filesystem = flaky(failures=1, after=size // 2, whole_reads=True)  # the footer and some row groups read
    rows = list(readers.read_parquet_rows({"path": str(tmp_path / "a.parquet")}, filesystem=filesystem,
                                          column=column, pretokenized=pretokenized))
    assert fs.opens == 2
    got = [r[column].tolist() for r in rows] if pretokenized else [r[column] for r in rows]
    assert got == values
