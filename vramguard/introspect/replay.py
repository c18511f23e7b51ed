"""A replay of one real transformers forward on the meta device: the prefill and decode peaks and the KV cache of any
architecture, with no GPU and no memory.

The model's own ``forward`` runs on meta tensors under :class:`~vramguard.introspect.tracker.StorageTracker`, with
the cache transformers creates for it (``DynamicCache(config=...)`` with its sliding-window, chunked, linear-attention
or recurrent layers, or ``StaticCache``), so every activation, mask, ``repeat_kv`` copy, float32 upcast and cache
tensor is the one the real forward allocates. Three things the meta device cannot show are added by stated rules:

* The attention kernel. SDPA on meta tensors runs PyTorch's math composite; on a CUDA card a flash-class kernel
  (flash, cuDNN, memory-efficient) runs and allocates only its output and a float32 log-sum-exp of
  ``batch x heads x q_len`` (``aten/src/ATen/native/transformers/attention.cpp``). The replay substitutes those two
  tensors unless the math kernel is what would run (:func:`vramguard.memory.forward.sdpa_runs_math`).
  FlashAttention-2 is replayed through transformers' attention registry (``AttentionInterface``) with its mask
  function (``flash_attention_mask``), allocating the same output and log-sum-exp.
* bitsandbytes layers. The replay model keeps ``nn.Linear`` layers; each layer the quantizer converts adds, for the
  duration of its call, the memory :meth:`vramguard.memory.forward._Forward.linear` documents (the weight
  dequantized to the compute dtype for more than ``BNB_4BIT_FUSED_MAX_ROWS`` rows, cast copies when compute and
  activation dtypes differ).
* generate's float32 copy of the last position's logits (``generation/utils.py``:
  ``logits[:, -1, :].to(copy=True, dtype=torch.float32)``).

Data-dependent values follow :class:`~vramguard.introspect.tracker.DataPolicy`.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from functools import lru_cache
from collections.abc import Set
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vramguard.errors import ConfigError
from vramguard.introspect.build import _quiet, cached_config, meta_model
from vramguard.introspect.mixer_paths import replayed_paths
from vramguard.introspect.replayed import Replayed
from vramguard.introspect.tracker import DataPolicy, StorageTracker
from vramguard.memory.forward import BNB_4BIT_FUSED_MAX_ROWS, sdpa_runs_math
from vramguard.memory.weights import rounded
from vramguard.settings import DTYPE_BYTES, Settings

FA2_REPLAY = "vramguard_fa2"  # registered in transformers' AttentionInterface for the replay


def _register_fa2() -> None:
    """Register the FlashAttention-2 replay in transformers' attention and mask registries (once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask
    if FA2_REPLAY in AttentionInterface._global_mapping:
        return

    def fa2_replay(module, query, key, value, attention_mask, **kwargs):
        # flash_attn_func: output (batch, q_len, heads, v_head_dim) and a float32 softmax_lse (batch, heads, q_len)
        b, h, q_len, _ = query.shape
        out = torch.empty((b, q_len, h, value.shape[-1]), dtype=query.dtype, device=query.device)
        torch.empty((b, h, q_len), dtype=torch.float32, device=query.device)  # softmax_lse, freed on return
        return out, None

    AttentionInterface.register(FA2_REPLAY, fa2_replay)
    ALL_MASK_ATTENTION_FUNCTIONS.register(FA2_REPLAY, flash_attention_mask)


class _FlashSdpa(TorchFunctionMode):
    """Replaces ``F.scaled_dot_product_attention`` by the allocations of a flash-class CUDA kernel."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, v = args[0], args[2] if len(args) > 2 else kwargs["value"]
            out = torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)
            torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)  # the log-sum-exp, freed on return
            return out
        return func(*args, **kwargs)


class _Labels:
    """The component of each allocation, from the module running it (global forward hooks)."""

    def __init__(self, model):
        self.stack: list[str] = []
        out = model.get_output_embeddings()
        self.lm_head = id(out) if out is not None else None
        self.kinds = {id(m): self._kind(m) for m in model.modules()}
        self.override: str | None = None
        self.after_lm_head = False

    @staticmethod
    def _kind(m) -> str:
        name = type(m).__name__
        return "attention" if ("Attention" in name or "Mamba" in name or "DeltaNet" in name) else "other"

    def pre(self, module, _args):
        self.stack.append(self.kinds.get(id(module), "other") if id(module) != self.lm_head else "lm_head")

    def post(self, module, _args, _out):
        if self.stack:
            if self.stack.pop() == "lm_head":
                self.after_lm_head = True

    def __call__(self) -> str:
        if self.override:
            return self.override
        if self.after_lm_head or (self.stack and self.stack[-1] == "lm_head"):
            return "logits"
        if self.stack and self.stack[-1] == "attention":
            return "attention"
        return "activations"


@contextlib.contextmanager
def _module_hooks(labels: _Labels):
    from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
    h1 = register_module_forward_pre_hook(labels.pre)
    h2 = register_module_forward_hook(labels.post)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()


@contextlib.contextmanager
def _bnb_transients(model, quantized: set[str], s: Settings, labels: _Labels):
    """While a converted layer runs, hold what its bitsandbytes kernel allocates (see the module docstring)."""
    if not quantized or not s.is_bnb:
        yield
        return
    act = DTYPE_BYTES[s.act_dtype]
    comp = DTYPE_BYTES[s.resolved_compute_dtype]

    def pre(module, args):
        x = args[0]
        rows = x.numel() // x.shape[-1]
        fin, fout = _features(module)
        if s.quant == "int8":
            n = rows * fin + rows * fout * 4
        else:
            n = (rows * fin * comp if comp != act else 0) + (rows * fout * comp if comp != act else 0)
            if rows > BNB_4BIT_FUSED_MAX_ROWS:
                n += fout * fin * comp
        if not n:
            return None
        labels.override = "dequant"
        buffer = torch.empty(n, dtype=torch.uint8, device="meta")
        labels.override = None
        return buffer

    with hold_while_running(model, quantized, pre):
        yield


@contextlib.contextmanager
def hold_while_running(model, names: set[str], pre):
    """Before each module of ``model`` named in ``names`` runs, call ``pre(module, args)`` and keep what it returns
    alive until that module's forward returns (a kernel's buffers, as bitsandbytes holds them); hooks removed on
    exit."""
    held: dict[int, Any] = {}

    def before(module, args):
        held[id(module)] = pre(module, args)

    def after(module, _args, _out):
        held.pop(id(module), None)

    handles = []
    for name, module in model.named_modules():
        if name in names:
            handles += [module.register_forward_pre_hook(before), module.register_forward_hook(after)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        held.clear()


def _features(module) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a GPT-2 style ``Conv1D`` (weight stored as in x out)."""
    if hasattr(module, "in_features"):
        return int(module.in_features), int(module.out_features)
    fin, fout = module.weight.shape
    return int(fin), int(fout)


def cache_tensors(cache) -> list[tuple[int, str, torch.Tensor]]:
    """Every tensor a transformers cache object holds, as (layer index, attribute, tensor): the layers of a
    ``Cache`` (``keys``, ``values``, and the states of linear-attention / recurrent layers), or the attributes of a
    model-specific cache class."""
    found: list[tuple[int, str, torch.Tensor]] = []
    seen: set[int] = set()
    layers = getattr(cache, "layers", None)
    if isinstance(layers, list):
        for i, layer in enumerate(layers):
            _walk(layer, i, "", 0, found, seen)
    else:
        _walk(cache, -1, "", 0, found, seen)
    return found


def _walk(obj, layer: int, attr: str, depth: int, found: list, seen: set[int]) -> None:
    """:func:`cache_tensors`' walk through ``obj``. A module-level function on purpose: a recursive closure is a
    reference cycle (the function, its cell, the function) that would hold ``found``, and with it the cache's
    tensors, until the garbage collector happens to run, so that an old K/V tensor the forward replaces stayed
    live past its update in some replays and not in others, by the process's history."""
    if depth > 4 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        found.append((layer, attr, obj))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, i if layer < 0 and isinstance(obj, list) else layer, attr, depth + 1, found, seen)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, layer, f"{attr}.{k}" if attr else str(k), depth + 1, found, seen)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("transformers"):
        for k, v in vars(obj).items():
            _walk(v, layer, k if not attr else f"{attr}.{k}", depth + 1, found, seen)


def _inputs(s: Settings, past: int, chunk: int, tracker: StorageTracker) -> dict:
    """generate's model inputs for one forward; the attention mask is declared all ones unless the batch is padded."""
    seqs = s.sequences
    ids = torch.zeros((seqs, chunk), dtype=torch.long, device="meta")
    mask = torch.ones((seqs, past + chunk), dtype=torch.long, device="meta")
    if not s.padded:
        tracker.fill(mask, 1)
    pos = torch.arange(past, past + chunk, device="meta").unsqueeze(0).expand(seqs, -1)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def cache_keyword(model) -> str:
    """The keyword under which ``model``'s forward takes its cache, and the output field that returns it:
    ``past_key_values``, or ``cache_params`` where the forward's signature names that instead (Mamba and Mamba-2 in
    transformers 5.17: ``Mamba2ForCausalLM.forward(cache_params=...)`` returning ``Mamba2CausalLMOutput.cache_params``;
    generate passes the cache under that name, ``GenerationMixin._prepare_cache_for_generation``)."""
    params = inspect.signature(model.forward).parameters
    return "cache_params" if "cache_params" in params and "past_key_values" not in params else "past_key_values"


def _new_cache(model, config, s: Settings):
    from transformers import DynamicCache, StaticCache
    if s.cache == "static":
        return StaticCache(config=config, max_cache_len=s.cache_len)
    try:
        return DynamicCache(config=config)
    except Exception:  # noqa: BLE001 - a model with its own cache class creates it in its forward
        return None


@contextlib.contextmanager
def layer_starts(model, layers: int | None, mark):
    """Call ``mark`` as each decoder layer starts (a forward pre-hook on each layer of the one ``ModuleList`` of
    ``layers`` modules named ``...layers``); yields whether that list was found (True without ``layers``)."""
    import torch
    if layers is None:
        yield True
        return
    found = [m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and n.endswith("layers")
             and len(m) == layers]
    handles = [layer.register_forward_pre_hook(lambda _m, _a: mark()) for layer in found[0]] if len(found) == 1 \
        else []
    try:
        yield len(found) == 1
    finally:
        for h in handles:
            h.remove()


@dataclass
class Recording:
    """What :func:`replay` records beside its result for a decoder of ``layers`` layers (the input of
    :mod:`vramguard.introspect.replay_trim`): the tracker's events of the tracked forward (``(serial, raw bytes)``
    / ``(serial, -1)``), ``notes`` (serial -> (label, where)), the cache's tensors adopted before it
    (``events[:split]``) and the forward itself (``events[split:end]``), each layer's first event in each of those
    two parts (``starts``) and the serials of the cache after it, with the bytes of each one's storage in the order
    of :attr:`Replayed.cache_tensors` (``cache_storage``, before rounding). ``found``: the decoder's layers were found
    and the cache lists them (``cache.layers``)."""

    layers: int
    events: list = field(default_factory=list)
    notes: dict = field(default_factory=dict)
    split: int = 0
    end: int = 0
    starts: tuple = ((), ())
    cache_serials: frozenset = frozenset()
    cache_storage: tuple = ()
    found: bool = False


def replay(model, config, s: Settings, past: int, chunk: int, quantized: Set[str] = frozenset(),
           policy: DataPolicy | None = None, record: Recording | None = None) -> Replayed:
    """Replay one forward of ``chunk`` tokens per sequence after ``past`` cached ones (see the module docstring).

    ``model``: a meta model built with the attention implementation to replay (eager, sdpa, or
    :data:`FA2_REPLAY`); ``quantized``: names of the modules the quantizer converts; ``record``: filled in as
    :class:`Recording` says.

    Raises:
        vramguard.introspect.tracker.NotModelled: the forward branches on a value meta tensors do not have.
    """
    with _quiet():
        return _replay(model, config, s, past, chunk, quantized, policy, record)


def _replay(model, config, s: Settings, past: int, chunk: int, quantized, policy, record=None) -> Replayed:
    with replayed_paths(model, s.kernels):
        return _replay_forward(model, config, s, past, chunk, quantized, policy, record)


def _adopt(tracker: StorageTracker, cache, record: Recording | None) -> None:
    """Count the filled cache's tensors as live ``kv_cache`` (and, recording, where each layer's start)."""
    held = cache_tensors(cache) if cache is not None else []
    first: dict[int, int] = {}
    for layer, _, t in held:
        first.setdefault(layer, len(tracker.events or ()))
        tracker.adopt(t, "kv_cache")
    del held  # a name left bound would keep the last layer's old tensor alive past its update
    if record is not None:
        at = len(record.events)
        starts = []
        for i in reversed(range(record.layers)):
            at = first.get(i, at)
            starts.append(at)
        record.starts = (tuple(starts[::-1]), ())


def _replay_forward(model, config, s: Settings, past: int, chunk: int, quantized, policy,
                    record: Recording | None = None) -> Replayed:
    cache = _new_cache(model, config, s)
    name = cache_keyword(model)
    logits_to_keep = 0 if s.logits == "all" else 1
    with torch.no_grad():
        if past:
            with StorageTracker(policy=policy or DataPolicy(), count=False) as fill, _FlashSdpa():
                out = model(**_inputs(s, 0, past, fill), **{name: cache}, use_cache=True, logits_to_keep=1)
            cache = getattr(out, name)
            del out
        labels = _Labels(model)
        tracker = StorageTracker(label=labels, policy=policy or DataPolicy(),
                                 events=record.events if record else None, notes=record.notes if record else None)
        flash = model.config._attn_implementation == "sdpa" and not sdpa_runs_math(s)
        starts: list[int] = []
        split = 0

        def mark() -> None:  # a decoder layer starts (recording)
            starts.append(len(record.events) - split if record else 0)
        with tracker, _module_hooks(labels), _bnb_transients(model, quantized, s, labels), \
                (_FlashSdpa() if flash else contextlib.nullcontext()), \
                layer_starts(model, record.layers if record else None, mark) as found:
            _adopt(tracker, cache, record)
            split = len(record.events) if record else 0
            out = model(**_inputs(s, past, chunk, tracker), **{name: cache}, use_cache=True,
                        logits_to_keep=logits_to_keep)
            labels.override = "logits"
            last = out.logits[:, -1, :].to(copy=True, dtype=torch.float32)
            labels.override = None
            del last
            cache = getattr(out, name)
            kv = cache_tensors(cache) if cache is not None else []
            relabel = {serial: "kv_cache" for serial in (tracker.serial(t) for _, _, t in kv) if serial is not None}
            components = tracker.peak_by_label(relabel)
            if record is not None:
                record.split, record.end, record.starts = split, len(record.events), (record.starts[0], tuple(starts))
                record.cache_serials = frozenset(relabel)
                record.cache_storage = tuple(t.untyped_storage().nbytes() for _, _, t in kv)
                record.found = found and isinstance(getattr(cache, "layers", None), list) and len(cache.layers) == \
                    record.layers
    per_layer: dict[int, int] = {}
    for layer, _, t in kv:
        per_layer[layer] = per_layer.get(layer, 0) + (rounded(t.untyped_storage().nbytes()) if t.numel() else 0)
    n_layers = max(per_layer) + 1 if per_layer else 0
    return Replayed(tracker.peak.bytes, components, _peak_where(tracker.peak, relabel), tracker.largest_alloc,
                    tuple(per_layer.get(i, 0) for i in range(n_layers)),
                    tuple((layer, attr, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for layer, attr, t in kv))


def _peak_where(peak, relabel: dict[int, str]) -> str:
    """Where the peak was reached, in the model's terms: ``in_<component>`` of the allocation that made it (the
    component of the module it ran in: attention, activations, logits, kv_cache), for an operator name
    (``aten.mul.Tensor``) that would tell a user nothing; another name (a step of vramguard's own) as is."""
    if not peak.at.startswith("aten.") or not peak.live:
        return peak.at
    serial = max(peak.live)  # the allocation just made: the peak is checked as each one is added
    return "in_" + relabel.get(serial, peak.live[serial][1])


@lru_cache(maxsize=8)
def cached_replay_model(config_json: str, name: str, dtype: str, attn: str, sdpa_kernel: str):
    """:func:`replay_model` of the config ``config_json`` for the dtype and attention given, memoized."""
    s = Settings(quant="bf16", dtype=dtype if dtype != "bf16" else None, attn=attn, sdpa_kernel=sdpa_kernel)
    return replay_model(cached_config(config_json, name), s)


def replay_model(config, s: Settings):
    """The meta model to replay for ``s``: its dtype, and the attention implementation that would run
    (FlashAttention-2 through :data:`FA2_REPLAY`). Returns (model, note) where note says what was substituted."""
    attn = s.effective_attn
    if attn == "flash_attention_2":
        _register_fa2()
        try:
            return meta_model(config, s.act_dtype, FA2_REPLAY), None
        except (KeyError, ValueError, ConfigError):  # a model with its own table of attention classes (Falcon)
            return meta_model(config, s.act_dtype, "sdpa"), (
                "this architecture picks its attention class from its own table, so FlashAttention-2 was replayed "
                "as SDPA's flash kernel (the same output and log-sum-exp; a mask SDPA builds may be counted too)")
    try:
        return meta_model(config, s.act_dtype, attn), None
    except ConfigError as e:
        if attn == "eager":
            raise
        return meta_model(config, s.act_dtype, "eager"), (
            f"transformers refuses attn_implementation={s.effective_attn} for this architecture (from_pretrained "
            f"would raise: {e.fix}); planned with eager, which it loads with")
