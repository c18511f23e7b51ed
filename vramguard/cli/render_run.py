"""Rendering of a generation's summary (``vramguard run``): what was loaded, why it stopped, the time split.
Nothing here computes."""

from __future__ import annotations

from rich.console import Console

from vramguard.cli.flags import as_flags
from vramguard.units import fmt_bytes, plural


def print_generation_summary(r, console: Console) -> None:
    """The summary of a guarded generation (stderr): what was loaded and why, strategy and why, recoveries, why it
    stopped, peak memory, speed, and the wall time per phase."""
    def line(text: str) -> None:
        console.print(text, highlight=False, markup=False)
    if r.loaded:
        a = r.loaded
        line(f"loaded: {a['quant']} weights, dtype {a['dtype']}"
             + (f", compute {a['compute_dtype']}" if a.get("compute_dtype") else "")
             + f", attention {a['attn']}, on {a['device']} - " + as_flags("; ".join(a["why"])))
    line(f"strategy: {r.strategy} - {as_flags(r.reason)}")
    line(f"stopped: {as_flags(r.stop_detail)}")
    parts = [plural(len(r.token_ids), "token")]
    if r.peak_allocated_bytes is not None:
        parts.append(f"peak allocated {fmt_bytes(r.peak_allocated_bytes)}")
    if r.ttft_s is not None:
        parts.append(f"time to first token {r.ttft_s * 1000:.0f} ms")
    if r.decode_ms_per_token:
        parts.append(f"decode {r.decode_ms_per_token:.2f} ms/token" + (f" ({r.decode_mode})" if r.decode_mode else ""))
    if r.tokens_per_s:
        parts.append(f"{r.tokens_per_s:.1f} tokens/s overall")
    line(", ".join(parts))
    line("time: " + timing_line(r.timings))


def timing_line(t) -> str:
    """A run's wall time per phase in seconds (:class:`vramguard.run.timing.RunTimings`), in the order they ran,
    the phases it measured; then when the first token came and the decode steps."""
    parts = []
    for name, value in (("startup", t.startup_s), ("import torch + transformers", t.import_s),
                        ("tokenizer + context check", t.prepare_s), ("load", t.load_s), ("plan", t.plan_s)):
        if value is not None:
            parts.append(f"{name} {value:.2f}")
    if t.one_time_s:
        check = {"kept": "kernel check (kept verdict + spot check)", "full": "kernel self-test"}.get(
            t.kernel_check or "", "kernel self-test")
        what = [f"{n} {v:.2f}" for n, v in ((check, t.selftest_s), ("capture", t.capture_s)) if v]
        if t.warmup_steps:
            what.insert(1, f"{t.warmup_steps} warm-up step(s) {t.warmup_s:.2f}")
        parts.append(f"one-time {t.one_time_s:.2f} ({', '.join(what)})")
    if t.prefill_s is not None:
        parts.append(f"prefill (TTFT) {t.prefill_s:.2f}")
    if t.command_first_token_s is not None:
        parts.append(f"first token at {t.command_first_token_s:.2f}")
    parts.append(f"decode {t.decode_s:.2f} ({plural(t.decode_steps, 'step')})")
    if t.other_s >= 0.01:
        parts.append(f"other {t.other_s:.2f}")
    if t.total_s is not None:
        parts.append(f"command total {t.total_s:.2f}")
    return ", ".join(parts) + " s"
