"""Peak memory of one forward pass (a prefill chunk or a decode step) of a transformers decoder-only model.

The forward is replayed on a :class:`~vramguard.memory.tape.Tape` in the order transformers 5 executes it
(``models/llama/modeling_llama.py`` and the families in :mod:`vramguard.spec`; generation in
``generation/utils.py``), allocating each tensor when Python creates it and freeing it when the last reference
goes. Only the last decoder layer is replayed: every earlier layer runs the same program with less KV cache, so
the peak is in the last layer or after it (final norm and logits).

Per-element costs that decide long prompts (``sc = seqs x heads x q_len x k_len`` attention scores):

* eager: ``matmul * scaling`` (2 tensors of ``sc`` at 16-bit), ``+ mask``, then
  ``softmax(dtype=float32).to(dtype)``. PyTorch's ``softmax`` converts a bfloat16 input to float32 first (only
  float16 on CUDA takes the fused half-to-float path; aten/src/ATen/native/SoftMax.cpp), so bf16 peaks at
  2 + 4 + 4 = 10 B per score, fp16 at 2 + 4 + 2 = 8 B, fp32 at 4 + 4 = 8 B. The reference eager kernel is
  ``softmax_warp_forward<float, float, float>`` (profiled on an H200), which confirms the float32 input.
* SDPA flash-class kernels (flash, cuDNN, memory-efficient) and flash_attn FA2: the output plus a float32
  log-sum-exp of ``seqs x heads x q_len`` (no score matrix).
* SDPA math: q, k, v upcast to float32 and float32 scores and probabilities, 8 B per score.
* RMSNorm upcasts to float32: ``x.float()`` and ``x * rsqrt(var)`` are both alive, 8 B per hidden value.
* bitsandbytes 4-bit linears dequantize the whole weight to the compute dtype for more than
  :data:`BNB_4BIT_FUSED_MAX_ROWS` rows of input (``out x in x compute bytes``), but run
  the fused 4-bit kernel without dequantizing for up to that many (decode at batch 1 to 4).
  A compute dtype different from the activation dtype adds a cast copy of the input and of the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vramguard.memory.kv import kv_cache_bytes, kv_tensor_bytes
from vramguard.memory.tape import Tape
from vramguard.settings import DTYPE_BYTES, Settings
from vramguard.spec import ModelSpec

# bitsandbytes 0.50 ``gemm_4bit`` on CUDA (``bitsandbytes/backends/cuda/ops.py``: ``_GEMM_4BIT_CUSTOM_FLOOR_M``): up to
# this many rows of input the fused 4-bit kernel runs on every CUDA GPU and no weight is dequantized; above it a
# per-architecture rule picks the kernel or ``dequantize_4bit`` + ``linear`` (up to 1,536 rows), then always the
# latter, which the model assumes. H200 traces (benchmarks/README.md): no dequantized weight in batch-4 decode.
BNB_4BIT_FUSED_MAX_ROWS = 4


@dataclass(frozen=True)
class ForwardPeak:
    """Peak bytes of one forward above the weights, by component (``components`` sums to ``peak_bytes``)."""

    phase: str
    past_tokens: int
    chunk_tokens: int
    peak_bytes: int
    components: dict[str, int]
    at: str
    largest_alloc: int


def sdpa_runs_math(s: Settings) -> bool:
    """SDPA runs its math kernel (float32 scores): pinned to math, or float32 activations with a pinned flash or
    cuDNN kernel (both need 16-bit inputs). Otherwise a flash-class kernel runs (memory-efficient accepts float32
    and masks)."""
    return s.sdpa_kernel == "math" or (s.act_dtype == "fp32" and s.sdpa_kernel in ("flash", "cudnn"))


NORM_BYTES_PER_VALUE = 8  # float32 upcast + float32 normalized value, both alive inside RMSNorm


def logits_bytes(spec: ModelSpec, sequences: int, positions: int, act_dtype: str) -> tuple[int, int]:
    """(logits in the model dtype, their float32 copy) for ``positions`` per sequence, in bytes.

    ``sequences x positions x vocab_size x dtype bytes`` and ``... x 4``. generate() keeps one position
    (``logits_to_keep=1``) and copies it to float32; a forward over the prompt (scoring, ``output_logits``)
    keeps every position. Example (Llama-3-8B, 8,192 positions, bf16): 8,192 x 128,256 x 2 =
    2,101,346,304 B (1.957 GiB) plus 4,202,692,608 B (3.914 GiB) in float32.
    """
    n = sequences * positions * spec.vocab_size
    return n * DTYPE_BYTES[act_dtype], n * 4


def eager_bytes_per_score(act_dtype: str) -> int:
    """Peak bytes per attention score in eager attention (see the module docstring)."""
    return {"bf16": 10, "fp16": 8, "fp32": 8}[act_dtype]


class _Forward:
    """Replays one forward of ``chunk`` tokens after ``past`` cached tokens."""

    def __init__(self, spec: ModelSpec, s: Settings, past: int, chunk: int, phase: str):
        self.spec, self.s, self.past, self.chunk, self.phase = spec, s, past, chunk, phase
        self.t = Tape()
        self.sz = DTYPE_BYTES[s.act_dtype]
        self.cz = DTYPE_BYTES[s.resolved_compute_dtype]
        self.rows = s.sequences * chunk  # token rows entering every linear
        self.keys = (s.cache_len if s.cache == "static" else past + chunk)
        self.attn = s.effective_attn

    # ---- building blocks ---------------------------------------------------------------------------------
    def linear(self, name: str, fin: int, fout: int, out: str, label: str = "activations",
               quantized: bool = True) -> None:
        """A projection ``rows x fin -> rows x fout``, with the transient memory of its weight format."""
        t, s, rows = self.t, self.s, self.rows
        if not (s.is_bnb and quantized):
            t.alloc(out, rows * fout * self.sz, label)
            return
        if s.quant == "int8":  # int8 activations and an int32 product before the dequantized output
            t.alloc(out, rows * fout * self.sz, label)
            t.transient(name, dequant=rows * fin + rows * fout * 4)
            return
        cast_in = rows * fin * self.cz if self.cz != self.sz else 0
        if rows <= BNB_4BIT_FUSED_MAX_ROWS:  # bitsandbytes' fused 4-bit kernel: no dequantized weight
            t.alloc(out, rows * fout * self.sz, label)
            t.transient(name, dequant=cast_in + (rows * fout * self.cz if self.cz != self.sz else 0))
            return
        out_c = rows * fout * self.cz if self.cz != self.sz else 0
        t.alloc(out, rows * fout * self.sz, label)
        t.transient(name, dequant=cast_in + fout * fin * self.cz + out_c)

    def norm(self, at: str, out: str | None) -> None:
        self.t.transient(at, activations=self.rows * self.spec.hidden_size * NORM_BYTES_PER_VALUE)
        if out:
            self.t.alloc(out, self.rows * self.spec.hidden_size * self.sz, "activations")

    # ---- the forward -------------------------------------------------------------------------------------
    def run(self) -> ForwardPeak:
        spec, s, t = self.spec, self.s, self.t
        x = self.rows * spec.hidden_size * self.sz
        kv = kv_cache_bytes(spec, s, self.past + self.chunk, in_prefill_chunk=self.chunk)
        t.alloc("kv_cache", kv.gpu_bytes, "kv_cache", block=kv.largest_tensor_bytes)
        t.alloc("inputs_embeds", x, "activations")
        if spec.scaled_embeddings:
            t.alloc("scaled_embeds", x, "activations")
        t.alloc("cos_sin", 2 * s.sequences * self.chunk * spec.head_dim * self.sz, "activations")
        self.masks()
        if spec.num_layers > 1:
            t.alloc("hidden_in", x, "activations")
        self.layer(x)
        t.free("hidden_in")
        t.alloc("hidden_out", x, "activations")
        self.norm("final_norm", "final_hidden")
        t.free("hidden_out")
        self.logits()
        return ForwardPeak(self.phase, self.past, self.chunk, t.peak_bytes, t.peak_components, t.peak_at,
                           t.largest_alloc)

    def masks(self) -> None:
        spec, s = self.spec, self.s
        lt = set(spec.layer_types)
        window_binds = spec.sliding_window is not None and self.keys > spec.sliding_window
        if self.attn == "eager":
            n_masks = 2 if len(lt) > 1 else 1
            per = s.sequences * self.chunk * self.keys * self.sz
            self.t.alloc("mask", n_masks * per, "attention")
        elif self.needs_bool_mask(window_binds):
            self.t.alloc("mask", s.sequences * self.chunk * self.keys, "attention")

    def needs_bool_mask(self, window_binds: bool | None = None) -> bool:
        """SDPA gets an explicit mask, so no ``is_causal`` fast path and, for GQA, ``repeat_kv`` copies, whenever
        transformers cannot skip it (``masking_utils._ignore_causal_mask_sdpa``: only for one query token or for
        as many keys as queries): padding, a binding sliding window, a static cache (keys = its whole length), or a
        prefill chunk after the first (keys = past + chunk)."""
        s, spec = self.s, self.spec
        if self.attn == "flash_attention_2":
            return False
        if window_binds is None:
            window_binds = spec.sliding_window is not None and self.keys > spec.sliding_window
        return (s.padded or window_binds or s.cache == "static"
                or (self.past > 0 and self.chunk > 1))

    def layer(self, x: int) -> None:
        spec, s, t = self.spec, self.s, self.t
        nh, nkv, d, h = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
        q = self.rows * nh * d * self.sz
        k = self.rows * nkv * d * self.sz
        self.norm("input_layernorm", "x_norm")
        if spec.fused_qkv:
            self.linear("qkv_proj", h, (nh + 2 * nkv) * d, "qkv")
        else:
            self.linear("q_proj", h, nh * d, "q")
            self.linear("k_proj", h, nkv * d, "k")
            self.linear("v_proj", h, nkv * d, "v")
        for name, size in (("q", q), ("k", k)):  # apply_rotary_pos_emb: x*cos + rotate_half(x)*sin
            t.alloc(f"{name}_cos", size, "activations")
            t.transient(f"rotate_half_{name}", activations=size // 2)
            t.alloc(f"{name}_rot", size, "activations")
            t.alloc(f"{name}_sin", size, "activations")
            t.free(f"{name}_rot")
            t.alloc(f"{name}_embed", size, "activations")
            t.free(f"{name}_cos", f"{name}_sin")
        t.free("q", "k")
        if self.past and s.resolved_kv_dtype in ("int8", "int4"):
            # QuantizedLayer.update: dequantized K and V plus the concatenations returned to attention
            full = kv_tensor_bytes(spec, s, self.past + self.chunk, kv_dtype=s.act_dtype)
            t.transient("quantized_cache_update", kv_cache=4 * full)
        elif self.past and s.cache == "dynamic":  # torch.cat([past, new]) while the old tensor is alive
            t.transient("cache_update", kv_cache=kv_tensor_bytes(spec, s, self.past))
        t.free("k_embed", "v")  # a fused qkv output stays alive: ``qkv`` is a local of the attention forward
        self.attention(q)
        self.linear("o_proj", nh * d, h, "o")
        t.free("attn_out", "q_embed", "x_norm", "qkv")
        if not s.output_attentions:
            t.free("attn_weights")
        if spec.norms_per_layer == 4:
            self.norm("post_attention_layernorm", None)
        t.alloc("h2", x, "activations")
        t.free("o")
        self.norm("post_attention_layernorm" if spec.norms_per_layer == 2 else "pre_feedforward_layernorm", "x2")
        self.mlp(x)
        t.free("x2")
        if spec.norms_per_layer == 4:
            self.norm("post_feedforward_layernorm", None)
        t.alloc("h3", x, "activations")
        t.free("mlp_out", "h2")
        t.free("h3")

    def attention(self, q: int) -> None:
        spec, s, t = self.spec, self.s, self.t
        seqs, nh, d = s.sequences, spec.num_heads, spec.head_dim
        scores = seqs * nh * self.chunk * self.keys
        repeat = 2 * seqs * nh * self.keys * d * self.sz if spec.gqa_groups > 1 else 0
        if self.attn == "eager":
            if s.output_attentions:  # every earlier layer's map is kept in the output
                t.alloc("retained_attentions", (spec.num_layers - 1) * scores * self.sz, "attention",
                        block=scores * self.sz)
            t.alloc("repeat_kv", repeat, "attention")
            t.alloc("scores_matmul", scores * self.sz, "attention")
            t.alloc("scores_scaled", scores * self.sz, "attention")
            t.free("scores_matmul")
            t.alloc("scores_masked", scores * self.sz, "attention")
            t.free("scores_scaled")
            if spec.attn_logit_softcapping:
                t.alloc("scores_capped", scores * self.sz, "attention")
                t.free("scores_masked")
                t.alloc("scores_masked", scores * self.sz, "attention")
                t.free("scores_capped")
            if s.act_dtype == "bf16":
                t.alloc("softmax_in_fp32", scores * 4, "attention")
            t.alloc("softmax_fp32", scores * 4, "attention")
            t.free("softmax_in_fp32")
            if s.act_dtype != "fp32":
                t.alloc("attn_weights", scores * self.sz, "attention")
                t.free("softmax_fp32")
            else:
                t.live["attn_weights"] = t.live.pop("softmax_fp32")
            t.free("scores_masked")
            t.alloc("attn_matmul_out", q, "activations")
            t.free("repeat_kv")
            t.alloc("attn_out", q, "activations")
            t.free("attn_matmul_out")
            return
        lse = seqs * nh * self.chunk * 4
        if self.attn == "flash_attention_2":
            t.alloc("attn_out", q, "activations")
            t.transient("flash_attn_lse", attention=lse)
            return
        masked = self.needs_bool_mask()
        if spec.gqa_groups > 1 and masked:  # use_gqa_in_sdpa needs mask None (transformers 5.17)
            t.alloc("repeat_kv", repeat, "attention")
        t.alloc("sdpa_out", q, "activations")
        if sdpa_runs_math(s):
            qkv32 = (seqs * self.chunk * nh * d + 2 * seqs * self.keys * nh * d) * 4
            t.transient("sdpa_math", attention=qkv32 + scores * 8)
        else:
            t.transient("sdpa_flash_lse", attention=lse)
        t.free("repeat_kv")
        t.alloc("attn_out", q, "activations")  # transpose(1, 2).contiguous()
        t.free("sdpa_out")

    def mlp(self, x: int) -> None:
        spec, t = self.spec, self.t
        h, rows = spec.hidden_size, self.rows
        if spec.is_moe:
            self.moe(x)
            return
        inter = rows * spec.intermediate_size * self.sz
        if spec.fused_gate_up:
            self.linear("gate_up_proj", h, 2 * spec.intermediate_size, "gate_up")
            t.alloc("act", inter, "activations")
            t.alloc("prod", inter, "activations")
            t.free("act")
            self.linear("down_proj", spec.intermediate_size, h, "mlp_out")
            t.free("prod", "gate_up")
            return
        self.linear("gate_proj", h, spec.intermediate_size, "gate")
        t.alloc("act", inter, "activations")
        t.free("gate")
        self.linear("up_proj", h, spec.intermediate_size, "up")
        t.alloc("prod", inter, "activations")
        t.free("act", "up")
        self.linear("down_proj", spec.intermediate_size, h, "mlp_out")
        t.free("prod")

    def moe(self, x: int) -> None:
        """Sparse MoE block of transformers 5 (``MixtralExperts``): a loop over the experts that were hit.

        The busiest expert is taken to receive twice its even share of the ``rows x top_k`` assignments
        (capped at ``rows``): routing is uneven and the plan must hold for the busy one.
        """
        spec, t, rows = self.spec, self.t, self.rows
        e, k, inter, h = spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.hidden_size
        t.alloc("router_logits", rows * e * self.sz, "activations")
        t.transient("router_softmax", activations=rows * e * 4 * 2)
        t.alloc("final_hidden", x, "activations")
        t.alloc("expert_mask", rows * k * (e + 1) * 8, "activations")
        n_e = min(rows, -(-2 * rows * k // e))
        # transformers 5's fused experts are not quantized by bitsandbytes: no dequantized copy
        t.transient("expert", activations=n_e * (h + 4 * inter + h) * self.sz)
        if spec.shared_expert_intermediate_size:
            t.transient("shared_expert", activations=rows * 4 * spec.shared_expert_intermediate_size * self.sz)
        t.free("expert_mask")
        t.live["mlp_out"] = t.live.pop("final_hidden")

    def logits(self) -> None:
        spec, s, t = self.spec, self.s, self.t
        positions = self.chunk if s.logits == "all" else 1
        native, fp32 = logits_bytes(spec, s.sequences, positions, s.act_dtype)
        t.alloc("logits", native, "logits")
        if spec.final_logit_softcapping:
            t.transient("logit_softcap", logits=2 * native)
        t.alloc("logits_fp32", fp32, "logits")  # generate's .to(float32) copy / a scoring upcast


def forward_peak(spec: ModelSpec, s: Settings, past: int, chunk: int, phase: str = "prefill") -> ForwardPeak:
    """Peak bytes above the weights of one forward of ``chunk`` tokens per sequence after ``past`` cached ones.

    Raises nothing for valid inputs; ``past >= 0``, ``chunk >= 1``.
    """
    return _Forward(spec, s, past, chunk, phase).run()


def inputs_bytes(spec: ModelSpec, s: Settings, past: int, chunk: int, hidden: int) -> int:
    """The tensors of a forward's start that stay alive to its end, as :class:`_Forward` replays them: the
    embeddings' output of ``hidden`` bytes (and its scaled copy), the rotary cos/sin and the attention masks."""
    r = _Forward(spec, s, past, chunk, "prefill")
    r.masks()
    embeds = hidden * (2 if spec.scaled_embeddings else 1)
    return embeds + 2 * s.sequences * chunk * spec.head_dim * DTYPE_BYTES[s.act_dtype] + r.t.live_bytes


def prefill_peak(spec: ModelSpec, s: Settings, peak_of: Callable[..., ForwardPeak] | None = None) -> ForwardPeak:
    """Peak of the prefill: the whole prompt in one forward, or chunk by chunk with ``s.prefill_chunk``.

    With chunks, the peak is in the last full-size chunk or in the final partial one (the KV cache only grows).
    ``peak_of(s, past, chunk, phase)``: the peak of one forward (default: the hand model's, :func:`forward_peak`;
    a :class:`~vramguard.memory.model.MemoryModel` passes its own).
    """
    peak = peak_of or (lambda s_, past, chunk, phase: forward_peak(spec, s_, past, chunk, phase))
    p = s.prompt_tokens
    c = s.prefill_chunk
    if not c or c >= p:
        return peak(s, 0, p, "prefill")
    n_full, rest = divmod(p, c)
    cands = [peak(s, (n_full - 1) * c, c, "prefill")]
    if rest:
        cands.append(peak(s, n_full * c, rest, "prefill"))
    return max(cands, key=lambda f: f.peak_bytes)


def decode_peak(spec: ModelSpec, s: Settings, peak_of: Callable[..., ForwardPeak] | None = None) -> ForwardPeak | None:
    """Peak of the last decode step (the cache at its longest), or ``None`` when at most one token is generated
    (``peak_of`` as for :func:`prefill_peak`).

    The last forward of ``generate`` runs with ``prompt + new - 2`` cached tokens and adds one: the token it
    samples is never fed back.
    """
    if s.max_new_tokens <= 1:
        return None
    peak = peak_of or (lambda s_, past, chunk, phase: forward_peak(spec, s_, past, chunk, phase))
    return peak(s, s.prompt_tokens + s.max_new_tokens - 2, 1, "decode")
