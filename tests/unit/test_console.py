"""raytrain.console: the progress line's one definition and its parser, and the formats of long work."""

import pytest

from raytrain.console import Meter, format_bytes, format_count, format_duration, format_progress, parse_progress, status


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_formatting():
    assert [format_duration(s) for s in (0, 41.6, 252, 3600 * 2 + 300, 86400 * 3 + 3600 * 4, None, -1)] == \
        ["0s", "42s", "4m12s", "2h05m", "3d04h", "?", "?"]
    assert [format_bytes(n) for n in (512, 12_500, 4.8e9, 140e9, 1.2e12)] == \
        ["512 B", "12.5 kB", "4.80 GB", "140 GB", "1.20 TB"]
    assert [format_count(n) for n in (7, 999, 1234, 1.23e6, 310.2e6, 4.5e9, 2.5)] == \
        ["7", "999", "1.23k", "1.23M", "310M", "4.50B", "2.50"]


def test_status_with_and_without_a_total_or_a_rate():
    assert status(1.2e9, 4.8e9, 310e6, "B") == "1.20 GB of 4.80 GB (25%), 310 MB/s, ETA 12s"
    assert status(1640, 4000, 20, "documents") == \
        "1.64k documents of 4.00k documents (41%), 20 documents/s, ETA 1m58s"
    assert status(1.23e6, None, 2100, "documents") == "1.23M documents, 2.10k documents/s"
    assert status(0, 4.8e9, None, "B") == "0 B of 4.80 GB (0%), ETA ?"


def test_meter_is_due_every_few_seconds_never_at_the_end():
    clock = Clock()
    meter = Meter(total=100e6, every_s=5.0, clock=clock)
    due = []
    for _ in range(10):  # 10 MB per second
        clock.now += 1.0
        due.append(meter.add(10e6))
    assert due == [False, False, False, False, True, False, False, False, False, False]
    assert meter.line() == "100 MB of 100 MB (100%), 10.0 MB/s, ETA 0s"


@pytest.mark.parametrize("extra", [{}, {"mfu": 0.565}, {"mfu": 0.5, "eval_loss": 1.25, "eval_ppl": 3.49}])
def test_progress_line_parses_back_to_its_numbers(extra):
    metrics = {"step": 20, "loss": 1.29391, "lr": 1e-4, "grad_norm": 0.506, "tokens_per_s": 5251.4,
               "data_wait_frac": 0.002, "memory_gib": 0.69, "eta_s": 12.0, **extra}
    line = format_progress(metrics, 80)
    parsed = parse_progress("(RayTrainWorker pid=1) " + line)  # behind Ray's log prefix
    assert parsed["step"] == 20 and parsed["max_steps"] == 80
    assert parsed["loss"] == pytest.approx(1.2939) and parsed["tokens_per_s"] == 5251
    assert parsed["data_wait_frac"] == pytest.approx(0.002) and parsed["memory_gib"] == pytest.approx(0.69)
    assert ("mfu" in parsed) == ("mfu" in extra) and ("eval_loss" in parsed) == ("eval_loss" in extra)
    if "mfu" in extra:
        assert parsed["mfu"] == pytest.approx(extra["mfu"], abs=1e-3)
    assert parse_progress("raytrain: checkpoint step 20: 0.010 GiB") is None
