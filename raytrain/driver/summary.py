"""The end-of-run summary (driver): summary.md and loss_curve.png next to the run's checkpoints.

`write_summary` turns the metrics history of the final checkpoint into a table and a plot.
"""

from __future__ import annotations

import io
from typing import Any

from raytrain.checkpoint import layout


def write_summary(history: list[dict[str, Any]], final: dict[str, Any], storage_path: str, name: str) -> list[str]:
    """Write summary.md and loss_curve.png into the run directory; return their paths."""
    from matplotlib.figure import Figure  # not pyplot: leaves the caller's (a notebook's) backend alone

    rows = [("final step", f"{int(final['step'])}"), ("final loss", f"{final['loss']:.4f}")]
    # A session's first window holds its start-up (the workers' start, a restore, the data pipeline filling): a short
    # continued session's last window was such a window, and its tokens/s read as the run's speed.
    window = "last window, with this session's start-up" if _starts_a_session(final, len(history) - 1) else "last window"
    for key, label, fmt in (("eval_loss", "eval loss", "{:.4f}"), ("eval_ppl", "eval perplexity", "{:.2f}"),
                            ("tokens_per_s", f"tokens/s ({window})", "{:,.0f}"), ("mfu", f"MFU ({window})", "{:.1%}"),
                            ("memory_gib", "peak memory GiB", "{:.2f}"), ("data_wait_frac", "data wait", "{:.2%}")):
        if final.get(key) is not None:
            rows.append((label, fmt.format(final[key])))
    steady = [m for i, m in enumerate(history) if not _starts_a_session(m, i)]
    for key, label, fmt in (("tokens_per_s", "tokens/s (median of the windows after start-up)", "{:,.0f}"),
                            ("mfu", "MFU (median of the windows after start-up)", "{:.1%}")):
        values = sorted(m[key] for m in steady if m.get(key) is not None)
        if values:
            rows.append((label, fmt.format(values[len(values) // 2])))
    saves = [m for m in history if "checkpoint_save_s" in m]
    if saves:
        rows.append(("checkpoint save (last)", f"{saves[-1]['checkpoint_save_s']:.2f} s, "
                                               f"{saves[-1]['checkpoint_size_gib']:.3f} GiB"))
    table = "\n".join(["| metric | value |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in rows])
    text = f"# raytrain run {name}\n\n{table}\n\n![loss](loss_curve.png)\n"

    fig = Figure(figsize=(7, 4))
    ax = fig.add_subplot()
    ax.plot([m["step"] for m in history], [m["loss"] for m in history], label="train loss")
    evals = [m for m in history if m.get("eval_loss") is not None]
    if evals:
        ax.plot([m["step"] for m in evals], [m["eval_loss"] for m in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(name)
    ax.grid(alpha=0.3)
    ax.legend()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100, bbox_inches="tight")

    run = layout.run_uri(storage_path, name)
    fs, run_dir = layout.filesystem(run)
    fs.create_dir(run_dir, recursive=True)
    written = []
    for filename, data in (("summary.md", text.encode()), ("loss_curve.png", png.getvalue())):
        with fs.open_output_stream(f"{run_dir}/{filename}") as f:
            f.write(data)
        written.append(f"{run}/{filename}")
    return written


def _starts_a_session(window: dict[str, Any], index: int) -> bool:
    """Whether `window` (the history's `index`-th) is a session's first: the run's first, or the first after a
    restore (it carries resumed_from_step, raytrain.worker.metrics.TrainMetrics)."""
    return index == 0 or "resumed_from_step" in window
