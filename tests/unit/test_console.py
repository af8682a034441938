"""raytrain.console: the progress line's one definition and its parser, the formats of long work, and the
command lines' number flags and one-line errors."""

import argparse
import math

import pytest

from raytrain.console import (ArgumentParser, Meter, add_config_flag, emit, flag_number, format_bytes, format_count,
                              format_duration, format_progress, one_config, parse_progress, say, status)


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


@pytest.mark.parametrize("seconds, shown", [
    (59.4, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"), (86399, "23h59m"), (86400, "1d00h"),
    (float("nan"), "?")])
def test_a_duration_changes_units_at_a_whole_minute_hour_and_day(seconds, shown):
    assert format_duration(seconds) == shown


@pytest.mark.parametrize("n, count, size", [
    (999, "999", "999 B"), (1000, "1.00k", "1.00 kB"), (9.5e3, "9.50k", "9.50 kB"), (99.5e3, "99.5k", "99.5 kB"),
    (1e6, "1.00M", "1.00 MB"), (1e9, "1.00B", "1.00 GB"), (1e12, "1.00T", "1.00 TB"), (-1234, "-1.23k", "-1.23 kB"),
    (99.5, "99.5", "100 B"), (9.5, "9.50", "10 B")])
def test_counts_and_sizes_have_three_significant_digits_and_the_prefix_from_1000_up(n, count, size):
    assert (format_count(n), format_bytes(n)) == (count, size)


def test_status_of_empty_work_is_complete():
    """A total of 0 (an empty input): 100%, not a division by zero; up to the total, the share done."""
    assert status(0, 0, None, "B") == "0 B of 0 B (100%), ETA ?"
    assert status(0, 1, 2.0, "documents") == "0 documents of 1 documents (0%), 2 documents/s, ETA 0s"


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


def test_meter_rates_from_its_start_and_has_no_rate_before_time_has_passed():
    clock = Clock()
    meter = Meter(total=100e6, clock=clock)
    meter.add(10e6)
    assert meter.line() == "10.0 MB of 100 MB (10%), ETA ?"
    clock.now += 0.5
    assert meter.line() == "10.0 MB of 100 MB (10%), 20.0 MB/s, ETA 4s"


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


@pytest.mark.parametrize("kind, bounds, text, parsed", [
    (float, {"above": 0}, "0.5", 0.5), (float, {"above": 0}, "1e3", 1000.0), (float, {"minimum": 0}, "0", 0.0),
    (int, {"minimum": 1}, "1", 1), (int, {"minimum": 0}, "0", 0),
    (float, {"above": 0}, "0", "must be > 0, got 0"), (float, {"above": 0}, "-5", "must be > 0, got -5"),
    (float, {"minimum": 0}, "-0.5", "must be >= 0, got -0.5"), (int, {"minimum": 1}, "0", "must be >= 1, got 0"),
    (float, {"above": 0}, "abc", "must be a number, got 'abc'"),
    (int, {"minimum": 1}, "2.5", "must be an integer, got '2.5'"),
    (float, {"above": 0}, "1e400", "must be a finite number, got 1e400 (too large for a float)"),
    (float, {"minimum": 0}, "-1e400", "must be a finite number, got -1e400 (too large for a float)"),
    (float, {"above": 0}, "inf", "must be a finite number > 0, got inf"),
    (float, {"above": 0}, "-Infinity", "must be a finite number > 0, got -Infinity"),
    (float, {"minimum": 0}, "nan", "must be a finite number >= 0, got nan"),
])
def test_a_number_flag_takes_numbers_in_its_range_and_says_what_it_must_be(kind, bounds, text, parsed):
    parse = flag_number(kind, **bounds)
    assert parse.__name__ == kind.__name__
    if isinstance(parsed, str):
        with pytest.raises(argparse.ArgumentTypeError, match=f"^{parsed.replace('(', '[(]').replace(')', '[)]')}$"):
            parse(text)
    else:
        value = parse(text)
        assert value == parsed and type(value) is kind and math.isfinite(value)


def test_a_command_line_mistake_is_one_line_on_stderr_and_exit_2(capsys):
    parser = ArgumentParser(prog="raytrain-plan")
    parser.add_argument("--gpu-memory-gib", type=flag_number(float, above=0))
    add_config_flag(parser, "a YAML file")
    assert parser.parse_args(["--gpu-memory-gib", "80"]).gpu_memory_gib == 80.0
    for argv, what in ((["--gpu-mem", "80"], "unrecognized arguments: --gpu-mem 80"),  # never an abbreviation
                       (["--gpu-memory-gib", "0"], "argument --gpu-memory-gib: must be > 0, got 0")):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        assert e.value.code == 2
        assert capsys.readouterr() == ("", f"raytrain: error: {what} (see raytrain-plan --help)\n")


@pytest.mark.parametrize("configs, chosen", [(None, None), ([], None), (["a.yaml"], "a.yaml")])
def test_one_config_file_is_taken(configs, chosen):
    assert one_config(ArgumentParser(prog="raytrain"), configs) == chosen


def test_a_second_config_file_is_refused_not_dropped(capsys):
    parser = ArgumentParser(prog="raytrain")
    add_config_flag(parser, "a YAML file")
    with pytest.raises(SystemExit) as e:
        one_config(parser, parser.parse_args(["--config", "a.yaml", "--config", "b.yaml"]).config)
    assert e.value.code == 2
    assert capsys.readouterr().err == ("raytrain: error: --config is given 2 times (a.yaml, b.yaml): give one file "
                                       "(move the other's settings into it, or give them as KEY=VALUE) "
                                       "(see raytrain --help)\n")


def test_say_writes_a_line_to_stdout_or_stderr_and_emit_to_the_real_stdout(capfd):
    say("raytrain: one")
    say("raytrain: note: two", err=True)
    emit("step 1/2")
    assert capfd.readouterr() == ("raytrain: one\nstep 1/2\n", "raytrain: note: two\n")
