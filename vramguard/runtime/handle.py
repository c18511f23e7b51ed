"""The loaded-model handle every runtime verb takes: the model, its tokenizer, the resolved spec, the settings as
loaded, the baseline memory snapshot and the SDPA pin.

vramguard sets no attribute on the model (an ``nn.Module`` of transformers). What it knows about a model it loaded
lives in the :class:`LoadedModel` :func:`~vramguard.runtime.load.load_model` returns, which every verb takes; a
bare model handed to a verb (one vramguard did not load) is described once by :func:`describe` from its config and
parameters: nothing is looked up again in a table.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vramguard.settings import ATTNS, Settings, short_dtype
from vramguard.spec import spec_from_config

if TYPE_CHECKING:
    from vramguard.runtime.device import MemorySnapshot
    from vramguard.spec import ModelSpec

SDPA_BACKENDS = ("flash", "cudnn", "efficient", "math")


class SdpaPin:
    """Every forward of a model runs inside ``torch.nn.attention.sdpa_kernel([backend])``: a forward pre-hook
    enters the context, a forward hook leaves it (PyTorch's module hooks, ``register_forward_pre_hook``)."""

    def __init__(self, model, backend: str):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        kind = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}[backend]
        self.backend = backend
        stack: list = []
        self._stack = stack

        def pre(_m, _a):
            cm = sdpa_kernel([kind])
            cm.__enter__()
            stack.append(cm)

        def post(_m, _a, _o):
            if stack:
                stack.pop().__exit__(None, None, None)

        self._hooks = (model.register_forward_pre_hook(pre), model.register_forward_hook(post))

    def remove(self) -> None:
        """Take both hooks off and leave any context still entered (a forward that raised)."""
        for h in self._hooks:
            h.remove()
        while self._stack:
            self._stack.pop().__exit__(None, None, None)


@dataclass
class LoadedModel:
    """What :func:`vramguard.runtime.load.load_model` returns, and what every runtime verb works from.

    Attributes:
        model, tokenizer: the transformers model and its tokenizer (None when the folder has none).
        report: the :class:`~vramguard.runtime.load.LoadReport` (None for a model vramguard did not load).
        spec: the :class:`~vramguard.spec.ModelSpec` the model was resolved to.
        settings: the :class:`~vramguard.settings.Settings` as loaded (weight format, compute dtype, dtype of
            the unquantized modules, attention), read from the model, not guessed.
        baseline: the memory snapshot taken before the weights were loaded (None without CUDA).
        sdpa_pin: the :class:`SdpaPin` every forward runs under, or None (:func:`pin_sdpa`).
    """

    model: Any  # transformers' PreTrainedModel (torch is not imported here)
    tokenizer: object = None
    report: object = None
    spec: ModelSpec | None = None
    settings: Settings = field(default_factory=Settings)
    baseline: MemorySnapshot | None = None

    def __iter__(self):  # model, tokenizer, report = load_model(...)
        return iter((self.model, self.tokenizer, self.report))

    @property
    def sdpa_pin(self) -> SdpaPin | None:
        return pin_of(self.model)

    @property
    def on_cuda(self) -> bool:
        """Whether the model's first parameter is on a CUDA device."""
        return next(self.model.parameters()).device.type == "cuda"


_PINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> SdpaPin


def _bare(model):
    return model.model if isinstance(model, LoadedModel) else model


def pin_of(model) -> SdpaPin | None:
    """The SDPA pin of ``model`` (bare or a handle), or None."""
    return _PINS.get(_bare(model))


def pin_sdpa(model, backend: str) -> None:
    """Run every forward of ``model`` (bare or a handle) inside ``sdpa_kernel([backend])``, replacing any pin."""
    unpin_sdpa(model)
    m = _bare(model)
    _PINS[m] = SdpaPin(m, backend)


def unpin_sdpa(model) -> None:
    """Take ``model``'s SDPA pin off (nothing happens without one)."""
    pin = _PINS.pop(_bare(model), None)
    if pin is not None:
        pin.remove()


@contextlib.contextmanager
def sdpa_unpinned(model, why: str):
    """Lift ``model``'s SDPA pin for the duration when it names a backend that takes no attention mask (PyTorch's
    flash kernel, cuDNN), and pin it again after. Calls that pass a mask (a static cache at every step, a prefill
    chunk after the first) would otherwise fail with "No available kernel".

    Yields:
        The note for the report (``why`` says what passes the mask), or None when nothing needed lifting.
    """
    pin = pin_of(model)
    if pin is None or pin.backend not in ("flash", "cudnn"):
        yield None
        return
    unpin_sdpa(model)
    try:
        yield f"the SDPA pin to {pin.backend} was lifted for this call: {why}"
    finally:
        pin_sdpa(model, pin.backend)


def handle_of(model, tokenizer=None) -> LoadedModel:
    """The handle a runtime verb works from, without a lookup: ``model`` itself when it is a
    :class:`LoadedModel` (``tokenizer``, when given, replacing its own), else one described from the bare model
    (:func:`describe`). Verbs take the handle :func:`~vramguard.runtime.load.load_model` returned."""
    if isinstance(model, LoadedModel):
        return model if tokenizer is None else replace(model, tokenizer=tokenizer)
    return describe(model, tokenizer)


def describe(model, tokenizer=None) -> LoadedModel:
    """A handle for a model vramguard did not load: the spec from ``model.config``, the settings from its
    quantization config, parameter dtype and attention implementation (:func:`loaded_settings`)."""
    spec = spec_from_config(model.config.to_dict(), name=getattr(model.config, "_name_or_path", "model"))
    return LoadedModel(model, tokenizer, None, spec, loaded_settings(model))


# transformers' BitsAndBytesConfig defaults (``utils/quantization_config.py``): what a quantization_config without
# the key means
BNB_DEFAULT_QUANT_TYPE, BNB_DEFAULT_DOUBLE_QUANT, BNB_DEFAULT_COMPUTE_DTYPE = "fp4", False, "fp32"


def decode_quantization_config(q) -> tuple[str | None, bool, str | None]:
    """(weight format, double quant, 4-bit compute dtype) of a model's ``quantization_config`` (a
    ``BitsAndBytesConfig`` or its dict): ``"nf4"``/``"fp4"`` for ``load_in_4bit`` (``bnb_4bit_quant_type``),
    ``"int8"`` for ``load_in_8bit``, the ``quant_method`` of any other method; None without a config. A key the
    config lacks means what transformers' ``BitsAndBytesConfig`` defaults it to (``fp4``, no double quant, float32
    compute): the one reading of it that both the handle's settings and the load report use."""
    if q is None:
        return None, BNB_DEFAULT_DOUBLE_QUANT, None
    d = q.to_dict() if hasattr(q, "to_dict") else dict(q)
    if d.get("load_in_4bit"):
        quant = "nf4" if d.get("bnb_4bit_quant_type", BNB_DEFAULT_QUANT_TYPE) == "nf4" else "fp4"
        compute = short_dtype(d.get("bnb_4bit_compute_dtype")) or BNB_DEFAULT_COMPUTE_DTYPE
        return quant, bool(d.get("bnb_4bit_use_double_quant", BNB_DEFAULT_DOUBLE_QUANT)), compute
    if d.get("load_in_8bit"):
        return "int8", BNB_DEFAULT_DOUBLE_QUANT, None
    return str(d.get("quant_method")), BNB_DEFAULT_DOUBLE_QUANT, None


def loaded_settings(model) -> Settings:
    """The settings a loaded model runs with, read from it: the weight format from ``config.quantization_config``
    (:func:`decode_quantization_config`; a method other than bitsandbytes' is ``bf16``, otherwise the model's
    dtype), the dtype of the unquantized modules from ``model.dtype`` and the attention from
    ``config._attn_implementation`` (SDPA for any other implementation)."""
    dtype = short_dtype(getattr(model, "dtype", None)) or "bf16"
    q = getattr(model.config, "quantization_config", None)
    method, double, compute = decode_quantization_config(q)
    quant = dtype if method is None else method if method in ("nf4", "fp4", "int8") else "bf16"
    if method not in ("nf4", "fp4"):
        double = True  # the Settings default, which only 4-bit reads
    attn = getattr(model.config, "_attn_implementation", "sdpa") or "sdpa"
    return Settings(quant=quant, double_quant=double, attn=attn if attn in ATTNS else "sdpa",
                    compute_dtype=compute, dtype=None if q is None else dtype)
