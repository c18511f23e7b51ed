"""Where ``from_pretrained(device_map="auto", max_memory=...)`` puts each module across several cards, taken from
transformers itself on the model built on the meta device (no memory is allocated).

transformers 5 computes the split in ``integrations/accelerate.py::_get_device_map`` (its port of accelerate's
``get_balanced_memory`` and ``infer_auto_device_map``): ``max_memory`` is balanced first (every card but the last
is capped at ``model size / cards + 1.25 x the largest no-split layer``), the bitsandbytes quantizer lowers it
(``adjust_max_memory``: 90% for 4-bit), then modules are placed in order, never splitting a class of the model's
``_no_split_modules``, keeping room on the first card for the largest layer. This module calls that code, with the
quantizer that ``from_pretrained`` builds, after the quantizer has swapped the layers it converts (the order of
``PreTrainedModel.from_pretrained``), and reads back which tensors each card holds. Sizes are vramguard's
(:mod:`vramguard.introspect.build`, each tensor rounded as the CUDA allocator holds it); the tests check that the
unrounded bytes per card equal transformers' ``compute_module_sizes`` of the modules placed there, and the split
equals accelerate's own ``infer_auto_device_map``.

Needs torch, transformers and accelerate (bitsandbytes for a 4-bit or 8-bit plan).
"""

from __future__ import annotations

import contextlib
import logging
from functools import lru_cache

from vramguard.errors import NotPlannable
from vramguard.extras import import_bitsandbytes
from vramguard.introspect.build import _bnb_config, _quiet, cached_config, meta_model
from vramguard.introspect.generic import structure_of
from vramguard.memory.weights import quantized_tensor_bytes, rounded
from vramguard.plan.multigpu.layerwise import layerwise_split
from vramguard.plan.multigpu.split import (CPU_UNBOUNDED_BYTES, OFF_GPU, DeviceSplit, device_of,  # noqa: F401
                                           map_key)
from vramguard.settings import Settings

@contextlib.contextmanager
def _quiet_accelerate():
    """accelerate warns that card N "is not available" when planning on a machine without it: hold that back."""
    log = logging.getLogger("accelerate.utils.modeling")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def meta_model_as_loaded(spec, s: Settings):
    """(the meta model ``from_pretrained`` builds for ``spec`` with ``s``, its bitsandbytes quantizer or None):
    the layers bitsandbytes converts are swapped by the quantizer's own ``preprocess_model``, as before the device
    map is computed.

    Raises:
        NotPlannable: a 4/8-bit plan without bitsandbytes installed (its quantizer sizes the layers).
    """
    import torch

    model = meta_model(cached_config(spec.config_json, spec.name), s.act_dtype)
    if not s.is_bnb:
        return model, None
    try:
        import_bitsandbytes()
    except ImportError as e:
        raise NotPlannable("quant", s.quant, "bf16, fp16 or fp32 without bitsandbytes installed",
                           f"install bitsandbytes to plan a {s.quant} split over several cards ({e})") from None
    from transformers.quantizers import AutoHfQuantizer
    quantizer = AutoHfQuantizer.from_config(_bnb_config(s.quant, s.double_quant, s.resolved_compute_dtype),
                                            pre_quantized=False)
    with _quiet(), torch.device("meta"):
        quantizer.preprocess_model(model=model, dtype=None, device_map="auto", checkpoint_files=None,
                                   use_kernels=False)
    return model, quantizer


def transformers_device_map(model, quantizer, max_memory: dict, mode: str = "auto") -> dict[str, int | str]:
    """``device_map=mode`` (``auto`` or ``sequential``) as ``from_pretrained`` computes it for ``max_memory``
    (``_get_device_map``: ``get_balanced_memory`` for ``auto``, the quantizer's ``adjust_max_memory``,
    ``infer_auto_device_map``)."""
    from transformers.integrations import accelerate as hf_accelerate

    with _quiet(), _quiet_accelerate():
        if quantizer is None and hasattr(hf_accelerate, "_get_device_map"):
            return dict(hf_accelerate._get_device_map(model, mode, dict(max_memory), None))
        # the same steps without the quantizer's validate_environment, which refuses a split that offloads: the
        # plan reports the offload instead
        balanced = dict(max_memory) if mode == "sequential" else hf_accelerate.get_balanced_memory(
            model, max_memory=dict(max_memory), no_split_module_classes=model._no_split_modules,
            hf_quantizer=quantizer)
        if quantizer is not None:
            balanced = quantizer.adjust_max_memory(balanced)
        return dict(hf_accelerate.infer_auto_device_map(model, max_memory=balanced,
                                                        no_split_module_classes=model._no_split_modules,
                                                        hf_quantizer=quantizer))


def _decoder_layers(model) -> list[str]:
    """Names of the decoder layers, in order: modules of a ``_no_split_modules`` class inside a ModuleList."""
    no_split = set(model._no_split_modules or ())
    return [n for n, m in model.named_modules() if type(m).__name__ in no_split and n.rsplit(".", 1)[-1].isdigit()]


def _tensor_bytes(t, s: Settings, converted: frozenset[str]) -> tuple[int, int]:
    """(allocator-rounded bytes, unrounded bytes as transformers counts them when it splits) of one TensorInfo: a
    converted weight at half a byte (4-bit) or one byte (8-bit) per value, a converted layer's bias in float32 (as
    bitsandbytes creates it on the meta model; it is loaded in the model dtype)."""
    if t.kind == "quantized":
        w, state = quantized_tensor_bytes(t.numel, t.dtype, s.double_quant, t.out_features)
        return w + state, t.numel // 2 if t.dtype != "int8" else t.numel
    if t.name.endswith(".bias") and t.name.rsplit(".", 1)[0] in converted:
        return rounded(t.nbytes), t.numel * 4
    return rounded(t.nbytes), t.nbytes


def split_weights(model, s: Settings, max_memory_bytes: tuple[int, ...], mode: str = "auto") -> DeviceSplit:
    """The device map of ``model.spec`` (``model`` a :class:`~vramguard.memory.model.MemoryModel`) loaded with
    ``s`` over cards with ``max_memory_bytes`` each, and the bytes each
    card holds (see :class:`DeviceSplit`); ``mode`` is the ``device_map`` string (``auto``: balanced over the
    cards, ``sequential``: each card filled in turn). Host memory is unbounded: modules that fit no card go to
    ``"cpu"``.
    A hand-written family is split by :mod:`vramguard.plan.multigpu.layerwise` (the same rule, without importing
    torch: the tests compare the two).

    Raises:
        NotPlannable: see :func:`meta_model_as_loaded`.
    """
    weights_only = Settings(quant=s.quant, double_quant=s.double_quant, compute_dtype=s.compute_dtype,
                            dtype=s.dtype)
    mm = tuple(int(b) for b in max_memory_bytes)
    if not model.needs_transformers:
        return layerwise_split(model.spec, weights_only, mm, mode)
    return _split(model.spec, weights_only, mm, mode)


@lru_cache(maxsize=16)
def _split(spec, s: Settings, max_memory: tuple[int, ...], mode: str = "auto") -> DeviceSplit:
    model, quantizer = meta_model_as_loaded(spec, s)
    mm: dict = {i: int(b) for i, b in enumerate(max_memory)}
    mm["cpu"] = CPU_UNBOUNDED_BYTES
    dmap = transformers_device_map(model, quantizer, mm, mode)
    n = len(max_memory)
    weights, raw = [0] * n, [0] * n
    offloaded: dict[str, int] = {}
    st = structure_of(spec, s)
    converted = frozenset(st.quantized_modules)
    for t in st.tensors:
        dev = device_of(t.name, dmap)
        rb, ub = _tensor_bytes(t, s, converted)
        if dev in OFF_GPU:
            key = map_key(t.name, dmap)
            offloaded[key] = offloaded.get(key, 0) + ub
            continue
        weights[int(dev)] += rb
        raw[int(dev)] += ub
    layers: list[list[int]] = [[] for _ in range(n)]
    for i, lname in enumerate(_decoder_layers(model)):
        dev = device_of(lname, dmap)
        if dev not in OFF_GPU:
            layers[int(dev)].append(i)
    names = {m: k for k, m in model.named_modules()}
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    input_card = device_of(names[inp], dmap) if inp is not None else 0
    output_card = device_of(names[out], dmap) if out is not None else input_card
    return DeviceSplit(dmap, tuple(weights), tuple(raw), tuple(tuple(x) for x in layers), input_card, output_card,
                       offloaded, tuple(max_memory), tuple(model._no_split_modules or ()))
