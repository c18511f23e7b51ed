"""Pictures: the memory timeline of a profiled run (PNG and a self-contained HTML page) and the fit curve."""

from __future__ import annotations

import html
import io
from pathlib import Path

from vramguard.runtime.device import StepSample


def _figure_timeline(samples: list[StepSample], base_t: float, title: str, plan_peak: int | None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(10, 4.8), dpi=110)
    gib = 2**30
    ts = [s.t_s for s in samples]
    if samples:  # each step's peak spans the interval that ends at its sample (the prefill from 0 to the first)
        peaks = [s.peak_allocated / gib for s in samples]
        ax.step([base_t] + ts, [peaks[0]] + peaks, where="pre", color="#d62728", lw=1,
                label="peak allocated in the step")
    ax.plot(ts, [s.allocated / gib for s in samples], color="#1f77b4", lw=1.6, label="allocated after the step")
    ax.plot(ts, [s.reserved / gib for s in samples], color="#2ca02c", lw=1.2, ls="--", label="reserved")
    if samples:
        ax.axvspan(0, samples[0].t_s, color="#ff7f0e", alpha=0.12, label="prefill")
        ax.axvspan(samples[0].t_s, samples[-1].t_s, color="#9467bd", alpha=0.06, label="decode")
    if plan_peak:
        ax.axhline(plan_peak / gib, color="black", lw=0.8, ls=":", label="planned peak")
    ax.set_xlabel("seconds since generate() started")
    ax.set_ylabel("GiB (2^30 bytes)")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def write_timeline(samples: list[StepSample], out_dir: str | Path, title: str, table_html: str = "",
                   plan_peak: int | None = None) -> tuple[Path, Path]:
    """Write ``timeline.png`` and ``timeline.html`` (the SVG inline, no external resource) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig = _figure_timeline(samples, 0.0, title, plan_peak)
    png = out / "timeline.png"
    fig.savefig(png)
    buf = io.StringIO()
    fig.savefig(buf, format="svg")
    import matplotlib.pyplot as plt
    plt.close(fig)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg"):]
    page = (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em} table{border-collapse:collapse} "
            "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right} td:first-child{text-align:left}</style>"
            f"</head><body><h2>{html.escape(title)}</h2>{svg}{table_html}</body></html>")
    page_path = out / "timeline.html"
    page_path.write_text(page, encoding="utf-8")
    return png, page_path


def write_fit_plot(values: list[int], peaks: list[int | None], ok: list[bool], budget: int, vary: str,
                   boundary: int | None, path: str | Path, title: str) -> Path:
    """Measured peak against the varied value, failures marked, with the budget line (PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gib = 2**30
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    xs = [v for v, k in zip(values, ok) if k]
    ys = [p / gib for p, k in zip(peaks, ok) if k and p is not None]
    ax.scatter(xs[:len(ys)], ys, color="#1f77b4", label="completed: measured peak allocated")
    fails = [v for v, k in zip(values, ok) if not k]
    if fails:
        ax.scatter(fails, [budget / gib] * len(fails), marker="x", color="#d62728", s=60, label="out of memory")
    ax.axhline(budget / gib, color="black", lw=1, ls="--", label="budget")
    if boundary:
        ax.axvline(boundary, color="#2ca02c", lw=1, ls=":", label=f"boundary {boundary:,}")
    ax.set_xlabel(vary)
    ax.set_ylabel("GiB (2^30 bytes)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
