"""``profile``: a measured run beside the plan: weights, prefill peak, KV growth per token, decode peak, reserved
against allocated, fragmentation, memory outside PyTorch, TTFT and decode ms/token; a memory timeline picture."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from vramguard.profile.timeline import write_timeline
from vramguard.resolve import local_model_folder
from vramguard.runtime.load import LoadedModel, load_model, unload
from vramguard.runtime.device import StepSample, require_cuda
from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES
from vramguard.plan import choose, estimate
from vramguard.profile.measured_run import RunResult, run_generate
from vramguard.settings import Settings


@dataclass
class ProfileRow:
    """One measured quantity beside the plan's prediction (bytes; ``rel`` = (measured - planned) / planned)."""

    name: str
    measured: int | None
    planned: int | None

    @property
    def diff(self) -> int | None:
        return None if self.measured is None or self.planned is None else self.measured - self.planned

    @property
    def rel(self) -> float | None:
        return None if self.diff is None or not self.planned else self.diff / self.planned


@dataclass
class ProfileReport:
    """Rows of measured against planned bytes, timings, the per-step samples and the files written."""

    model: str
    settings: dict
    rows: list[ProfileRow]
    ttft_s: float | None
    decode_ms_per_token: float | None
    samples: list[StepSample]
    files: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def kv_growth_per_token(samples: list[StepSample]) -> int | None:
    """Least-squares slope of allocated bytes over the decode steps (steps 1..n), bytes per token."""
    pts = [(s.step, s.allocated) for s in samples[1:]]
    if len(pts) < 3:
        return None
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    den = sum((x - mx) ** 2 for x, _ in pts)
    return int(round(sum((x - mx) * (y - my) for x, y in pts) / den)) if den else None


def build_rows(run: RunResult, weights_bytes: int | None, spec, s: Settings) -> list[ProfileRow]:
    """The profile table from one run's samples and the plan of the same settings."""
    est = estimate(choose(spec, s).model, s)
    base = est.weights.total_bytes + CUBLAS_WORKSPACE_BYTES
    pre = run.samples[0] if run.samples else None
    dec = run.samples[1:]
    frag = max((x.reserved - x.allocated for x in run.samples), default=None)
    split = max((x.inactive_split for x in run.samples), default=None)
    return [
        ProfileRow("weights", weights_bytes, est.weights.total_bytes),
        ProfileRow("prefill peak allocated", pre.peak_allocated if pre else None, base + est.prefill.peak_bytes),
        ProfileRow("KV growth per generated token", kv_growth_per_token(run.samples), est.kv_bytes_per_token),
        ProfileRow("decode peak allocated", max((x.peak_allocated for x in dec), default=None),
                   base + est.decode.peak_bytes if est.decode else None),
        ProfileRow("peak allocated", run.peak_allocated, est.peak_allocated_bytes),
        ProfileRow("peak reserved", run.peak_reserved, est.peak_reserved_bytes),
        ProfileRow("reserved minus allocated (largest)", frag, est.allocator_reserve_bytes),
        ProfileRow("inactive split blocks (largest)", split, None),
        ProfileRow("memory outside PyTorch", run.end_device_used - run.end_reserved if run.ok else None,
                   est.cuda_context_bytes),
    ]


def _table_html(rows: list[ProfileRow]) -> str:
    out = ["<table><tr><th>quantity</th><th>measured (B)</th><th>planned (B)</th><th>difference</th></tr>"]
    for r in rows:
        rel = f"{r.rel:+.2%}" if r.rel is not None else ""
        out.append(f"<tr><td>{html.escape(r.name)}</td><td>{'' if r.measured is None else f'{r.measured:,}'}</td>"
                   f"<td>{'' if r.planned is None else f'{r.planned:,}'}</td><td>{rel}</td></tr>")
    return "".join(out) + "</table>"


def profile(model: str | LoadedModel, s: Settings, out_dir: str | None = None, memory_snapshot: bool = False,
            warmup: bool = True) -> ProfileReport:
    """Load ``model`` (or use a loaded one), warm up, run ``generate`` once under measurement, compare with the plan.

    Raises:
        NoCudaGpu: no CUDA device (profile measures GPU memory). Loading errors of :func:`load_model`.
    """
    import torch
    if not isinstance(model, LoadedModel):
        local_model_folder(model)  # a missing path or a name with no weights is said before anything else
    require_cuda("profile", "profile measures GPU memory: run it on a machine with an NVIDIA GPU (vramguard plan "
                 "predicts without one)")
    loaded = model if isinstance(model, LoadedModel) else load_model(
        model, quant=s.quant, double_quant=s.double_quant, compute_dtype=s.compute_dtype,
        attn="sdpa" if s.attn == "sdpa" else s.attn)
    name = loaded.report.model
    spec = loaded.spec
    if warmup:
        run_generate(loaded.model, s.with_(prompt_tokens=16, max_new_tokens=2, batch=1))
    if memory_snapshot:
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    run = run_generate(loaded.model, s)
    report = ProfileReport(name, s.as_dict(), build_rows(run, loaded.report.weights_bytes, spec, s),
                           run.samples[0].t_s if run.samples else None,
                           ((run.samples[-1].t_s - run.samples[0].t_s) * 1000 / (len(run.samples) - 1))
                           if len(run.samples) > 1 else None, run.samples)
    if not run.ok:
        report.notes.append(f"the run ran out of memory: {run.error}")
    if out_dir:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        title = (f"{Path(name).name}: {s.quant}, {s.attn}, batch {s.batch}, prompt {s.prompt_tokens:,} + "
                 f"{s.max_new_tokens:,} new tokens")
        png, page = write_outputs(report, out, title)
        report.files.update(png=str(png), html=str(page))
        if memory_snapshot:
            snap = out / "memory_snapshot.pickle"
            torch.cuda.memory._dump_snapshot(str(snap))
            report.files["memory_snapshot"] = str(snap)
    if memory_snapshot:
        torch.cuda.memory._record_memory_history(enabled=None)
    if not isinstance(model, LoadedModel):  # loaded here: free it, and say whether memory went back
        weights = loaded.report.weights_bytes
        rep = unload(loaded)
        del loaded
        report.notes.append(f"unload: {'memory returned' if rep.returned(weights) else 'memory NOT returned'}, "
                            f"{rep.describe(weights)}")
    return report


def write_outputs(report: ProfileReport, out: Path, title: str) -> tuple[Path, Path]:
    """The timeline PNG and HTML page (with the table) for ``report``."""
    planned_peak = next((r.planned for r in report.rows if r.name == "peak allocated"), None)
    return write_timeline(report.samples, out, title, _table_html(report.rows), planned_peak)
