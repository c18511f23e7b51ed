"""``vramguard plan --gpus N`` / ``--tp N``: the cards used together, the plan over them, and its printing (over
:func:`vramguard.plan.multigpu.plan_gpus`)."""

from __future__ import annotations

import typer

from vramguard.catalog.gpus import GpuSpec
from vramguard.cli.common import write_json
from vramguard.cli.render import console, finding_to_json, gib_cell, short_label, source_label, to_jsonable
from vramguard.errors import InvalidValue, UnknownGpu
from vramguard.hardware import detect_gpus, gpu_from_catalog, gpu_from_vram
from vramguard.plan.choice import choose
from vramguard.plan.limits import bound_by, context_words
from vramguard.plan.planner import with_context
from vramguard.resolve import resolve_model
from vramguard.units import MiB, fmt_gib, parse_card_size


def gpus_option():
    return typer.Option(None, "--gpus", help="cards used together by one process: device_map='auto' across them "
                        "(--gpu/--vram: one card, or one per card)")


def tp_option():
    return typer.Option(None, "--tp", show_default=False, help="tensor parallelism over this many cards, 2 or more: "
                        "transformers' tp_plan='auto', one rank per card (unset: none); with --engine vllm, vLLM's "
                        "tensor_parallel_size, 1 or more (unset: 1)")


def device_map_option():
    return typer.Option("auto", "--device-map", help="with several cards: auto (balanced, transformers' default) or "
                        "sequential")


def max_memory_option():
    return typer.Option(None, "--max-memory", help="with several cards: from_pretrained's max_memory per card, e.g. "
                        "30GiB,10GiB (default: each card's free memory)")


def wants_cards(gpus: int | None, tp: int | None, gpu: str | None, vram: str | None) -> bool:
    """Whether the options ask for several cards used together (``--gpus``, ``--tp`` or a comma list)."""
    return gpus is not None or tp is not None or "," in (gpu or "") or "," in (vram or "")


def defaults_card(gpu: str | None) -> str | None:
    """The card whose defaults (attention, dtype) the run takes: of several named, the one of the lowest compute
    capability (the whole model runs on each card's kernels). None when no card is named; an unknown name is
    returned as given (its error comes with the cards)."""
    if not gpu or "," not in gpu:
        return gpu
    names = [p.strip() for p in gpu.split(",") if p.strip()]
    try:
        cards = [gpu_from_catalog(n) for n in names]
    except UnknownGpu:
        return names[0] if names else None
    return min(zip(cards, names), key=lambda cn: tuple(cn[0].compute_capability or (99, 0)))[1]


def _items(text: str, flag: str) -> list[str]:
    parts = [p.strip() for p in text.split(",")]
    if any(not p for p in parts):
        raise InvalidValue(flag, text, "one value per card, separated by commas",
                           f"write e.g. {flag} 24GiB,24GiB (no empty entries)")
    return parts


def _size_items(text: str, flag: str) -> list[str]:
    """The sizes of a comma list (``--vram`` / ``--max-memory``); a bare number followed by a size with a unit
    (``24,5GiB``) is a decimal comma, refused as one, with the text written with a decimal point."""
    import re
    parts = _items(text, flag)
    for a, b in zip(parts, parts[1:]):
        if re.fullmatch(r"\d+", a) and re.fullmatch(r"\d+\s*[A-Za-z]*", b):
            point = f"{a}.{b}" + ("" if re.search("[A-Za-z]", b) else "GiB")
            raise InvalidValue(flag, text, "sizes with a unit, one per card, separated by commas",
                               f"a decimal comma is not accepted: write {text.replace(f'{a},{b}', point, 1)}")
    return parts


def resolve_cards(gpus: int | None, tp: int | None, gpu: str | None, vram: str | None) -> list[GpuSpec]:
    """The cards: ``--gpu`` / ``--vram`` as one value (repeated ``--gpus`` or ``--tp`` times) or one per card;
    without either, the first N detected GPUs.

    Raises:
        InvalidValue: both ``--gpu`` and ``--vram``, a count that disagrees with the list, a count below 2, or
            neither a card nor enough detected GPUs.
        UnknownGpu: an unknown card name.
    """
    for flag, n in (("--gpus", gpus), ("--tp", tp)):
        if n is not None and n < 2:
            raise InvalidValue(flag, n, "2 or more cards", f"pass {flag} 2 or more (one card: leave {flag} out)")
    if gpus is not None and tp is not None and gpus != tp:
        raise InvalidValue("--tp", tp, f"--gpus ({gpus}): one tensor-parallel rank per card", f"pass --tp {gpus}")
    count = gpus or tp
    if gpu and vram is not None:
        raise InvalidValue("--gpu/--vram", f"--gpu {gpu} --vram {vram}", "one of the two: they conflict (a --gpu "
                           "card has its own memory, --vram sets the memory)",
                           f"pass one: --gpu {gpu} or --vram {vram}")
    if gpu or vram is not None:
        flag, text = ("--gpu", gpu) if gpu else ("--vram", vram)
        make = gpu_from_catalog if gpu else (lambda v: gpu_from_vram(v))
        cards = [make(p) for p in (_items(text, flag) if gpu else _size_items(text, flag))]
        if count is None:
            count = len(cards)
        if len(cards) == 1:
            cards = cards * count
        if len(cards) != count:
            raise InvalidValue(flag, text, f"one card, or {count} cards (--gpus/--tp {count})",
                               f"name {count} cards or one for all of them")
        return cards
    det = detect_gpus()
    if count is None or len(det.gpus) < count:
        raise InvalidValue("--gpu/--vram", "none given", f"the {count or 2} cards to plan over",
                           f"name them, e.g. --gpus {count or 2} --gpu h100-80gb or --vram 24GiB,24GiB "
                           f"({len(det.gpus)} GPU(s) detected: {det.reason})")
    return list(det.gpus[:count])


def plan_cards(model: str, s, cards: tuple, context: int | None, device_map: str, max_memory: str | None):
    """The :class:`~vramguard.plan.multigpu.MultiGpuPlan` of the command's options: ``cards`` is
    ``(--gpus, --tp, --gpu, --vram)``; ``context`` as ``plan`` applies it.

    Raises:
        InvalidValue: see :func:`resolve_cards`; ``--max-memory`` not one size or one per card.
    """
    # several cards' planner: loaded when a plan asks for them, not at the CLI's start
    from vramguard.plan.multigpu import plan_gpus
    from vramguard.plan.multigpu.tensorparallel import check_tp_heads, check_tp_quant
    gpus, tp, gpu, vram = cards
    spec = model if hasattr(model, "max_position_embeddings") else resolve_model(model)
    check_tp_heads(choose(spec).model, tp)  # a model fact: said before the cards are looked for
    check_tp_quant(s, tp)  # two options that do not go together: said before the cards too
    if gpus is None and tp is None and max_memory and "," in max_memory and "," not in (gpu or "") + (vram or ""):
        gpus = len(max_memory.split(","))  # as many cards as sizes given
    found = resolve_cards(gpus, tp, gpu, vram)
    if len(found) < 2 and tp is None:  # --max-memory or --device-map alone asked for the split
        flag, value = ("--max-memory", max_memory) if max_memory is not None else ("--device-map", device_map)
        two = f"--gpu {gpu},{gpu}" if gpu else f"--vram {vram},{vram}" if vram else "--gpus 2"
        raise InvalidValue(flag, value, "a split over 2 or more cards (one card named)",
                           f"name the cards ({two}), or leave {flag} out for one card")
    mm = None
    if max_memory is not None:
        mm = [parse_card_size(x, "--max-memory", "30GiB") for x in _size_items(max_memory, "--max-memory")]
        mm = mm * len(found) if len(mm) == 1 else mm
        if len(mm) != len(found):
            raise InvalidValue("--max-memory", max_memory, f"one size, or {len(found)} (one per card)",
                               f"name {len(found)} sizes, e.g. --max-memory " + ",".join(["20GiB"] * len(found)))
    spec = with_context(spec, context) if context else spec
    return plan_gpus(spec, s, gpus=found, tp=tp, max_memory=mm, device_map=device_map)


def emit(p, as_json: bool, exit_code: bool, findings: tuple = ()) -> None:
    """Print the plan (JSON, with ``findings``, or the table) on stdout; with ``exit_code``, exit 1 when a card
    does not fit."""
    import typer
    if as_json:
        write_json(plan_to_json(p, findings))
    else:
        print_plan(p, console())
    if exit_code and not p.fits:
        raise typer.Exit(1)


def plan_to_json(p, findings: tuple = ()) -> dict:
    """The multi-card plan as a JSON object: every size an int of bytes; ``findings`` (the CLI's: an option that
    plans one card, not applied) as a one-card plan's."""
    split = p.split
    out = {"model": p.model.name, "settings": p.settings.as_dict(), "layout": p.layout, "fits": p.fits,
           "limit_card": p.limit_card, "max_prompt_tokens": p.max_prompt_tokens,
           "bound_by": {"max_prompt_tokens": bound_by(p.model, p.settings, p.max_prompt_tokens, None)[
               "max_prompt_tokens"]},
           "cards": [{**to_jsonable(c), "gpu": to_jsonable(c.gpu)} for c in p.cards], "notes": p.notes,
           "reserved_from": "reserve formula",  # cards used together: the caching-allocator model plans one card
           "findings": [finding_to_json(f) for f in findings]}
    out["fix"] = None if p.fix is None else {
        "device_map": p.fix.device_map, "max_memory_bytes": list(p.fix.max_memory_bytes),
        "layers": [list(x) for x in p.fix.layers], "need_bytes": [c.need_bytes for c in p.fix.cards]}
    if p.layout == "tp":
        out["tp"] = {"ranks": split.tp, "kv_heads_per_rank": split.kv_heads_per_rank, "plan": split.plan,
                     "replicated": list(split.replicated), "weight_bytes": list(split.weight_bytes)}
    else:
        out["device_map_mode"] = p.device_map
        out["device_map"] = {k: v for k, v in split.device_map.items()}
        out["max_memory"] = list(split.max_memory)
        out["offloaded"] = dict(split.offloaded)
    return out


def _where(c, device_map: str = "auto") -> str:
    if not c.layers:
        return ", ".join(c.holds) or (f"nothing: device_map='{device_map}' leaves it unused" if not c.need_bytes
                                      else "no decoder layer")
    span = f"layers {c.layers[0]}-{c.layers[-1]}" if len(c.layers) > 1 else f"layer {c.layers[0]}"
    if any("sharded" in h for h in c.holds):
        return f"{span}, each layer's heads and MLP sharded"
    return ", ".join((span,) + c.holds)


def print_plan(p, out) -> None:
    """The per-card table (GiB, :func:`~vramguard.cli.render.gib_cell`; one line per card in 80 columns, no cell
    cut), the limiting card and the largest prompt."""
    from rich import box
    from rich.table import Table
    s = p.settings
    how = (f"tp_plan='auto' over {len(p.cards)} ranks, {p.split.kv_heads_per_rank} KV heads per rank"
           if p.layout == "tp" else f"device_map='{p.device_map}' over {len(p.cards)} cards")
    out.print(f"[bold]vramguard plan[/bold] - {p.model.name}: {s.quant}, prompt {s.prompt_tokens:,} + "
              f"{s.max_new_tokens:,} new tokens, batch {s.batch}; {how}")
    if source_label(p.model) != p.model.name:
        out.print(f"({source_label(p.model)})", highlight=False)
    t = Table(title="Per card (GiB): weights, KV cache of its layers, activations, allocator reserve, CUDA context "
              "+ cuBLAS workspace", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in ("card", "weights", "KV", "act.", "resv.", "ctx.", "need", "memory", "fits"):
        t.add_column(col, justify="left" if col == "card" else "right", no_wrap=col != "card")
    for c in p.cards:
        t.add_row(f"{c.card} {short_label(c.gpu.label)[:11]}", *(gib_cell(v) for v in (
            c.weights_bytes, c.kv_cache_bytes, c.activation_bytes, c.reserve_bytes,
            c.cuda_context_bytes + c.cublas_workspace_bytes, c.need_bytes, c.usable_bytes)),
                  "[green]yes[/green]" if c.fits else "[red]no[/red]")
    out.print(t)
    for c in p.cards:
        out.print(f"card {c.card}: {_where(c, p.device_map)}")
    lim = p.cards[p.limit_card]
    state = (f"{fmt_gib(lim.headroom_bytes)} left" if lim.fits else f"short by {fmt_gib(-lim.headroom_bytes)}")
    out.print(f"limit: card {lim.card} ({lim.gpu.label}) needs {fmt_gib(lim.need_bytes)} of "
              f"{fmt_gib(lim.usable_bytes)} at its {lim.phase} peak ({state}); each card's need is checked against "
              "that card, not summed")
    offloaded = sum(p.split.offloaded.values()) if p.layout == "device_map" else 0
    if offloaded:  # every card holds its share, but not all of the model is on the cards
        out.print(f"[red]does not fit[/red]: {len(p.split.offloaded)} module(s), {fmt_gib(offloaded)} "
                  f"({', '.join(p.split.offloaded)}), are left for CPU RAM by the device map")
    if p.max_prompt_tokens is not None:
        why = bound_by(p.model, s, p.max_prompt_tokens, None)["max_prompt_tokens"]
        out.print(f"largest prompt that fits every card with {s.max_new_tokens:,} new tokens: "
                  f"{p.max_prompt_tokens:,} tokens" + (f" (capped by {context_words(p.model)}, not by memory)"
                                                       if why == "context" else ""))
    else:
        out.print("no prompt fits every card with these settings")
    if p.fix is not None:
        out.print(fix_text(p.fix))
    for note in p.notes:
        out.print(f"note: {note}")


def fix_text(fix) -> str:
    """The fix as the arguments to pass, and where the layers then go."""
    mm = ", ".join(f"{i}: '{b // MiB}MiB'" for i, b in enumerate(fix.max_memory_bytes))
    where = "; ".join(f"card {i}: " + (f"layers {ls[0]}-{ls[-1]}" if ls else "no layer, unused" if not c.need_bytes
                                       else "no layer")
                      + f", needs {fmt_gib(c.need_bytes)} of {fmt_gib(c.usable_bytes)}"
                      for i, (ls, c) in enumerate(zip(fix.layers, fix.cards)))
    return (f"fix: from_pretrained(..., device_map='{fix.device_map}', max_memory={{{mm}}}) fits every card "
            f"({where}); check it with --device-map {fix.device_map} --max-memory "
            + ",".join(f"{b // MiB}MiB" for b in fix.max_memory_bytes))
