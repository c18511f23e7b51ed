"""The load's allocation tape (step 1 of :mod:`vramguard.introspect.alloc_replay`): every tensor ``from_pretrained``
allocates on the device and frees, in order, for the caching-allocator model. Needs torch and transformers where
the model is not a hand-written family."""

from __future__ import annotations

from vramguard.introspect import hand
from vramguard.introspect.generic import conversions, structure_of
from vramguard.memory.weights import BNB_4BIT_BLOCKSIZE, quantized_tensor_bytes, rounded
from vramguard.settings import DTYPE_BYTES, Settings


def load_events(spec, s: Settings) -> tuple[int, list[tuple[int, int]]]:
    """The load as transformers 5 and bitsandbytes 0.50 allocate it (H200 traces, benchmarks/README.md): the bytes
    of ``caching_allocator_warmup``'s block (``get_total_byte_count``: every parameter, a 4-bit weight at half a
    byte a value, then ``byte_count // 2`` float16 values), and the tape ``(key, bytes)`` / ``(key, -1)`` of every
    tensor in the checkpoint's key order (names sorted, as safetensors lists them). A 4-bit weight of n values is
    read in the activation dtype, then bitsandbytes' ``quantize_4bit`` allocates the float32 absmax
    (``ceil(n / 64) x 4`` B), the packed weight (``ceil(n / 2)`` B) and, with double quant, a second float32 absmax
    and the 8-bit state (:func:`~vramguard.memory.weights.quantized_tensor_bytes`) before it frees both float32
    copies and the 16-bit weight (without double quant the first absmax is the state). An 8-bit weight is read,
    quantized to its ``numel`` bytes and state, and freed. A parameter stacked at load from per-expert tensors
    (:func:`vramguard.introspect.generic.conversions`) comes with its sources and intermediates
    (:func:`_fused_at_load`)."""
    act = DTYPE_BYTES[s.act_dtype]
    st = hand.structure(spec, s) if hand.covers(spec) else structure_of(spec, s)
    tensors = sorted((t for t in st.tensors if t.nbytes or t.kind == "quantized"),
                     key=lambda t: t.name)
    warm = sum(-(-t.numel // 2) if t.kind == "quantized" and t.dtype in ("nf4", "fp4") else
               (t.numel if t.kind == "quantized" else t.nbytes) for t in tensors if t.kind != "buffer")
    events: list[tuple[int, int]] = []
    key = 0

    def alloc(nbytes: int) -> int:
        nonlocal key
        key += 1
        events.append((key, nbytes))
        return key
    fused = {} if hand.covers(spec) or not spec.config_json else conversions(spec, st)
    for t in tensors:
        if t.name in fused and fused[t.name][2]:
            _, ops, patterns = fused[t.name]
            _fused_at_load(t, ops, patterns, alloc, events)
            continue
        if t.kind != "quantized":
            alloc(t.nbytes)
            continue
        w, state = quantized_tensor_bytes(t.numel, t.dtype, s.double_quant, t.out_features)
        full = alloc(t.numel * act)
        if t.dtype not in ("nf4", "fp4"):
            alloc(w), alloc(state)
            events.append((full, -1))
            continue
        absmax = -(-t.numel // BNB_4BIT_BLOCKSIZE) * 4
        temps = [alloc(absmax)]
        alloc(w)
        if s.double_quant:  # the 8-bit absmax (the only part of the state that can pass 1 MiB), then the rest
            temps.append(alloc(absmax))
            alloc(rounded(absmax // 4))
        alloc(state - rounded(absmax // 4) if s.double_quant else state - absmax)
        events += [(k, -1) for k in (*temps[1:][::-1], *(temps[:1] if s.double_quant else []), full)]
    return (warm // 2) * 2, events


def _fused_at_load(t, ops: tuple[str, ...], patterns: int, alloc, events: list) -> None:
    """The allocations of parameter ``t`` made at load from one checkpoint tensor per expert and source pattern
    (transformers 5's ``core_model_loading``: ``WeightConverter.convert`` materializes every source tensor on the
    device, then runs its operations): ``MergeModulelist`` stacks each pattern's tensors (``torch.stack``), the
    previous pattern's list dropped as the next is taken and the last one on return; ``Concatenate`` joins the
    stacks (``torch.cat``) and drops them on return; any other operation is planned as one new tensor of the
    parameter's size, its input dropped on return. The last result is the parameter. The holes these leave
    between the weights are why a MoE's checkpoint leaves more memory reserved after its load than its weights."""
    experts = t.shape[0] if t.shape and "MergeModulelist" in ops else 1
    per_pattern = t.nbytes // patterns
    groups: list[list[int]] = [[alloc(per_pattern // experts) for _ in range(experts)] for _ in range(patterns)]
    for op in ops:
        if op == "MergeModulelist":
            stacks = []
            for i in range(len(groups)):
                if i:
                    events.extend((k, -1) for k in groups[i - 1])
                stacks.append([alloc(per_pattern)])
            events.extend((k, -1) for k in groups[-1])
            groups = stacks
        elif op == "Concatenate":
            joined = alloc(t.nbytes)
            events.extend((k, -1) for g in groups for k in g)
            groups = [[joined]]
        else:
            out = alloc(t.nbytes)
            events.extend((k, -1) for g in groups for k in g)
            groups = [[out]]
