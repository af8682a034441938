"""The end-of-run summary (raytrain.driver.summary): a markdown table and a loss curve PNG."""

import math

from raytrain.driver.summary import write_summary

HISTORY = [{"step": s, "loss": 5.0 / s, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1000.0 + s,
            "data_wait_frac": 0.01, "memory_gib": 0.5, "step_time_s": 0.1, "eta_s": 0.0} for s in (5, 10, 15)]
HISTORY[-1].update(checkpoint_save_s=0.5, checkpoint_size_gib=0.01, checkpoint_gbps=0.02, eval_loss=0.4, eval_ppl=math.e ** 0.4)


def test_summary_has_a_table_and_a_loss_curve(tmp_path):
    paths = write_summary(HISTORY, HISTORY[-1], str(tmp_path), "run3")
    md = (tmp_path / "run3" / "summary.md").read_text()
    assert "| final loss | 0.3333 |" in md and "| eval loss | 0.4000 |" in md and "checkpoint save" in md
    png = (tmp_path / "run3" / "loss_curve.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    assert len(paths) == 2


def test_a_sessions_first_window_is_labelled_with_its_start_up_and_left_out_of_the_median(tmp_path):
    # a continued session of one window: its speed holds the restart (measured by a day-2 reviewer: the summary read
    # the start-up window as the run's tokens/s)
    history = [dict(HISTORY[0], tokens_per_s=300.0), dict(HISTORY[1], tokens_per_s=1000.0),
               dict(HISTORY[2], tokens_per_s=1020.0),
               dict(HISTORY[2], step=20, tokens_per_s=250.0, resumed_from_step=15)]
    write_summary(history, history[-1], str(tmp_path), "cont")
    md = (tmp_path / "cont" / "summary.md").read_text()
    assert "| tokens/s (last window, with this session's start-up) | 250 |" in md
    assert "| tokens/s (median of the windows after start-up) | 1,020 |" in md  # 1,000 and 1,020: not 300, not 250
    write_summary(HISTORY, HISTORY[-1], str(tmp_path), "plain")
    md = (tmp_path / "plain" / "summary.md").read_text()
    assert "| tokens/s (last window) | 1,015 |" in md
    assert "| tokens/s (median of the windows after start-up) | 1,015 |" in md  # the first window (1,005) left out
    write_summary(HISTORY[:1], HISTORY[0], str(tmp_path), "one")  # one window: all of it start-up, no median
    md = (tmp_path / "one" / "summary.md").read_text()
    assert "| tokens/s (last window, with this session's start-up) | 1,005 |" in md and "median" not in md


def test_the_loss_curve_draws_the_eval_loss_where_the_run_evaluated(tmp_path):
    without = [{k: v for k, v in m.items() if not k.startswith("eval_")} for m in HISTORY]
    for name, history in (("evals", HISTORY), ("none", without), ("none-again", without)):
        write_summary(history, history[-1], str(tmp_path / name), "r")
    png = {name: (tmp_path / name / "r" / "loss_curve.png").read_bytes() for name in ("evals", "none", "none-again")}
    assert png["none"] == png["none-again"] and png["evals"] != png["none"]  # drawn the same each time, bar the curve
