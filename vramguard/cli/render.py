"""Rendering of results: JSON (raw ints) and human tables (rich). Nothing here computes memory."""

from __future__ import annotations

import dataclasses
from typing import Any

from rich import box
from rich.console import Console
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from vramguard.catalog.gpus import GPUS
from vramguard.cli.flags import as_flags
from vramguard.memory.allocator import ignored_options
from vramguard.memory.kv import kv_growth_per_token
from vramguard.plan import Plan
from vramguard.plan.estimator import misfit_text
from vramguard.plan.limits import bound_by, context_words
from vramguard.plan.solve import batch_search_cap
from vramguard.units import fmt_bytes, fmt_tokens, plural

LABELS = {
    "weights": "weights (quantized linears, 16-bit embeddings, lm_head, norms)",
    "quant_state": "quantization state (absmax, codes; scales, zero points)",
    "kv_cache": "KV cache",
    "attention": "attention workspace (scores, softmax, masks, repeat_kv)",
    "activations": "activations (hidden states, MLP, norms, rotary)",
    "dequant": "dequantized weight / int8 workspace of the running linear",
    "logits": "logits (+ float32 copy)",
    "cublas_workspace": "cuBLAS workspace",
}


# where in the forward the peak falls, in words
PEAK_AT = {
    "prod": "MLP (activation x up projection)", "up_proj": "MLP up projection", "gate_proj": "MLP gate projection",
    "down_proj": "MLP down projection", "gate_up_proj": "MLP gate/up projection", "act": "MLP activation",
    "softmax_fp32": "eager softmax (float32 scores)", "softmax_in_fp32": "eager softmax input cast to float32",
    "attn_weights": "eager attention weights", "sdpa_math": "SDPA math backend (float32 scores)",
    "cache_update": "KV cache concatenation", "quantized_cache_update": "quantized KV cache dequantization",
    "logits": "logits", "logits_fp32": "logits float32 copy", "expert": "MoE expert", "final_norm": "final norm",
    "retained_attentions": "retained attention maps", "input_layernorm": "RMSNorm (float32 upcast)",
    "post_attention_layernorm": "RMSNorm (float32 upcast)", "o_proj": "attention output projection",
    "in_attention": "in attention", "in_activations": "in the MLP / hidden states", "in_logits": "in lm_head / logits",
    "in_kv_cache": "in the KV cache update",
}


class _StripTrailingSpaces:
    """A text stream that drops the spaces rich leaves at the end of wrapped and padded lines; the real stream
    (``sys.stdout`` or ``sys.stderr``) is looked up at each write, so redirection and capture keep working."""

    def __init__(self, name: str):
        self._name = name
        self._line = ""

    @property
    def _stream(self):
        import sys
        return getattr(sys, self._name)

    def write(self, text: str) -> int:
        *done, self._line = (self._line + text).split("\n")
        if done:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in done))
        return len(text)

    def flush(self) -> None:
        if self._line:
            self._stream.write(self._line)
            self._line = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", "utf-8")


class _Console(Console):
    """rich's Console, but a closed pipe raises BrokenPipeError for :func:`vramguard.cli.main` to end the command
    with its own exit code (rich's own :meth:`~rich.console.Console.on_broken_pipe` exits 1, a failed check's)."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError("the reader of the output went away")


def console(stderr: bool = False) -> Console:
    """A rich Console on stdout (or stderr) whose lines carry no trailing spaces."""
    import sys
    return _Console(file=_StripTrailingSpaces("stderr" if stderr else "stdout"),  # type: ignore[arg-type]
                   stderr=stderr, force_terminal=None if (sys.stderr if stderr else sys.stdout).isatty() else False)


def _where(at: str) -> str:
    """The allocation at the peak in words: a hand model's step name, or the operator a replay names as is."""
    if at.startswith(("aten.", "vramguard.")):
        return f"at {at}"
    return PEAK_AT.get(at, at.replace("_", " "))


def indented(c: Console, text: str, indent: int = 5) -> None:
    """Print ``text`` so that wrapped lines keep the indent."""
    c.print(Padding(Text(text), (0, 0, 0, indent)))


def hanging(c: Console, text: str, indent: int = 2, hang: int = 4) -> None:
    """Print ``text`` at ``indent`` spaces, its wrapped lines at ``hang``, so that each item's continuation reads as
    part of it: wrapped at the console's width at spaces (a word longer than a line, a path, stays whole)."""
    import textwrap
    lines = textwrap.wrap(text, max(c.width, 40), initial_indent=" " * indent, subsequent_indent=" " * hang,
                          break_long_words=False, break_on_hyphens=False)
    for line in lines:
        c.print(Text(line), crop=False, overflow="ignore", no_wrap=True)


def short_label(label: str) -> str:
    """A card's name without the vendor's prefixes, for narrow tables ("NVIDIA GeForce RTX 4090" -> "RTX 4090")."""
    return label.replace("NVIDIA ", "").replace("GeForce ", "").replace(" Generation", "")


def _n(v: int | None) -> str:
    return "none" if v is None else f"{v:,}"


def _batch_cell(v: int | None, cap: int) -> str:
    """The largest batch that fits, as a bound at the solver's search cap ``cap`` (the batch may be larger)."""
    return f"≥{v:,}" if v == cap else _n(v)


def gib_cell(n: int) -> str:
    """``n`` bytes in GiB for a table cell without the unit: two decimals below 1,000 GiB, whole GiB with
    thousands separators above (so that a cell stays within 7 characters up to 9,999,999 GiB and a row of sizes
    keeps to 80 columns)."""
    gib = n / 2**30
    return f"{gib:.2f}" if abs(gib) < 1000 else f"{gib:,.0f}"


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, tuples and dicts to JSON-ready values; ints stay ints, None stays null."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        if callable(getattr(obj, "to_json", None)):  # a summary in place of every field (checkpoint headers)
            return obj.to_json()
        out = {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
        for prop in ("total_bytes",):
            if hasattr(obj, prop) and prop not in out:
                out[prop] = getattr(obj, prop)
        return out
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN never reaches JSON
        return None
    return obj


def plan_to_json(p: Plan) -> dict:
    """The plan as a JSON object: every size an int of bytes."""
    est = p.estimate
    return {
        "model": to_jsonable(p.model),
        "settings": p.settings.as_dict(),
        "peak_phase": est.peak_phase,
        "components": dict(est.components),
        "peak_allocated_bytes": est.peak_allocated_bytes,
        "allocator_reserve_bytes": est.allocator_reserve_bytes,
        "peak_reserved_bytes": est.peak_reserved_bytes,
        "cuda_context_bytes": est.cuda_context_bytes,
        "device_used_bytes": est.device_used_bytes,
        "generate_device_bytes": est.generate_device_bytes,
        "load": to_jsonable(est.load),
        "allocator": None if est.allocator is None else dict(to_jsonable(est.allocator), alloc_conf=est.alloc_conf),
        "reserved_from": "reserve formula" if est.allocator is None else "caching-allocator model",
        "freed_before": any(f.code == "freed_before" for f in p.findings),  # planned as such (asked or detected)
        "freed_layout_reserved_bytes": est.freed_layout_reserved_bytes,
        "fresh_layout_reserved_bytes": est.fresh_layout_reserved_bytes,
        "weights": to_jsonable(est.weights),
        "kv_cache": {"full_length_tokens": est.kv_full.tokens, "gpu_bytes": est.kv_full.gpu_bytes,
                     "cpu_bytes": est.kv_full.cpu_bytes, "bytes_per_token": est.kv_bytes_per_token,
                     "growth_per_token_by_layer_type": kv_growth_at(p, p.settings.prompt_tokens),
                     "sliding_growth_new_tokens": sliding_growth_tokens(p)},
        "prefill": to_jsonable(est.prefill),
        "decode": to_jsonable(est.decode),
        "logits_case": p.logits_case,
        "cards_reason": as_flags(p.cards_reason),
        "cards": [{**to_jsonable(c), "gpu": to_jsonable(c.gpu), "max_batch_search_cap": batch_search_cap(p.settings),
                   "max_batch_at_cap": c.max_batch == batch_search_cap(p.settings),
                   "bound_by": bound_by(p.model, p.settings, c.max_prompt_tokens, c.max_new_tokens)}
                  for c in p.cards],
        "kernel_path": to_jsonable(p.kernel_path),  # kernel-backed mixers: the path replayed and why (None: none)
        "findings": [finding_to_json(f) for f in p.findings],
        "changes": to_jsonable(p.changes),
    }


def _settings_line(p: Plan) -> str:
    s = p.settings
    q = s.quant.upper() if s.is_bnb else s.quant
    if s.is_4bit:
        q += f" ({'double quant' if s.double_quant else 'no double quant'}, compute {s.resolved_compute_dtype})"
    attn = s.effective_attn + (f" [{s.sdpa_kernel}]" if s.effective_attn == "sdpa" and s.sdpa_kernel != "auto" else "")
    seqs = f"batch {s.batch}" + (f" x {s.num_beams} beams" if s.num_beams > 1 else "") + (
        f" x {s.num_return_sequences} sequences" if s.num_return_sequences > 1 and s.num_beams == 1 else "")
    chunk = f", prefill chunks of {s.prefill_chunk}" if s.prefill_chunk else ""
    return (f"{q}, dtype {s.act_dtype}, attention {attn}, KV {s.resolved_kv_dtype} {s.cache}, {seqs}, "
            f"prompt {fmt_tokens(s.prompt_tokens)} + {fmt_tokens(s.max_new_tokens)} new tokens{chunk}")


def kv_growth_at(p: Plan, n_tokens: int) -> dict[str, int]:
    """The KV growth per new token by layer kind once ``n_tokens`` are held: the plan's own figure where it kept
    one (:attr:`Plan.kv_growth_at`), else computed (a hand spec's, pure arithmetic)."""
    found = p.kv_growth_at.get(n_tokens)
    return dict(found) if found is not None else kv_growth_per_token(p.model, p.settings, n_tokens)


def sliding_growth_tokens(p: Plan) -> int:
    """How many of the run's new tokens still grow the sliding-window layers (they stop at the window)."""
    s, prompt = p.settings, p.settings.prompt_tokens
    if p.layer_kinds:
        return 0  # a growth per layer kind is reported at the run's length

    def grows(n: int) -> bool:
        return kv_growth_per_token(p.model, s, n).get("sliding_attention", 0) > 0
    lo, hi = prompt, prompt + s.max_new_tokens  # grows(n) is true up to the window, then false
    while lo < hi:
        mid = (lo + hi) // 2
        if grows(mid):
            lo = mid + 1
        else:
            hi = mid
    return lo - prompt


def kv_growth_text(p: Plan) -> str:
    """The KV growth per new token a user sees in this run, per layer type: sliding layers stop at the window."""
    spec, s = p.model, p.settings
    if p.layer_kinds:  # the model reports its growth per layer kind as its config names them
        from collections import Counter
        growth = kv_growth_at(p, s.total_tokens - 1)
        counts = Counter(p.layer_kinds)
        return "; ".join(f"{fmt_bytes(growth.get(k, 0))} in the {plural(n, k.replace('_', '-') + ' layer')}"
                         for k, n in counts.items())
    types = spec.layer_types
    n_full = sum(1 for t in types if t != "sliding_attention" or spec.sliding_window is None)
    parts = []
    if n_full:
        full = kv_growth_per_token(spec, s, s.prompt_tokens).get("full_attention", 0)
        parts.append(f"{fmt_bytes(full)} in the {plural(n_full, 'full-attention layer')}")
    if len(types) - n_full:
        growing = sliding_growth_tokens(p)
        per = kv_growth_per_token(spec, s, s.prompt_tokens - 1 if s.prompt_tokens > 0 else 0)
        new = s.max_new_tokens
        when = ("for all " + plural(new, "new token") if growing >= new else
                "for none of them (the window is full)" if growing == 0 else
                f"for the first {plural(growing, 'new token')}, then 0")
        if s.cache == "static":
            parts.append(f"0 B in the {plural(len(types) - n_full, 'sliding-window layer')} (static cache)")
        else:
            parts.append(f"{fmt_bytes(per.get('sliding_attention', 0))} in the "
                         f"{plural(len(types) - n_full, 'sliding-window layer')} until they hold "
                         f"{fmt_tokens(spec.sliding_window - 1)} tokens ({when})")
    return "; ".join(parts)


def load_text(est) -> str:
    """One line on the load: its reserved peak and what it holds beside the weights, the warm-up block, and
    whether the load or generate sets the card's need."""
    ld = est.load
    why = (f"{len(ld.converted)} fused parameters built from per-part checkpoint tensors (the largest: "
           f"{fmt_bytes(ld.largest_transient_bytes)} of sources and outputs)" if ld.converted else
           f"the largest weight in 16-bit while it is quantized ({fmt_bytes(ld.largest_transient_bytes)})"
           if ld.largest_transient_bytes else "no tensor beside them")
    first = ("the load needs more than generate: it sets the card's need" if est.peak_phase == "load" else
             "generate needs more than the load")
    return (f"loading: peak {fmt_bytes(ld.peak_reserved_bytes)} reserved = weights + {why}; transformers' warm-up "
            f"block {fmt_bytes(ld.warmup_bytes)} (one allocation before any weight); {first}")


def allocator_line(est) -> str:
    """One line on where reserved memory came from: the caching-allocator model and its setting, or the formula."""
    a = est.allocator
    if a is None:
        return ("reserved memory: the reserve formula (largest allocation plus 30% of the rest), which plans the "
                "largest prompt about 12% short of the caching-allocator model's")
    how = "expandable segments" if a.expandable_segments else "default segments"
    conf = f"PYTORCH_CUDA_ALLOC_CONF={est.alloc_conf}" if est.alloc_conf else "the default allocator"
    ignored = ignored_options(est.alloc_conf)
    return (f"reserved memory: PyTorch's caching allocator replayed tensor by tensor ({how}, {conf}"
            + (f"; not modelled: {', '.join(ignored)}" if ignored else "")
            + f"): {a.segments_at_peak:,} segments at the peak, {fmt_bytes(a.base_reserved_bytes)} reserved by the "
            "loaded model; each card's fit and largest prompt keep 1/100 of the room above it free (the largest new "
            "tokens and batch: the reserve formula)")


_TUNED = ("instruct", "chat", "-it")  # how the catalog's repositories name an instruction-tuned checkpoint


def source_label(spec) -> str:
    """Where a plan's config comes from, in words: for a catalog name, the repository whose config the catalog
    holds and whether that is an instruction-tuned (Instruct, chat, -it) or a base checkpoint, since the name
    (``llama-3.1-8b``) says neither; any other source as it is."""
    import re
    m = re.fullmatch(r"catalog \((.+)\)", spec.source or "")
    if not m:
        return spec.source
    repo = m.group(1)
    if repo == spec.name:
        return "the catalog's copy"
    tuned = any(t in repo.lower() for t in _TUNED)
    kind = "an instruction-tuned checkpoint" if tuned else "a base checkpoint"
    return f"catalog: the config of {repo}, {kind}; pass a Hub id for another"


def _print_cards(c: Console, p: Plan) -> None:
    """The cards table: one line per card in 80 columns (sizes in GiB without the unit in each cell,
    :func:`gib_cell`; no vertical rules; a card name too long wraps in its cell, no cell is cut), and the note on a
    batch at the solver's search cap."""
    ct = Table(title="Cards (GiB); the largest prompt, new tokens, batch that fit",
               title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("card", "memory", "need", "fits", "headroom", "prompt", "new", "batch"):
        ct.add_column(col, justify="left" if col == "card" else "right", no_wrap=col != "card")
    cap = batch_search_cap(p.settings)
    capped = False
    for v in p.cards:
        why = bound_by(p.model, p.settings, v.max_prompt_tokens, v.max_new_tokens)
        cells = [_n(v.max_prompt_tokens), _n(v.max_new_tokens)]
        for i, key in enumerate(("max_prompt_tokens", "max_new_tokens")):
            if why[key] == "context":
                cells[i], capped = cells[i] + "*", True
        ct.add_row(short_label(v.gpu.label), gib_cell(v.usable_bytes), gib_cell(v.need_bytes),
                   _fits_cell(v), gib_cell(v.headroom_bytes), *cells, _batch_cell(v.max_batch, cap))
    c.print(ct)
    within = [v for v in p.cards if v.misfit_reason in ("kept_free", "fragmentation")]  # a need within the memory
    for v in within:  # that still does not fit: which rule says no
        c.print(f"†: {short_label(v.gpu.label)} {misfit_text(v)}", highlight=False)
    if within:
        c.print()
    if capped:
        c.print(f"*: capped by {context_words(p.model)} (prompt + new tokens), not by memory: the card would hold "
                "more", highlight=False)
    if any(v.max_batch == cap for v in p.cards):
        where = "the batch asked" if cap == p.settings.batch else "the search's cap"
        c.print(f"batch: ≥{cap:,} is {where}; a larger batch may fit too (plan it with --batch N)")


def _fits_cell(v) -> str:
    """``yes`` / ``no`` (``no†`` where the need is within the card's memory: a note under the table says why);
    ``unverified`` where it fits by a replay no GPU measurement covers (finding
    ``unverified_path``)."""
    if not v.fits:
        return "[red]no[/red]" + ("†" if v.misfit_reason in ("kept_free", "fragmentation") else "")
    return "[yellow]unverified[/yellow]" if v.unverified else "[green]yes[/green]"


def heads_text(spec) -> str:
    """The attention heads in words: ``32 heads / 8 KV heads (head_dim 128)``; for multi-head latent attention (a
    config with ``kv_lora_rank``: DeepSeek-V2/V3) the latent's rank and the key and value head sizes
    (``qk_nope_head_dim + qk_rope_head_dim``, ``v_head_dim``), which differ from ``head_dim``."""
    cfg = spec.config_dict()
    cfg = cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg
    rank = cfg.get("kv_lora_rank")
    dims = [cfg.get(k) for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")] if rank else []
    if isinstance(rank, int) and all(isinstance(d, int) for d in dims):
        return (f"{spec.num_heads} heads, multi-head latent attention (kv_lora_rank {rank}; keys {dims[0] + dims[1]}, "
                f"values {dims[2]} per head)")
    return f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads (head_dim {spec.head_dim})"


def print_plan(p: Plan, console: Console | None = None) -> None:
    """Human-readable plan on stdout: components, cards, findings and ranked changes."""
    c = console or Console()
    est, spec = p.estimate, p.model
    src = source_label(spec)
    c.print(f"[bold]vramguard plan[/bold] - {spec.name}" + ("" if src == spec.name else f"  ({src})"))
    n = est.weights.parameter_count
    params = f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"
    c.print(f"{spec.num_layers} layers, hidden {spec.hidden_size}, {heads_text(spec)}, vocab {spec.vocab_size:,}, "
            f"context {spec.max_position_embeddings:,}, {params} parameters")
    c.print(_settings_line(p))
    prefill_peaks = est.decode is None or est.prefill.peak_bytes >= est.decode.peak_bytes
    phase = "prefill" if prefill_peaks else "last decode step"
    at = (est.prefill if prefill_peaks else est.decode).at
    t = Table(title=f"Memory at the peak of generate: {phase}, {_where(at)}", title_justify="left")
    t.add_column("component")
    t.add_column("bytes", justify="right")
    t.add_column("GiB", justify="right")
    for k, v in est.components.items():
        label = LABELS.get(k, k) if k != "weights" or p.settings.is_bnb else (
            f"weights ({p.settings.quant} linears, embeddings, lm_head, norms)")
        t.add_row(label, f"{v:,}", f"{v / 2**30:.2f}")
    for label, v in (("[bold]PyTorch peak allocated[/bold]", est.peak_allocated_bytes),
                     ("allocator reserve (fragmentation)", est.allocator_reserve_bytes),
                     ("[bold]PyTorch peak reserved[/bold]", est.peak_reserved_bytes),
                     ("CUDA context and memory outside PyTorch", est.cuda_context_bytes),
                     ("[bold]card memory in use[/bold]", est.generate_device_bytes or est.device_used_bytes)):
        t.add_row(label, f"{v:,}", f"{v / 2**30:.2f}")
    c.print(t)
    if est.allocator is not None or not any(f.code == "reserve_formula" for f in p.findings):
        c.print(allocator_line(est))
    w = est.weights
    parts = [f"{fmt_bytes(w.quantized_linear_bytes)} quantized linears ({w.quantized_parameter_count:,} params)"
             if w.quantized_linear_bytes else "",
             f"{fmt_bytes(w.quant_state_bytes)} quantization state" if w.quant_state_bytes else "",
             f"{fmt_bytes(w.dense_linear_bytes)} {p.settings.weight_dtype} linears" if w.dense_linear_bytes else "",
             f"{fmt_bytes(w.embedding_bytes)} embeddings",
             "lm_head tied to the embeddings" if spec.tie_word_embeddings else f"{fmt_bytes(w.lm_head_bytes)} lm_head",
             f"{fmt_bytes(w.norm_bytes + w.bias_bytes)} norms and biases"]
    c.print(f"weights {w.total_bytes:,} B = {fmt_bytes(w.total_bytes)} = {w.total_bytes / 1e9:.2f} GB: "
            + ", ".join(x for x in parts if x))
    kv = est.kv_full
    c.print(f"KV cache at {fmt_tokens(kv.tokens)} tokens: {fmt_bytes(kv.gpu_bytes)} on the GPU"
            + (f", {fmt_bytes(kv.cpu_bytes)} in CPU RAM" if kv.cpu_bytes else "")
            + f"; per generated token: {kv_growth_text(p)}")
    dec = f"; decode peak {fmt_bytes(est.decode.peak_bytes)} above the weights" if est.decode else ""
    c.print(f"prefill peak {fmt_bytes(est.prefill.peak_bytes)} above the weights ({_where(est.prefill.at)}){dec}")
    if est.load is not None:
        c.print(load_text(est))
    c.print(f"logits: {p.logits_case}")
    c.print(f"cards: {as_flags(p.cards_reason)}")
    _print_cards(c, p)
    if p.findings:
        c.print("[bold]Findings[/bold]")
        for f in p.findings:
            color = {"fail": "red", "warn": "yellow"}.get(f.level, "cyan")
            c.print(Padding(Text.assemble((f.level, color), " ", as_flags(f.message)), (0, 0, 0, 2)))
            if f.fix:
                indented(c, f"fix: {as_flags(f.fix)}", 7)
    labels = {v.gpu.name: short_label(v.gpu.label) for v in p.cards}
    if p.changes and all(v.fits for v in p.cards):
        c.print(("fits every card planned against by an unverified replay (finding unverified_path)"
                 if any(v.unverified for v in p.cards) else "fits every card planned against") +
                "; --format json lists the changes that would lower the need further")
    elif p.changes:
        ch = Table(title="Changes: first those that make it fit as asked (settings, then hardware), then those "
                         "that lower the need, then those that shrink the request", title_justify="left")
        for col in ("change", "saves", "need after", "fits"):
            ch.add_column(col, justify="left" if col in ("change", "fits") else "right")
        for x in p.changes:
            ch.add_row(x.description, fmt_bytes(x.saved_bytes), fmt_bytes(x.need_bytes),
                       ", ".join(labels.get(n, short_label(GPUS[n].label) if n in GPUS else n)
                                 for n in x.fits_on) or "no")
        c.print(ch)


def finding_to_json(f) -> dict:
    """One finding as JSON, its message and fix in the CLI's words (:func:`~vramguard.cli.flags.as_flags`)."""
    return {**to_jsonable(f), "message": as_flags(f.message), "fix": as_flags(f.fix)}


def check_finding_to_json(f) -> dict:
    """One check finding as JSON: the shared finding's keys (as ``plan --format json`` writes them), and under
    check's own keys of earlier releases the same values (``name`` = code, ``status`` = level, ``reason`` =
    message)."""
    out = finding_to_json(f)
    return {**out, "name": f.code, "status": f.level, "reason": out["message"]}


def check_to_json(r) -> dict:
    """A CheckReport as JSON: findings, the resolved parameter dtype, the card and the kernel that ran."""
    return {"failed": r.failed, "param_dtype": r.param_dtype, "gpu": to_jsonable(r.gpu),
            "findings": [check_finding_to_json(f) for f in r.findings], "attention_kernel": to_jsonable(r.kernel),
            "notes": r.notes}


def print_check(r, console: Console | None = None) -> None:
    """Human-readable check: one line per finding (status, check, value; wrapped lines under the check's name),
    then its reason and fix, indented."""
    c = console or Console()
    color = {"ok": "green", "warn": "yellow", "fail": "red", "info": "cyan"}
    c.print("[bold]vramguard check[/bold]" + (f" - {r.model}" if getattr(r, "model", None) else ""))
    for f in r.findings:
        head = Text.assemble((f"{f.level.upper():4}", color.get(f.level, "white")), " ", (f.code, "bold"),
                             f": {f.value}")
        for i, line in enumerate(head.wrap(c, max(c.width - 5, 40))):
            c.print(Text(" " * 5) + line if i else line, highlight=False)
        if f.message:
            c.print(Padding(Text(as_flags(f.message), style="dim" if f.level == "ok" else ""), (0, 0, 0, 5)))
        if f.fix:
            indented(c, f"fix: {as_flags(f.fix)}")
    fails = sum(f.level == "fail" for f in r.findings)
    warns = sum(f.level == "warn" for f in r.findings)
    c.print(f"{fails} failed, {plural(warns, 'warning')}" + (": fix the failures before loading" if fails else ""))


def oomlog_to_json(r) -> dict:
    """An OomLogReport as JSON (sizes in bytes, kills newest first), its texts in the CLI's words."""
    d = to_jsonable(r)
    d["message"] = as_flags(d.get("message"))
    for k in d.get("kills", []):
        k["cause"], k["fix"] = as_flags(k.get("cause")), as_flags(k.get("fix"))
    return d


def explanation_to_json(e) -> dict:
    """An Explanation as JSON, its summary, evidence and fixes in the CLI's words."""
    d = to_jsonable(e)
    d["summary"] = as_flags(e.summary)
    d["evidence"], d["fixes"] = [as_flags(x) for x in e.evidence], [as_flags(x) for x in e.fixes]
    return d


def print_oomlog(r, console: Console | None = None) -> None:
    """Human-readable kills, newest first, or the plain message when there are none."""
    c = console or Console()
    c.print(as_flags(r.message), highlight=False)
    n = len(r.kills)
    for i, k in enumerate(r.kills, 1):
        when = k.time.replace("T", " ") if k.time else (f"{k.uptime_s:.3f} s after boot" if k.uptime_s is not None
                                                         else "time unknown")
        where = f"cgroup {k.cgroup}" if k.constraint == "cgroup" and k.cgroup else k.constraint
        c.print(f"[bold]OOM kill {i} of {n}[/bold]: {when} ({where})", highlight=False)
        if k.pid is not None:
            hanging(c, f"process: {k.name} (pid {k.pid}" + (f", uid {k.uid}" if k.uid is not None else "") + ")"
                    + (f"; command line: {k.cmdline}" if k.cmdline else ""))
            parts = [f"RSS {fmt_bytes(k.rss_bytes)}" if k.rss_bytes is not None else "RSS unknown"]
            for label, v in (("anon", k.anon_rss_bytes), ("file", k.file_rss_bytes), ("shmem", k.shmem_rss_bytes),
                             ("virtual", k.total_vm_bytes), ("page tables", k.pgtables_bytes)):
                if v is not None:
                    parts.append(f"{label} {fmt_bytes(v)}")
            hanging(c, "memory at death: " + ", ".join(parts))
        if k.cgroup_limit_bytes:
            hanging(c, f"cgroup limit: {fmt_bytes(k.cgroup_limit_bytes)}")
        if k.invoked_by:
            hanging(c, f"invoked by: {k.invoked_by} (gfp_mask {k.gfp_mask}, order {k.order})")
        if k.top_others:
            hanging(c, "largest other memory users then: " + ", ".join(
                f"{o['name']} (pid {o['pid']}) {fmt_bytes(o['rss_bytes'])}" for o in k.top_others))
        hanging(c, f"likely cause: {as_flags(k.cause)}")
        hanging(c, f"fix: {as_flags(k.fix)}")
    if r.skipped_lines:
        c.print(f"{r.skipped_lines} OOM record line(s) could not be parsed and were skipped", highlight=False)


def print_explanation(e, console: Console | None = None) -> None:
    """Human-readable explanation of an OOM message."""
    c = console or Console()
    c.print(f"[bold]{e.kind}[/bold]: {as_flags(e.summary)}", highlight=False)
    for line in e.evidence:
        indented(c, f"- {as_flags(line)}", 2)
    for fix in e.fixes:
        indented(c, f"fix: {as_flags(fix)}", 2)


def print_profile(r, console: Console | None = None) -> None:
    """The profile table (measured beside planned, bytes and GiB) and the timings."""
    c = console or Console()
    t = Table(title=f"vramguard profile - {r.model}", title_justify="left")
    for col in ("quantity", "measured", "planned", "difference"):
        t.add_column(col, justify="left" if col == "quantity" else "right")
    for row in r.rows:
        t.add_row(row.name, fmt_bytes(row.measured), fmt_bytes(row.planned),
                  f"{row.rel:+.2%}" if row.rel is not None else "")
    c.print(t)
    if r.ttft_s is not None:
        c.print(f"time to first token {r.ttft_s * 1000:.1f} ms"
                + (f"; decode {r.decode_ms_per_token:.2f} ms/token" if r.decode_ms_per_token else ""))
    for k, v in r.files.items():
        c.print(f"{k}: {v}")
    for n in r.notes:
        c.print(f"[yellow]{as_flags(n)}[/yellow]")


def print_fit(r, console: Console | None = None) -> None:
    """The fit result: boundary, runs, binding component, picture."""
    c = console or Console()
    b = "none completed" if r.boundary is None else f"{r.boundary:,}"
    c.print(f"[bold]largest {r.vary} that completes under {fmt_bytes(r.budget_bytes)}: {b}[/bold]"
            + (f" (smallest failure {r.smallest_failure:,})" if r.smallest_failure else ""))
    c.print(f"plan seeds: {r.seed_conservative} (planned reserved fits) to {r.seed_optimistic} (planned allocated "
            f"fits); binding at the edge: {r.binding_component}")
    t = Table(title=f"{len(r.runs)} runs", title_justify="left")
    for col in (r.vary, "result", "peak allocated", "peak reserved", "seconds"):
        t.add_column(col, justify="right")
    for x in r.runs:
        t.add_row(f"{x.value:,}", "ok" if x.ok else f"OOM ({x.oom_kind or '?'})", fmt_bytes(x.peak_allocated),
                  fmt_bytes(x.peak_reserved), f"{x.seconds:.1f}")
    c.print(t)
    if r.plot:
        c.print(f"picture: {r.plot}")
