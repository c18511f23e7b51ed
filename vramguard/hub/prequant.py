"""Weights of a pre-quantized checkpoint from the tensors it stores, and what transformers does with them at load.

The stored tensors are the truth (:mod:`vramguard.hub.headers`): GPTQ/AWQ keep packed int32 ``qweight``/``qzeros``
with ``scales`` (and ``g_idx``); fine-grained FP8 keeps ``F8_E4M3`` weights with float32 ``weight_scale_inv``;
MXFP4 (gpt-oss) keeps ``*_blocks`` (uint8, two FP4 values per byte) and ``*_scales`` (uint8 E8M0);
compressed-tensors keeps ``weight_packed`` (int32) or FP8 ``weight`` with ``weight_scale``/``weight_zero_point``;
bitsandbytes keeps uint8 weights with ``absmax``/``quant_map``/``quant_state.*`` (or int8 with ``SCB``).

At load (transformers 5.17-5.24, ``quantizers/quantizer_*.py::validate_environment``):

* fine-grained FP8: dequantized to bf16 on a CUDA card below compute capability 8.9, or with
  ``dequantize: true`` in its quantization config;
* MXFP4: dequantized to bf16 below compute capability 7.5, without Triton >= 3.4 or without the ``kernels``
  package;
* compressed-tensors: dequantized to the model dtype with ``dequantize: true``; otherwise kept compressed (the
  compressed-tensors library may decompress on the first forward);
* GPTQ needs ``optimum`` and ``gptqmodel``, AWQ ``gptqmodel``, bitsandbytes ``bitsandbytes``: without them
  ``from_pretrained`` raises ImportError; the tensors load as stored.

Kept tensors take their stored bytes; floating tensors outside the quantized layers (embeddings, norms, lm_head,
biases) take the model dtype; each tensor is rounded to 512 B as the CUDA caching allocator holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from vramguard.dtypes import SAFETENSORS_FLOATS
from vramguard.finding import Finding
from vramguard.hub.headers import CheckpointHeaders, TensorHeader
from vramguard.memory.weights import rounded, WeightBytes
from vramguard.memory.model import MemoryModel
from vramguard.settings import DTYPE_BYTES
from vramguard.units import fmt_bytes

# name endings of the packed / low-precision weight of a quantized layer
_QWEIGHT_ENDINGS = (".qweight", ".weight_packed", "_blocks")
# name endings of quantization state: scales, zero points, group indices, codes, shapes
_QSTATE_ENDINGS = (".qzeros", ".scales", ".g_idx", ".weight_scale", ".weight_scale_inv", "_scales", ".scale_inv",
                   ".weight_zero_point", ".weight_g_idx", ".weight_shape", ".input_scale", ".absmax", ".quant_map",
                   ".nested_absmax", ".nested_quant_map", ".SCB", ".weight_format", ".zeros")
_BACKENDS = {"gptq": ("optimum", "gptqmodel"), "awq": ("gptqmodel",), "compressed-tensors": ("compressed-tensors",),
             "bitsandbytes": ("bitsandbytes",), "fp8": ("accelerate",), "mxfp4": ("accelerate",)}
METHOD_NAMES = {"gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8", "mxfp4": "MXFP4", "compressed-tensors":
                "compressed-tensors", "bitsandbytes": "bitsandbytes"}


def tensor_kind(t: TensorHeader) -> str:
    """``qweight`` (a quantized layer's packed or low-precision weight), ``qstate`` (its scales, zero points,
    codes), ``embedding``, ``lm_head``, ``norm``, ``bias`` or ``dense`` (a floating matrix left unquantized)."""
    if t.name.endswith(_QSTATE_ENDINGS) or ".quant_state." in t.name:
        return "qstate"
    if t.name.endswith(_QWEIGHT_ENDINGS) or (t.name.endswith(".weight") and t.dtype not in SAFETENSORS_FLOATS):
        return "qweight"
    if t.name.endswith(".bias") or t.name.endswith("_bias"):
        return "bias"
    if t.name.startswith("lm_head.") or t.name == "output.weight":
        return "lm_head"
    if "embed" in t.name or ".wte." in t.name or ".wpe." in t.name:
        return "embedding"
    return "norm" if len(t.shape) <= 1 else "dense"


INSTALLED_OVERRIDE: Callable[[str], str | None] | None = None  # tests: force which packages are installed


def _installed(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None (:data:`INSTALLED_OVERRIDE` when set)."""
    if INSTALLED_OVERRIDE is not None:
        return INSTALLED_OVERRIDE(dist)
    from importlib import metadata
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@dataclass(frozen=True)
class LoadRule:
    """What transformers does with a pre-quantized checkpoint at load, and why.

    ``dequantize``: the quantized layers become dense ``dequantized_dtype`` weights; ``missing``: pip names of
    packages ``from_pretrained`` needs for this method that are not installed; ``reason``: the rule, in words.
    """

    method: str
    dequantize: bool
    dequantized_dtype: str | None
    reason: str
    missing: tuple[str, ...] = ()


def _version_at_least(v: str | None, want: tuple[int, ...]) -> bool:
    if not v:
        return False
    parts = []
    for p in v.split("+")[0].split(".")[:len(want)]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts) >= want


def load_rule(method: str, qcfg: dict, capability: tuple[int, int] | None,
              installed: Callable[[str], str | None] = _installed) -> LoadRule:
    """The rule of transformers' quantizer for ``method`` on a card of ``capability`` (None: not known, planned
    as a card that runs the kernels), with the packages of this environment (``installed``: dist name -> version
    or None; a hook for tests). See the module docstring for the rules and their sources."""
    missing = tuple(d for d in _BACKENDS.get(method, ()) if installed(d) is None)
    cc = ".".join(map(str, capability)) if capability else None
    if qcfg.get("dequantize") is True and method in ("fp8", "mxfp4", "compressed-tensors"):
        to = "bf16" if method != "compressed-tensors" else None
        return LoadRule(method, True, to, "its quantization config sets dequantize: true", missing)
    if method == "fp8":
        if capability and capability < (8, 9):
            return LoadRule(method, True, "bf16", f"FP8 needs compute capability 8.9 (this card: {cc}): "
                            "transformers dequantizes to bf16", missing)
        return LoadRule(method, False, None, f"FP8 kept (compute capability {cc or 'unknown, planned as >= 8.9'})",
                        missing)
    if method == "mxfp4":
        triton, kernels = installed("triton"), installed("kernels")
        why = (f"MXFP4 needs compute capability 7.5 (this card: {cc})" if capability and capability < (7, 5) else
               f"MXFP4 needs Triton >= 3.4 (installed: {triton or 'none'})" if not _version_at_least(triton, (3, 4))
               else "MXFP4 needs the kernels package (not installed)" if kernels is None else None)
        if why:
            return LoadRule(method, True, "bf16", why + ": transformers dequantizes to bf16",
                            missing + tuple(p for p, v in (("triton", triton), ("kernels", kernels)) if v is None))
        return LoadRule(method, False, None, f"MXFP4 kept (Triton {triton}, kernels {kernels})", missing)
    if missing:
        return LoadRule(method, False, None, f"loading {METHOD_NAMES.get(method, method)} needs "
                        f"{' and '.join(missing)}, not installed here: from_pretrained raises ImportError", missing)
    return LoadRule(method, False, None, f"{METHOD_NAMES.get(method, method)} tensors load as stored")


def _dequantized_numel(t: TensorHeader, method: str, qcfg: dict) -> int:
    """Values of the dense weight a quantized tensor stands for: MXFP4 blocks hold two per byte; a packed int32
    holds ``32 / num_bits`` (compressed-tensors ``weight_packed``); an FP8/int8 weight one per element."""
    if t.name.endswith("_blocks"):
        return 2 * t.nbytes
    if t.name.endswith((".weight_packed", ".qweight")):
        bits = int(qcfg.get("bits") or qcfg.get("num_bits") or _ct_bits(qcfg) or 4)
        return t.nbytes * 8 // bits
    return t.numel


def _ct_bits(qcfg: dict) -> int | None:
    for group in (qcfg.get("config_groups") or {}).values():
        bits = ((group or {}).get("weights") or {}).get("num_bits")
        if bits:
            return int(bits)
    return None


def header_weight_bytes(ck: CheckpointHeaders, method: str, qcfg: dict, act_dtype: str,
                        rule: LoadRule) -> WeightBytes:
    """Weights on the card after ``from_pretrained`` of a pre-quantized checkpoint (see the module docstring).

    Kept tensors: ``rounded(nbytes)`` as stored; floating tensors outside quantized layers:
    ``rounded(numel x bytes of act_dtype)``; with ``rule.dequantize`` each quantized weight becomes
    ``rounded(values x 2)`` (bf16) and its state is freed. ``parameter_count`` counts stored elements except a
    quantized weight, counted as the values it stands for.

    Example (one GPTQ 4-bit layer 4096 x 4096, group size 128, fp16): qweight int32 (512, 4096) = 8,388,608 B;
    qzeros int32 (32, 512) = 65,536 B; scales fp16 (32, 4096) = 262,144 B; g_idx int32 (4096,) = 16,384 B ->
    8,732,672 B kept as stored.
    """
    dt = DTYPE_BYTES[act_dtype]
    parts = dict.fromkeys(("qweight", "qstate", "dense", "embedding", "lm_head", "norm", "bias"), 0)
    n_params = n_q = 0
    to_bytes = DTYPE_BYTES[rule.dequantized_dtype or act_dtype]
    for t in ck.tensors:
        kind = tensor_kind(t)
        if kind == "qweight":
            values = _dequantized_numel(t, method, qcfg)
            n_q += values
            n_params += values
            parts["qweight"] += rounded(values * to_bytes) if rule.dequantize else rounded(t.nbytes)
            continue
        if kind == "qstate":
            parts["qstate"] += 0 if rule.dequantize else rounded(t.nbytes)
            continue
        n_params += t.numel
        parts[kind] += rounded(t.numel * dt) if t.dtype in SAFETENSORS_FLOATS else rounded(t.nbytes)
    q_lin, dense = (0, parts["qweight"]) if rule.dequantize else (parts["qweight"], 0)
    return WeightBytes(quantized_linear_bytes=q_lin, quant_state_bytes=parts["qstate"],
                       dense_linear_bytes=dense + parts["dense"], embedding_bytes=parts["embedding"],
                       lm_head_bytes=parts["lm_head"], norm_bytes=parts["norm"], bias_bytes=parts["bias"],
                       parameter_count=n_params, quantized_parameter_count=0 if rule.dequantize else n_q)


def quant_config(spec) -> dict:
    """The checkpoint's ``quantization_config`` from the spec's config.json (``{}`` when absent)."""
    import json
    cfg = json.loads(spec.config_json) if spec.config_json else {}
    q = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
    return q if isinstance(q, dict) else {}


def uses_headers(spec) -> bool:
    """Whether the weights of ``spec`` are planned from its checkpoint headers: a pre-quantized checkpoint whose
    safetensors headers were read."""
    ck = getattr(spec, "checkpoint", None)
    return bool(spec.prequantized and ck is not None and ck.format == "safetensors" and ck.tensors)


def spec_rule(spec, installed: Callable[[str], str | None] = _installed) -> LoadRule:
    """:func:`load_rule` for ``spec``'s method and the card its checkpoint record was planned for."""
    return load_rule(str(spec.prequantized), quant_config(spec), spec.checkpoint.card_capability, installed)


def prequantized_weight_bytes(spec, s) -> WeightBytes:
    """:func:`header_weight_bytes` of ``spec``'s checkpoint with the settings' model dtype and the load rule of
    the card it is planned for (:func:`spec_rule`)."""
    return header_weight_bytes(spec.checkpoint, str(spec.prequantized), quant_config(spec), s.act_dtype,
                               spec_rule(spec))


def _dequantized_rule(rule: LoadRule) -> LoadRule:
    return replace(rule, dequantize=True, dequantized_dtype="bf16")


_DEQUANT_FIX = {"fp8": "a card of compute capability 8.9 or newer (RTX 4090, L4, H100) keeps FP8; or a bf16 or "
                       "4-bit checkpoint of the model",
                "mxfp4": "pip install 'triton>=3.4' kernels on a card of compute capability 7.5 or newer keeps MXFP4",
                "compressed-tensors": "drop dequantize from the quantization config to keep the weights compressed"}
_PIP = {"gptq": "pip install optimum gptqmodel", "awq": "pip install gptqmodel",
        "compressed-tensors": "pip install compressed-tensors", "bitsandbytes": "pip install bitsandbytes"}


def prequant_findings(p) -> list:
    """Findings of a plan whose weights come from a pre-quantized checkpoint's headers: the stored bytes, what
    transformers does at load on the planned card (dequantized: the cost), a backend the load needs; or that a
    pre-quantized checkpoint's headers were not read."""
    spec, s = p.model, p.settings
    if not spec.prequantized:
        return stored_findings(p)
    name = METHOD_NAMES.get(spec.prequantized, spec.prequantized)
    if not uses_headers(spec):
        return [Finding("prequantized_config_only", "warn", f"the checkpoint is pre-quantized ({name}) but its "
                        "safetensors headers were not read: its weights are planned as the architecture under "
                        f"quant={s.quant}, not from what it stores",
                        "plan the Hub id online, or a folder holding its .safetensors files")]
    ck, rule, qcfg = spec.checkpoint, spec_rule(spec), quant_config(spec)
    on_card = p.estimate.weights.total_bytes
    out = [Finding("prequantized_weights", "info", f"weights from the checkpoint's headers: {fmt_bytes(ck.total_bytes)}"
                   f" stored in {len(ck.tensors):,} tensors ({name}), {fmt_bytes(on_card)} on the card "
                   f"(each tensor rounded to 512 B; 16-bit tensors in {s.act_dtype}); {rule.reason}", None, on_card)]
    if rule.dequantize:
        kept = header_weight_bytes(ck, spec.prequantized, qcfg, s.act_dtype, replace(rule, dequantize=False))
        out.append(Finding("prequantized_dequantized", "warn", f"transformers dequantizes the {name} weights at "
                           f"load ({rule.reason}): {fmt_bytes(on_card)} instead of {fmt_bytes(kept.total_bytes)} "
                           f"(+{fmt_bytes(on_card - kept.total_bytes)})", _DEQUANT_FIX.get(spec.prequantized),
                           on_card - kept.total_bytes))
    elif spec.prequantized in ("fp8", "mxfp4"):
        dq = header_weight_bytes(ck, spec.prequantized, qcfg, s.act_dtype, _dequantized_rule(rule))
        where = ("below compute capability 8.9" if spec.prequantized == "fp8" else
                 "below compute capability 7.5, or without Triton >= 3.4 and the kernels package")
        out.append(Finding("prequantized_dequantize_cost", "info", f"on a card {where}, transformers dequantizes "
                           f"the {name} weights to bf16: {fmt_bytes(dq.total_bytes)} (+"
                           f"{fmt_bytes(dq.total_bytes - on_card)})", None, dq.total_bytes - on_card))
    if rule.missing and spec.prequantized in _PIP:
        out.append(Finding("prequantized_backend", "warn", f"loading {name} weights needs "
                           f"{' and '.join(rule.missing)} (not installed here): from_pretrained raises ImportError",
                           _PIP[spec.prequantized]))
    return out


def stored_findings(p) -> list:
    """For a 16-bit checkpoint whose headers were read: what it stores (bytes by dtype, parameters), and a
    warning when its parameter count and the planned model's differ by more than 1% (a config that does not
    describe these weights)."""
    ck = getattr(p.model, "checkpoint", None)
    if ck is None or ck.format != "safetensors" or not ck.tensors:
        return []
    stored = sum(t.numel for t in ck.tensors)
    planned = p.estimate.weights.parameter_count
    dtypes = ", ".join(f"{fmt_bytes(b)} {dt}" for dt, b in ck.bytes_by_dtype().items())
    out = [Finding("checkpoint_stored", "info", f"the checkpoint stores {stored:,} parameters in "
                   f"{len(ck.tensors):,} tensors ({dtypes}); the plan loads {planned:,}", None, ck.total_bytes)]
    if planned and abs(stored - planned) * 100 > planned:
        out.append(Finding("checkpoint_mismatch", "warn", f"the checkpoint's {stored:,} stored parameters and "
                           f"the {planned:,} of the model its config.json describes differ by more than 1%",
                           "check that config.json belongs to these weights (another revision or a merged "
                           "adapter can change them)"))
    return out


@dataclass(frozen=True)
class CheckpointModel(MemoryModel):
    """A pre-quantized checkpoint whose safetensors headers were read (:func:`uses_headers`): its weights are what
    it stores, loaded by the rule of the card it is planned for (:func:`prequantized_weight_bytes`); every other
    figure is ``base``'s. The load's peak is not planned (transformers' meta model is not what it loads)."""

    base: MemoryModel

    @property
    def spec(self):  # type: ignore[override]
        return self.base.spec

    @property
    def needs_transformers(self) -> bool:  # type: ignore[override]
        return self.base.needs_transformers

    @property
    def sources(self) -> dict[str, str]:
        return {**self.base.sources, "weights": f"the checkpoint's safetensors headers ({self.spec.prequantized})",
                "load": "not planned (a pre-quantized checkpoint loads as stored)"}

    def with_spec(self, spec) -> CheckpointModel:
        return CheckpointModel(self.base.with_spec(spec))

    def weight_bytes(self, s) -> WeightBytes:
        return prequantized_weight_bytes(self.spec, s)

    def linear_groups(self, s=None):
        return self.base.linear_groups(s)

    def kv_cache_bytes(self, s, n_tokens: int, in_prefill_chunk: int = 0):
        return self.base.kv_cache_bytes(s, n_tokens, in_prefill_chunk)

    def kv_per_layer(self, s, n_tokens: int, in_prefill_chunk: int = 0) -> tuple[int, ...]:
        return self.base.kv_per_layer(s, n_tokens, in_prefill_chunk)

    def kv_bytes_per_token(self, s) -> int:
        return self.base.kv_bytes_per_token(s)

    def kv_growth_per_token(self, s, n_tokens: int) -> dict[str, int]:
        return self.base.kv_growth_per_token(s, n_tokens)

    def layer_kinds(self) -> tuple[str, ...]:
        return self.base.layer_kinds()

    def forward_peak(self, s, past: int, chunk: int, phase: str = "prefill"):
        return self.base.forward_peak(s, past, chunk, phase)

    def forward_parts(self, s, past: int, chunk: int):
        return self.base.forward_parts(s, past, chunk)

    def tp_rank(self, shards):
        rank, divisor = self.base.tp_rank(shards)
        return CheckpointModel(rank), divisor

    def learned_positions(self) -> int | None:
        return self.base.learned_positions()

    def findings(self, s) -> list:
        return self.base.findings(s)

    def forward_parts_measured(self, s) -> tuple[str, ...]:
        return self.base.forward_parts_measured(s)
