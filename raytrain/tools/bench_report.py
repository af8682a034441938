"""What `python -m raytrain.tools.bench` writes and samples besides the paths' own numbers: the
markdown table of every result, and the host's used memory while each path runs."""

from __future__ import annotations

from typing import Any

HOST_SAMPLE_S = 2.0


class HostSampler:
    """The host's used memory (psutil: total - free - buffers - cache) every HOST_SAMPLE_S while a path
    runs, in a thread of the parent: its peak, and the level before the path started."""

    def __init__(self, every_s: float = HOST_SAMPLE_S):
        import threading

        self.every_s, self.peak, self.start = every_s, 0, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while True:
            self.peak = max(self.peak, psutil.virtual_memory().used)
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "HostSampler":
        import psutil

        # the start is the interval's first sample: a path that frees more than it takes (another process on the
        # host ending) would otherwise report a peak under its start (a .ci/run: 6.403278 < 6.403282 GiB)
        self.start = self.peak = psutil.virtual_memory().used
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, float]:
        return {"host_used_start_gib": self.start / 2**30, "host_used_peak_gib": self.peak / 2**30,
                "host_sample_s": self.every_s}


def markdown_table(records: list[dict[str, Any]]) -> str:
    def num(v, fmt, suffix=""):
        return "" if v is None else format(v, fmt) + suffix

    def pct(v):
        return "" if v is None else f"{100 * v:.1f}%"

    head = ("| variant | path | status | params | mb x gas | tokens/s | MFU | peak mem GiB | host used GiB | "
            "data wait | step s | fwd s | bwd s | opt s | comm s |")
    rows = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in records:
        s = r.get("settings", {})
        status = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('error', '')[:80]}"
        params = r.get("num_params")
        ds = r.get("ds_config") or {}  # what ran (an "auto" micro-batch is the planner's choice)
        batch = (f"{ds.get('train_micro_batch_size_per_gpu', s.get('micro_batch', ''))} x "
                 f"{ds.get('gradient_accumulation_steps', s.get('grad_accum', ''))}")
        host = r.get("host_used_peak_gib")
        rows.append("| " + " | ".join([
            str(r.get("label", "")), r["path"], status.replace("|", "/").replace("\n", " "),
            num(params and params / 1e9, ".2f", "B"), batch,
            num(r.get("tokens_per_s"), ",.0f"), pct(r.get("mfu")), num(r.get("peak_mem_gib"), ".1f"),
            "" if host is None else f"{host:.1f} (from {r['host_used_start_gib']:.1f})",
            pct(r.get("data_wait_frac")), num(r.get("step_time_s"), ".3f"), num(r.get("forward_s"), ".3f"),
            num(r.get("backward_s"), ".3f"), num(r.get("optimizer_s"), ".3f"), num(r.get("comm_s"), ".3f")]) + " |")
    return "\n".join(rows) + "\n"
