"""Records of the user's data that cannot be trained on, found inside Ray Data tasks.

A bad record (a line that is not JSON, invalid UTF-8 under data.invalid_utf8=error, a text value
that is not a string, a token id beyond the embedding table) is the user's mistake, not a fault:
restarting the workers would read the same record again. So a task never raises one inside a run.
It reports the first it finds to the run's counter (raytrain.data.progress.Counter), which stops
the run at once through Ray Train's own abort, with no retry; then it reads on to the end of its
file only to count the others (yielding nothing more), and reports that count. The driver prints one
line, `raytrain: error: FILE line N: WHAT (and K more bad records): FIX`, and exits 2
(raytrain.driver.watch).

A read error that may pass (a dropped connection, S3's throttling: raytrain.data.sources.transient) is
not one: the file is read again (raytrain.data.readers._with_retries), and only an error that outlasts
those reads becomes the file's bad record.

Outside a run (no counter: a dataset read by a test or by `raytrain.tools.bench_data`) the task
raises the BadRecord itself, as any ConfigError.

A Train worker stops the run the same way for a mistake in the user's setup that it finds as it starts
(`SetupMistake`: a package the config needs missing on its node), which a restart would meet again.
"""

from __future__ import annotations

import time
from typing import NoReturn

from raytrain.config import ConfigError
from raytrain.data.progress import bad_record, more_bad_records


class BadRecord(ConfigError):
    """One bad record: where it is (file and line, or None for a row source), what is wrong, the fix."""

    def __init__(self, where: str | None, what: str, fix: str, more: int = 0):
        self.where, self.what, self.fix, self.more = where, what, fix, more
        super().__init__(self.line())

    def line(self) -> str:
        """`FILE line N: WHAT (and K more bad records): FIX` (the parenthesis only when K > 0)."""
        head = f"{self.where}: {self.what}" if self.where else self.what
        more = f" (and {self.more:,} more bad record{'s' if self.more != 1 else ''})" if self.more else ""
        return f"{head}{more}: {self.fix}"

    def with_more(self, more: int) -> "BadRecord":
        return BadRecord(self.where, self.what, self.fix, more)

    def same(self, other: "BadRecord") -> bool:
        """`other` is this record found again (every rank finding no step, a retried task), not another one."""
        return type(other) is type(self) and other.line() == self.line()

    def __reduce__(self):  # crosses processes (task -> counter actor -> driver) with its fields
        return BadRecord, (self.where, self.what, self.fix, self.more)


class SetupMistake(BadRecord):
    """A mistake in the user's setup that a Train worker finds as it starts, before it builds anything: a package
    the config needs, missing on the worker's node (`where`: "node HOST"). A restart would meet it again, so it
    stops the run as a bad record does (one line, exit 2, no retry), where an exception would be retried as a
    worker failure checkpoint.max_failures times, each after a group restart. Every worker of such a node, and
    every node like it, finds the same mistake: one line names the first node, the others are not counted
    (`same`: the same `what`, whatever the node)."""

    def with_more(self, more: int) -> "SetupMistake":
        return self  # only the first is said: the others are the same mistake on other nodes

    def same(self, other: BadRecord) -> bool:
        return type(other) is type(self) and (other.what, other.fix) == (self.what, self.fix)

    def __reduce__(self):
        return SetupMistake, (self.where, self.what, self.fix)


class BadRecords:
    """One task's bad records: the first reported at once (it stops the run), the rest counted.

    `counter`: the run's counter actor name (None: raise the first one instead)."""

    def __init__(self, counter: str | None):
        self._counter = counter
        self.first: BadRecord | None = None
        self._more = 0

    @property
    def found_any(self) -> bool:
        return self.first is not None

    def found(self, record: BadRecord, more: int = 0) -> None:
        """`record`, and `more` like it right behind it (a batch's other bad values)."""
        if self._counter is None:
            raise record.with_more(more) if more else record
        if self.first is None:
            self.first = record
            bad_record(self._counter, record)  # waits until the counter has it: the run is stopping
            self._more += more
        else:
            self._more += 1 + more

    def close(self) -> None:
        """The task is done: send the count of the bad records after its first one."""
        if self._more:
            more_bad_records(self._counter, self._more)
            self._more = 0


STOP_WAIT_S = 60.0
"""How long a Train worker that found a bad record waits for the run's abort to end it (it takes
about a second: Ray Train's controller kills the worker group) before raising the record instead."""


STREAM_CUT_WAIT_S = 15.0
"""How long a worker whose data stream came back empty waits before calling that the user's data
(`stop_run(..., empty_stream=True)`). A worker group being stopped (an elastic resize, another
worker's failure) can see its streams end while it still runs: Ray Train 2.60 asks its workers to
shut down, waits up to 5 s, then kills them (`_shutdown_workers`), and shuts the datasets' executors
down after that. Reported at once, that cut read as "yields no step" and ended the whole run with
exit 2; waited out, the kill comes first and the group's successor reads on. Costs a user whose data
really is too short 15 s before the one line."""


def stop_run(record: BadRecord, counter: str | None, empty_stream: bool = False) -> NoReturn:
    """A bad record found by a Train worker (no step in the training data, no eval row): reported to
    the run's counter, which stops the run through Ray Train's abort; the worker then waits to be
    killed rather than raising. An exception out of the training function is printed by Ray Train
    with its traceback ("Error in training function", ~25 lines) before the driver, polling the
    counter every 0.5 s, stops printing the workers' output: the user's one line came after it.
    (The eval check escaped this only by chance: its exception first waited up to 2 s in the loop's
    `finally` for the prefetch thread, and the abort killed the worker in that time.) Raises the
    record without a counter (outside a run), or if the abort has not come in STOP_WAIT_S.
    `empty_stream`: the record is a stream that came back empty, which a stopping group sees too
    (STREAM_CUT_WAIT_S)."""
    if empty_stream and counter is not None:
        _wait_for_kill(STREAM_CUT_WAIT_S)
    BadRecords(counter).found(record)  # without a counter it raises
    _wait_for_abort(STOP_WAIT_S)
    raise record


def _wait_for_abort(wait_s: float) -> None:
    time.sleep(wait_s)


def _wait_for_kill(wait_s: float) -> None:
    time.sleep(wait_s)
