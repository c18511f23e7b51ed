"""``device_map="auto"`` across cards for the hand-written families without torch: the module tree transformers
builds for them (``<Family>ForCausalLM``: ``model`` = ``embed_tokens``, ``layers.0..N-1``, ``norm``,
``rotary_emb``; then ``lm_head``), sized from the spec, and the placement rule of transformers 5
(``integrations/accelerate.py``: ``get_balanced_memory``, the bitsandbytes quantizer's ``adjust_max_memory`` and
``infer_auto_device_map`` with ``clean_device_map``) ported step for step. The tests check that it gives
transformers' own split and bytes on the meta model for every hand family, unquantized and 4-bit.

Sizes are ``compute_module_sizes``'s: every parameter and buffer ``numel x element size`` (a weight the quantizer
converts at half a byte per value in 4-bit, one in 8-bit), a tied ``lm_head`` counted once, with the embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vramguard.memory.weights import quantized_tensor_bytes, rounded
from vramguard.plan.multigpu.split import CPU_UNBOUNDED_BYTES, DeviceSplit, OFF_GPU, device_of, map_key
from vramguard.settings import DTYPE_BYTES, Settings

# each family's ``_no_split_modules`` (its decoder layer class, ``<Family>PreTrainedModel`` in transformers 5)
NO_SPLIT = {"llama": "LlamaDecoderLayer", "mistral": "MistralDecoderLayer", "mixtral": "MixtralDecoderLayer",
            "qwen2": "Qwen2DecoderLayer", "qwen2_moe": "Qwen2MoeDecoderLayer", "qwen3": "Qwen3DecoderLayer",
            "qwen3_moe": "Qwen3MoeDecoderLayer", "gemma": "GemmaDecoderLayer", "gemma2": "Gemma2DecoderLayer",
            "gemma3_text": "Gemma3DecoderLayer", "phi3": "Phi3DecoderLayer"}
BALANCE_BUFFER = 1.25  # get_balanced_memory: 1.25 x the largest no-split layer or leaf module
QUANT_MAX_MEMORY = 0.90  # Bnb4BitHfQuantizer / Bnb8BitHfQuantizer.adjust_max_memory


@dataclass
class Module:
    """A module of the tree: ``raw`` bytes as transformers counts them, ``held`` allocator-rounded bytes;
    ``leaves`` the raw bytes of each module that owns tensors directly (for the balance buffer)."""

    name: str
    raw: float = 0
    held: int = 0
    children: list["Module"] = field(default_factory=list)
    no_split: bool = False
    leaves: list[float] = field(default_factory=list)


def _tensors(spec, s: Settings, numel: int, out_features: int, quantizable: bool) -> tuple[float, int]:
    """(raw, held) bytes of one weight of ``numel`` values."""
    dt = DTYPE_BYTES[s.act_dtype]
    if s.is_bnb and quantizable:
        w, state = quantized_tensor_bytes(numel, s.quant, s.double_quant, out_features)
        return (numel * (0.5 if s.is_4bit else 1)), w + state
    return numel * dt, rounded(numel * dt)


def _leaf(m: Module, raw: float, held: int) -> None:
    m.raw += raw
    m.held += held
    m.leaves.append(raw)


def _linear(m: Module, spec, s: Settings, out_f: int, in_f: int, bias: bool = False, quantizable: bool = True):
    raw, held = _tensors(spec, s, out_f * in_f, out_f, quantizable)
    dt = DTYPE_BYTES[s.act_dtype]
    if bias:  # a converted layer's bias is float32 on the meta model when the split is computed (bitsandbytes
        # creates it so); it is loaded in the model dtype
        raw += out_f * (4 if s.is_bnb and quantizable else dt)
        held += rounded(out_f * dt)
    _leaf(m, raw, held)


def _layer(spec, s: Settings, i: int) -> Module:
    """One decoder layer: attention projections, q/k norms, the MLP or the MoE block, the layer norms."""
    h, nh, nkv, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    dt = DTYPE_BYTES[s.act_dtype]
    m = Module(f"model.layers.{i}", no_split=True)
    if spec.fused_qkv:
        _linear(m, spec, s, (nh + 2 * nkv) * d, h, spec.qkv_bias)
    else:
        for out_f in (nh * d, nkv * d, nkv * d):
            _linear(m, spec, s, out_f, h, spec.qkv_bias)
    _linear(m, spec, s, h, nh * d, spec.o_bias)
    for _ in range(2 if spec.qk_norm else 0):
        _leaf(m, d * dt, rounded(d * dt))
    if spec.is_moe:
        e, inter = spec.num_experts, spec.moe_intermediate_size
        raw = e * 2 * inter * h * dt + e * h * inter * dt  # fused 3-D experts: one module, never converted
        _leaf(m, raw, rounded(e * 2 * inter * h * dt) + rounded(e * h * inter * dt))
        _linear(m, spec, s, e, h, quantizable=False)  # the router
        if spec.shared_expert_intermediate_size:
            si = spec.shared_expert_intermediate_size
            for out_f, in_f in ((si, h), (si, h), (h, si)):
                _linear(m, spec, s, out_f, in_f)
            _linear(m, spec, s, 1, h)  # shared_expert_gate: an nn.Linear, converted like the others
    else:
        inter = spec.intermediate_size
        pairs = ((2 * inter, h),) if spec.fused_gate_up else ((inter, h), (inter, h))
        for out_f, in_f in (*pairs, (h, inter)):
            _linear(m, spec, s, out_f, in_f, spec.mlp_bias)
    for _ in range(spec.norms_per_layer):
        _leaf(m, h * dt, rounded(h * dt))
    return m


def model_tree(spec, s: Settings) -> Module:
    """The module tree of ``spec`` loaded with ``s``, as transformers builds it for the hand families."""
    dt = DTYPE_BYTES[s.act_dtype]
    h, v = spec.hidden_size, spec.vocab_size
    embed = Module("model.embed_tokens")
    scale = dt if spec.scaled_embeddings else 0  # Gemma's embed_scale buffer, a scalar in the model dtype
    _leaf(embed, v * h * dt + scale, rounded(v * h * dt) + (rounded(scale) if scale else 0))
    layers = Module("model.layers", children=[_layer(spec, s, i) for i in range(spec.num_layers)])
    layers.raw, layers.held = sum(x.raw for x in layers.children), sum(x.held for x in layers.children)
    norm = Module("model.norm")
    _leaf(norm, h * dt, rounded(h * dt))
    rotary = Module("model.rotary_emb")  # inv_freq and original_inv_freq in float32, one pair per layer kind
    kinds = len(set(spec.layer_types)) if spec.model_type == "gemma3_text" else 1
    per = (spec.head_dim // 2) * 4
    _leaf(rotary, 2 * kinds * per, 2 * kinds * rounded(per))
    model = Module("model", children=[embed, layers, norm, rotary])
    model.raw, model.held = sum(x.raw for x in model.children), sum(x.held for x in model.children)
    head = Module("lm_head")
    if not spec.tie_word_embeddings:
        _leaf(head, v * h * dt, rounded(v * h * dt))
    return Module("", model.raw + head.raw, model.held + head.held, [model, head])


def _max_layer(queue: list[Module]) -> tuple[float, list[str]]:
    """accelerate's ``get_max_layer_size``: the largest module that has no children or may not be split."""
    best: float = 0
    names: list[str] = []
    todo = list(queue)
    while todo:
        m = todo.pop(0)
        if not m.children or m.no_split:
            if m.raw > best:
                best, names = m.raw, [m.name]
            elif m.raw == best:
                names.append(m.name)
        else:
            todo = list(m.children) + todo
    return best, names


def balanced_memory(root: Module, max_memory: dict) -> dict:
    """transformers' ``get_balanced_memory`` for a given ``max_memory`` (cards 0..n-1 and ``cpu``): every card
    but the last capped at ``model // cards + int(1.25 x max(largest layer, largest leaf module))``."""
    out = dict(max_memory)
    cards = sorted(k for k, v in out.items() if isinstance(k, int) and v > 0)
    if len(cards) < 2:
        return out
    layers = [c for c in root.children[0].children[1].children]
    leaves = [x for m in _all(root) for x in m.leaves]
    per_card = root.raw // len(cards) + int(BALANCE_BUFFER * max(max((x.raw for x in layers), default=0),
                                                                 max(leaves, default=0)))
    for k in cards[:-1]:
        out[k] = min(per_card, out[k])
    return out


def _all(m: Module):
    yield m
    for c in m.children:
        yield from _all(c)


def place(root: Module, max_memory: dict, tied: bool) -> dict[str, int | str]:
    """transformers' ``infer_auto_device_map`` on the tree (offload_buffers off, one tied group ``lm_head`` =
    ``embed_tokens`` when ``tied``), then ``clean_device_map``."""
    devices = list(max_memory) + ([] if "disk" in max_memory else ["disk"])
    main = [devices[0], "cpu"] if isinstance(devices[0], int) else ["cpu"]
    used: dict[int | str, float] = dict.fromkeys(devices, 0)
    dmap: dict[str, int | str] = {}
    queue = list(root.children)
    current = 0
    max_size, max_names = _max_layer(queue)
    while queue:
        m = queue.pop(0)
        max_names = [n for n in max_names if n != m.name and not n.startswith(m.name + ".")]
        if not max_names:
            max_size, max_names = _max_layer(queue)
        dev = devices[current]
        limit: float | None = max_memory[dev] if dev != "disk" else None
        reserved: float = 0
        if dev in main and limit is not None:  # the main devices are a GPU and the CPU, never the disk
            limit, reserved = limit - max_size, max_size
        partner = None  # the tied lm_head travels with the embeddings (it counts 0 B)
        if tied and m.name in ("model", "model.embed_tokens"):
            partner = next((x for x in queue if x.name == "lm_head"), None)
        if limit is None or used[dev] + m.raw <= limit:
            used[dev] += m.raw
            dmap[m.name] = dev
            if partner is not None:
                queue.remove(partner)
                dmap["lm_head"] = dev
            continue
        if m.children and not m.no_split:
            queue = list(m.children) + queue
            max_size, max_names = _max_layer(queue)
            continue
        used[dev] += reserved
        current += 1
        queue.insert(0, m)
    return _clean(dmap)


def _clean(dmap: dict, module: str = "") -> dict:
    """accelerate's ``clean_device_map``: submodules all on one device are merged into their parent."""
    prefix = f"{module}." if module else ""
    values = [v for k, v in dmap.items() if k.startswith(prefix)]
    if len(set(values)) == 1 and len(values) > 1:
        for k in [k for k in dmap if k.startswith(prefix)]:
            del dmap[k]
        dmap[module] = values[0]
    depth = len(module.split(".")) + 1 if module else 1
    for child in {".".join(k.split(".")[:depth]) for k in dmap if k.startswith(prefix) and len(k) > len(module)}:
        _clean(dmap, child)
    return dmap


def layerwise_split(spec, s: Settings, max_memory_bytes: tuple[int, ...], mode: str = "auto"):
    """The :class:`~vramguard.plan.multigpu.devicemap.DeviceSplit` of a hand-written family without torch (the
    rule of the module docstring); host memory unbounded, as :func:`~vramguard.plan.multigpu.devicemap.split_weights`
    gives it."""
    root = model_tree(spec, s)
    mm: dict = {i: int(b) for i, b in enumerate(max_memory_bytes)}
    mm["cpu"] = CPU_UNBOUNDED_BYTES
    if mode != "sequential":
        mm = balanced_memory(root, mm)
    if s.is_bnb:
        mm = {k: v * QUANT_MAX_MEMORY for k, v in mm.items()}
    dmap = place(root, mm, spec.tie_word_embeddings)
    n = len(max_memory_bytes)
    weights, raw = [0] * n, [0] * n
    layers: list[list[int]] = [[] for _ in range(n)]
    offloaded: dict[str, int] = {}
    model = root.children[0]
    units = [model.children[0], *model.children[1].children, *model.children[2:], root.children[1]]
    for u in units:
        dev = device_of(u.name, dmap)
        if dev in OFF_GPU or not isinstance(dev, int):
            key = map_key(u.name, dmap)
            offloaded[key] = offloaded.get(key, 0) + int(u.raw)
            continue
        weights[dev] += u.held
        raw[dev] += int(u.raw)
        if u.name.startswith("model.layers."):
            layers[dev].append(int(u.name.rsplit(".", 1)[1]))
    return DeviceSplit(dmap, tuple(weights), tuple(raw), tuple(tuple(x) for x in layers),
                       device_of("model.embed_tokens", dmap), device_of("lm_head", dmap), offloaded,
                       tuple(int(b) for b in max_memory_bytes), (NO_SPLIT[spec.model_type],))
