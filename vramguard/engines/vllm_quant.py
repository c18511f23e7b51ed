"""How vLLM stores a checkpoint's linears and MoE experts on the GPU, by quantization format (bytes per tensor).

Pure functions of a config's ``quantization_config`` (or vLLM's ``quantization`` engine argument); no torch. Every
tensor is rounded to the caching allocator's 512 B block. The shapes are those of the quantization methods'
``create_weights`` and what ``process_weights_after_loading`` keeps (vLLM 0.19.0, ``vllm/model_executor/layers/
quantization/``):

* ``gptq`` / ``awq`` / compressed-tensors 4-bit (``pack-quantized``), run by the Marlin kernels (``gptq_marlin.py``,
  ``awq_marlin.py``, ``utils/marlin_utils.py``): 4-bit weights repacked in place (0.5 B each), one 16-bit scale per
  ``group_size`` inputs and output; AWQ keeps its zero points (4 bits per group and output); GPTQ's ``qzeros`` and,
  without ``desc_act``, ``g_idx`` are replaced by empty tensors; with ``desc_act`` ``g_idx`` and its sort indices
  stay (int32 per input, twice).
* block FP8 (``fp8.py`` with ``weight_block_size``, e.g. ``[128, 128]``): 1 B per weight and one fp32
  ``weight_scale_inv`` per block.
* compressed-tensors 8-bit (int or float, ``channel`` or ``tensor``): 1 B per weight, fp32 scales per output row or
  logical shard, plus one fp32 input scale per shard when activations are static.
* bitsandbytes 4-bit (``bitsandbytes.py``: ``torch.empty(total_size // quant_ratio, 1, dtype=torch.uint8)``), pre-
  quantized or quantized at load (``model_loader/bitsandbytes_loader.py`` calls ``quantize_4bit(...,
  compress_statistics=True, quant_type="nf4")``: bitsandbytes' blocks of 64 with double quantization): 0.5 B per
  weight, one uint8 absmax per 64 weights and one fp32 absmax per 256 of those, and the two code books (16 and 256
  fp32) per logical shard. 8-bit: 1 B per weight and one fp32 row scale (``SCB``).
* MXFP4 (gpt-oss, ``mxfp4.py``): the MoE experts only, 4-bit values with one uint8 scale per 32; the kernel pads the
  expert shapes: ``marlin`` (below compute capability 9.0, and on 9.x without Triton's kernels: vLLM 0.10's PyPI
  install) pads the intermediate size to a multiple of 128 and the hidden size to 256; ``triton`` (9.x) pads the
  intermediate size to 64 and its swizzled value layout the hidden dimension to a multiple of 256 (modelled: it
  reproduces the 13.47 and 64.38 GiB vLLM logged for gpt-oss-20b and -120b on H100 within 0.25%); ``flashinfer``
  (10.x) pads both to 256. Expert biases are kept in fp32 on the Triton path, else in the model dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.errors import ConfigError, InvalidValue
from vramguard.memory.weights import rounded
from vramguard.runtime.handle import decode_quantization_config



FORMATS = ("none", "int8_fp8", "marlin4", "fp8_block", "bnb4", "bnb8", "mxfp4")
# vLLM's `quantization` engine arguments that quantize a 16-bit checkpoint as it loads (the ones planned here)
AT_LOAD = ("bitsandbytes", "fp8")
# formats a checkpoint is saved in: vLLM reads them from its quantization_config (weight_format below does too)
CHECKPOINT_FORMATS = ("gptq", "awq", "gptq_marlin", "awq_marlin", "compressed-tensors", "mxfp4")


def refused_quantization(value: object, field: str = "quantization") -> InvalidValue:
    """The error for a vLLM ``quantization`` outside :data:`AT_LOAD`, saying why and what to use instead: a format
    of :data:`CHECKPOINT_FORMATS` (``gptq``) is one a checkpoint is saved in, not one vLLM quantizes a 16-bit
    checkpoint to; its format is read from the checkpoint's ``quantization_config``, as vLLM reads it."""
    accepted = "bitsandbytes (NF4) or fp8, the formats vLLM quantizes a 16-bit checkpoint to as it loads; or unset"
    name = str(value).lower()
    if name in CHECKPOINT_FORMATS:
        return InvalidValue(field, value, accepted, f"{name} is the format of a checkpoint saved quantized, which "
                            "vLLM reads from its config.json (quantization_config): leave the option unset and plan "
                            f"the {name} checkpoint itself (its Hub id or folder), or quantize this one at load with "
                            "fp8 or bitsandbytes")
    return InvalidValue(field, value, accepted, "leave it unset for a checkpoint saved quantized (vLLM reads its "
                        "format from its config.json), or quantize at load with fp8 or bitsandbytes")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


@dataclass(frozen=True)
class WeightFormat:
    """The storage of one checkpoint's quantized layers in vLLM.

    Attributes:
        kind: one of :data:`FORMATS` (``none``: every linear in the model dtype).
        name: the checkpoint's or engine argument's name for it (``gptq``, ``awq``, ``fp8``, ``bitsandbytes``...).
        group_size: inputs per scale (Marlin 4-bit); -1 is one group per row (channel-wise).
        zero_points: Marlin keeps 4-bit zero points (AWQ, asymmetric compressed-tensors).
        act_order: GPTQ ``desc_act`` (``g_idx`` kept).
        block: block FP8's ``weight_block_size``.
        strategy, static_input: compressed-tensors 8-bit scales (``channel`` / ``tensor``).
        linears: the dense linears are quantized (False for MXFP4, whose attention stays in the model dtype).
    """

    kind: str
    name: str = ""
    group_size: int = 128
    zero_points: bool = False
    act_order: bool = False
    block: tuple[int, int] = (128, 128)
    strategy: str = "channel"
    static_input: bool = False
    linears: bool = True

    def linear_bytes(self, out_rows: int, in_cols: int, shards: int, dtype_bytes: int) -> int:
        """Bytes of one linear of ``out_rows x in_cols`` (one rank's shard) made of ``shards`` logical linears.

        Example (Marlin GPTQ, group 128, Llama-3.1-8B's o_proj 4,096 x 4,096): weights 8,388,608 B + scales
        32 x 4,096 x 2 = 262,144 B = 8,650,752 B.
        """
        n = out_rows * in_cols
        if self.kind == "none" or not self.linears:
            return rounded(n * dtype_bytes)
        if self.kind == "int8_fp8":
            scales = out_rows if self.strategy == "channel" else shards
            return rounded(n) + rounded(scales * 4) + (rounded(shards * 4) if self.static_input else 0)
        if self.kind == "marlin4":
            groups = 1 if self.group_size <= 0 else cdiv(in_cols, self.group_size)
            total = rounded(n // 2) + rounded(groups * out_rows * 2)
            if self.zero_points:
                total += rounded(groups * out_rows // 2)
            if self.act_order:
                total += 2 * rounded(in_cols * 4)
            return total
        if self.kind == "fp8_block":
            return rounded(n) + rounded(cdiv(out_rows, self.block[0]) * cdiv(in_cols, self.block[1]) * 4)
        if self.kind == "bnb4":
            absmax = cdiv(n, 64)
            return rounded(n // 2) + rounded(absmax) + rounded(cdiv(absmax, 256) * 4) + shards * rounded(272 * 4)
        if self.kind == "bnb8":
            return rounded(n) + rounded(out_rows * 4)
        raise ConfigError("quantization", self.kind, ", ".join(FORMATS), "a format vramguard models for vLLM")

    def experts_bytes(self, experts: int, inter: int, hidden: int, dtype_bytes: int, mxfp4_backend: str = "triton",
                      bias: bool = False) -> int:
        """Bytes of one layer's ``experts`` (FusedMoE ``w13``: ``2 x inter x hidden`` and ``w2``: ``hidden x
        inter`` each, ``inter`` already divided by the tensor parallel size), with their biases when ``bias``.

        Example (MXFP4 on H100, gpt-oss-20b: 32 experts, 2,880 x 2,880): values padded to a hidden size of 3,072,
        32 x (5,760 x 3,072 + 3,072 x 2,880) / 2 = 424,673,280 B, scales 32 x 8,640 x 2,880 / 32 = 24,883,200 B,
        fp32 biases 32 x 8,640 x 4 = 1,105,920 B.
        """
        if self.kind == "mxfp4":
            return self._mxfp4_experts(experts, inter, hidden, dtype_bytes, mxfp4_backend, bias)
        b = experts * (2 * inter + hidden) * dtype_bytes if bias else 0
        if self.kind == "none":
            return rounded(experts * 2 * inter * hidden * dtype_bytes) + rounded(experts * hidden * inter
                                                                                 * dtype_bytes) + rounded(b)
        w13 = self.linear_bytes(2 * inter, hidden, 2, dtype_bytes)
        w2 = self.linear_bytes(hidden, inter, 1, dtype_bytes)
        return experts * (w13 + w2) + rounded(b)

    def _mxfp4_experts(self, e: int, inter: int, hidden: int, dt: int, backend: str, bias: bool) -> int:
        if backend == "marlin":  # created padded
            i_p, h_made, h_values, bias_bytes = round_up(inter, 128), round_up(hidden, 256), None, dt
        elif backend == "triton":  # created unpadded; the swizzled values pad the hidden dimension
            i_p, h_made, h_values, bias_bytes = round_up(inter, 64), hidden, round_up(hidden, 256), 4
        else:  # FlashInfer: created padded
            i_p, h_made, h_values, bias_bytes = round_up(inter, 256), round_up(hidden, 256), None, dt
        values = e * 3 * i_p * (h_values or h_made) // 2
        scales = e * 3 * i_p * h_made // 32
        biases = e * (2 * i_p + h_made) * bias_bytes if bias else 0
        return rounded(values) + rounded(scales) + rounded(biases)


def weight_format(config: dict, quantization: str | None = None) -> WeightFormat:
    """The :class:`WeightFormat` of a config.json (``quantization_config``) or of vLLM's ``quantization`` engine
    argument (``bitsandbytes``: 4-bit NF4 applied at load to an unquantized checkpoint; ``fp8``: FP8 made at load
    from a checkpoint that is not FP8-serialized, vLLM 0.19.0's ``Fp8OnlineLinearMethod`` in ``quantization/fp8.py``:
    ``ops.scaled_fp8_quant(weight, scale=None)``, 1 B per weight and one fp32 scale per tensor, the embedding and
    ``lm_head`` kept in the model dtype; each layer is quantized as it loads -- a 0.19.0 log of Llama-3.1-8B shows a
    load peak of 8.68 GiB for the 8.49 GiB kept, github.com/llm-d-incubation/llm-d-planner,
    accuracy/results/v0.19.0/logs).

    Raises:
        ConfigError: a quantization method vramguard does not model for vLLM, naming the field; a ``quantization``
            that is not the pre-quantized checkpoint's own method (vLLM 0.19.0's ``ModelConfig._verify_quantization``
            stops: "Quantization method specified in the model config ... does not match the quantization method
            specified in the `quantization` argument").
    """
    q = config.get("quantization_config") or {}
    if not q:
        if quantization in (None, "none"):
            return WeightFormat("none")
        if quantization == "bitsandbytes":
            return WeightFormat("bnb4", "bitsandbytes")
        if quantization == "fp8":  # fp8.py's Fp8OnlineLinearMethod: per-tensor scales
            return WeightFormat("int8_fp8", "fp8", strategy="tensor")
        raise ConfigError("quantization", quantization, "bitsandbytes (4-bit NF4 at load) or fp8 (FP8 at load) for "
                          "an unquantized checkpoint", "use a pre-quantized checkpoint for other formats")
    method = str(q.get("quant_method") or "").lower()
    if quantization not in (None, "none", method):  # vllm/config/model.py::_verify_quantization refuses it
        raise ConfigError("quantization", quantization, f"unset, or the checkpoint's own {method}",
                          f"leave it unset: vLLM reads the checkpoint's quantization_config ({method}) and stops on "
                          f"another method given")
    if method in ("gptq", "awq", "gptq_marlin", "awq_marlin"):
        bits = int(q.get("bits") or q.get("w_bit") or 4)
        if bits != 4:
            raise ConfigError("config.json:quantization_config.bits", bits, "4 (Marlin)",
                              "8-bit GPTQ/AWQ is not modelled for vLLM")
        group = int(q.get("group_size") or q.get("q_group_size") or 128)
        awq = method.startswith("awq")
        return WeightFormat("marlin4", method, group_size=group, zero_points=awq or not q.get("sym", True),
                            act_order=bool(q.get("desc_act")) and not awq)
    if method == "fp8" and q.get("weight_block_size"):
        bs = q["weight_block_size"]
        return WeightFormat("fp8_block", "fp8", block=(int(bs[0]), int(bs[1])))
    if method == "fp8":
        return WeightFormat("int8_fp8", "fp8", strategy="channel")
    if method == "bitsandbytes":
        eight = decode_quantization_config(q)[0] == "int8"
        return WeightFormat("bnb8" if eight else "bnb4", "bitsandbytes")
    if method == "mxfp4":
        return WeightFormat("mxfp4", "mxfp4", linears=False)
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    raise ConfigError("config.json:quantization_config.quant_method", method,
                      "gptq, awq, fp8 (block or channel), bitsandbytes, mxfp4 or compressed-tensors",
                      "plan the unquantized model, or another checkpoint of it")


def _compressed_tensors(q: dict) -> WeightFormat:
    """compressed-tensors with one config group: 8-bit int/float weights (``channel``/``tensor``), 4-bit
    ``pack-quantized`` int weights (Marlin, ``group`` or ``channel``), or float weights in blocks."""
    groups = [g for g in (q.get("config_groups") or {}).values() if isinstance(g, dict)]
    group = groups[0] if len(groups) == 1 else {}
    w = group.get("weights") or {}
    acts = group.get("input_activations") or {}
    bits, typ, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if bits == 8 and typ in ("int", "float") and strategy in ("channel", "tensor"):
        return WeightFormat("int8_fp8", "compressed-tensors", strategy=strategy,
                            static_input=bool(acts) and not acts.get("dynamic", True))
    if bits == 8 and typ == "float" and strategy == "block":
        bs = w.get("block_structure") or [128, 128]
        return WeightFormat("fp8_block", "compressed-tensors", block=(int(bs[0]), int(bs[1])))
    if bits == 4 and typ == "int" and strategy in ("group", "channel"):
        size = int(w.get("group_size") or -1) if strategy == "group" else -1
        return WeightFormat("marlin4", "compressed-tensors", group_size=size, zero_points=not w.get("symmetric", True))
    raise ConfigError("config.json:quantization_config.config_groups", f"{bits}-bit {typ} {strategy}",
                      "one group of 8-bit int/float (channel, tensor or block) or 4-bit int (group, channel) weights",
                      "plan the unquantized model, or another checkpoint of it")
