"""Settings of one inference run: quantization, attention, KV cache, batch and lengths.

Names follow transformers / bitsandbytes: ``quant`` is the weight format (``nf4``, ``fp4``: 4-bit
bitsandbytes; ``int8``: LLM.int8; ``bf16``/``fp16``/``fp32``: no quantization), ``compute_dtype`` is
``bnb_4bit_compute_dtype``, ``dtype`` is the ``dtype`` (``torch_dtype``) passed to ``from_pretrained`` and so the
dtype of activations and of every module left unquantized.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from vramguard.dtypes import BYTES, TORCH_NAMES
from vramguard.errors import InvalidValue

QUANTS = ("nf4", "fp4", "int8", "bf16", "fp16", "fp32")
DTYPES = ("bf16", "fp16", "fp32")
ATTNS = ("eager", "sdpa", "flash_attention_2")
SDPA_KERNELS = ("auto", "flash", "cudnn", "efficient", "math")
# the path of a mixer with a package kernel (Mamba scans, causal convolutions, gated delta rules): what transformers
# binds where the plan runs, the package kernels, or the reference PyTorch functions (vramguard.introspect.mixers)
KERNELS = ("installed", "fast", "torch")
KV_DTYPES = ("bf16", "fp16", "int8", "int4")
CACHES = ("dynamic", "static", "offloaded")
LOGITS = ("last", "all")
DTYPE_BYTES = BYTES  # bytes per element by short name (vramguard.dtypes holds the one table)
TORCH_DTYPE_NAMES = {d: TORCH_NAMES[d] for d in DTYPES}  # the settings' float dtypes -> torch.<name>
_SHORT_DTYPES = {v: k for k, v in TORCH_DTYPE_NAMES.items()} | {"float": "fp32", "half": "fp16"}
KV_BITS = {"bf16": 16, "fp16": 16, "int8": 8, "int4": 4}


def short_dtype(dtype: object) -> str | None:
    """The short name (``bf16``, ``fp16``, ``fp32``) of a torch dtype or its name (``torch.bfloat16``,
    ``"bfloat16"``, ``"torch.float16"``, ``"half"``, or a short name itself); None for any other dtype or None."""
    if dtype is None:
        return None
    name = str(dtype).removeprefix("torch.")
    return name if name in TORCH_DTYPE_NAMES else _SHORT_DTYPES.get(name)


def _choice(field: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise InvalidValue(field, value, " | ".join(choices), f"use one of: {', '.join(choices)}")


def require_bool(field: str, value: object, fix: str | None = None) -> None:
    """Raise InvalidValue unless ``value`` is a bool: a string such as ``"false"`` is truthy, and 0, 1 or None would
    be taken as a choice the caller did not spell out; ``fix`` defaults to asking for True or False."""
    if not isinstance(value, bool):
        raise InvalidValue(field, value, "True or False", fix or f"pass {field}=True or {field}=False")


def require_settings(settings: object) -> None:
    """Raise InvalidValue unless ``settings`` is a :class:`Settings` or None (a dict or a str is not read)."""
    if settings is not None and not isinstance(settings, Settings):
        raise InvalidValue("settings", settings, f"a Settings or None, not type {type(settings).__name__}",
                           "pass settings=Settings(...) (vramguard.Settings), e.g. Settings(batch=2)")


BOOL_FIELDS = ("double_quant", "padded", "output_attentions", "do_sample")  # the Settings fields that are switches

MAX_TOKENS = 2**31 - 1  # positions and lengths are int32 in attention kernels and masks
MAX_SEQUENCES = 2**20  # batch x beams beyond this is no inference run (and overflows a plan's tensor sizes)


def require_count(field: str, value: object, minimum: int, fix: str | None = None,
                  maximum: int | None = None) -> None:
    """Raise InvalidValue unless ``value`` is an int (not a bool) >= ``minimum`` (and <= ``maximum`` when given);
    ``fix`` defaults to asking for a whole number in that range."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidValue(field, value, f"an integer >= {minimum}" + (f" and <= {maximum:,}" if maximum else ""),
                           fix or f"pass a whole number of at least {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidValue(field, value, f"an integer from {minimum} to {maximum:,}",
                           f"pass a whole number of at most {maximum:,}")


@dataclass(frozen=True)
class Settings:
    """One run's settings. Counts are tokens or sequences; nothing here is in bytes.

    Attributes:
        quant: weight format, one of :data:`QUANTS`.
        double_quant: bitsandbytes ``bnb_4bit_use_double_quant`` (4-bit only).
        compute_dtype: ``bnb_4bit_compute_dtype`` (4-bit only); ``None`` means equal to ``dtype``.
        dtype: model dtype (activations, unquantized modules); ``None`` means bf16, or the quant's own dtype
            for ``fp16``/``fp32``.
        attn: ``attn_implementation``: eager, sdpa or flash_attention_2.
        sdpa_kernel: SDPA backend when attn is sdpa: ``auto`` (flash-class when the inputs allow) or a pinned one.
        kernels: the path of mixers with a package kernel (:data:`KERNELS`): ``installed``, what transformers binds
            in this process (``mamba_ssm``, ``causal_conv1d``, ``fla`` where they import); ``fast``, those packages'
            kernels (installed on the target machine); ``torch``, transformers' reference PyTorch functions.
            ``None``: ``installed`` where the plan is for this machine's GPU, else both paths, the larger taken.
        kv_dtype: KV cache element type; int8/int4 mean transformers' QuantizedCache (``None`` = ``dtype``).
        kv_group_size, kv_residual_length: QuantizedCache ``q_group_size`` and ``residual_length``.
        cache: ``dynamic`` (grows by concatenation), ``static`` (preallocated to ``max_cache_len``) or
            ``offloaded`` (layers kept in CPU RAM, one prefetched at a time).
        max_cache_len: static cache length in tokens (``None`` = prompt + new tokens).
        batch, num_beams, num_return_sequences: sequences decoded together = batch x max(beams, return seqs).
        prompt_tokens, max_new_tokens: lengths in tokens.
        prefill_chunk: tokens per prefill forward (``prefill_chunk_size``); ``None`` = whole prompt at once.
        logits: ``last`` (generate keeps only the last position) or ``all`` (a forward/scoring over the prompt).
        padded: the batch has prompts of different lengths, so a mask is materialized for SDPA.
        output_attentions: attention maps are returned, which needs eager attention and keeps every layer's map.
        do_sample: sampling instead of greedy decoding (needed for num_return_sequences > 1 without beams).
    """

    quant: str = "nf4"
    double_quant: bool = True
    compute_dtype: str | None = None
    dtype: str | None = None
    attn: str = "sdpa"
    sdpa_kernel: str = "auto"
    kernels: str | None = None
    kv_dtype: str | None = None
    kv_group_size: int = 64
    kv_residual_length: int = 128
    cache: str = "dynamic"
    max_cache_len: int | None = None
    batch: int = 1
    num_beams: int = 1
    num_return_sequences: int = 1
    prompt_tokens: int = 128
    max_new_tokens: int = 256
    prefill_chunk: int | None = None
    logits: str = "last"
    padded: bool = False
    output_attentions: bool = False
    do_sample: bool = False

    def __post_init__(self) -> None:
        for field in BOOL_FIELDS:
            require_bool(field, getattr(self, field))
        _choice("quant", self.quant, QUANTS)
        _choice("attn", self.attn, ATTNS)
        _choice("sdpa_kernel", self.sdpa_kernel, SDPA_KERNELS)
        if self.kernels is not None:
            _choice("kernels", self.kernels, KERNELS)
        _choice("cache", self.cache, CACHES)
        _choice("logits", self.logits, LOGITS)
        if self.dtype is not None:
            _choice("dtype", self.dtype, DTYPES)
        if self.compute_dtype is not None:
            _choice("compute_dtype", self.compute_dtype, DTYPES)
        if self.kv_dtype is not None:
            _choice("kv_dtype", self.kv_dtype, KV_DTYPES)
        require_count("batch", self.batch, 1, maximum=MAX_SEQUENCES)
        require_count("num_beams", self.num_beams, 1, maximum=MAX_SEQUENCES)
        require_count("num_return_sequences", self.num_return_sequences, 1, maximum=MAX_SEQUENCES)
        if self.sequences > MAX_SEQUENCES:
            raise InvalidValue("batch", self.batch, f"batch x beams (or return sequences) at most {MAX_SEQUENCES:,}",
                               "decode fewer sequences at once")
        if self.num_beams > 1 and self.num_return_sequences > self.num_beams:
            raise InvalidValue("num_return_sequences", self.num_return_sequences,
                               f"at most num_beams={self.num_beams} with beam search")
        if self.num_return_sequences > 1 and self.num_beams == 1 and not self.do_sample:
            raise InvalidValue("num_return_sequences", self.num_return_sequences, "1 with greedy decoding",
                               "sample (do_sample) or use beam search (num_beams >= num_return_sequences)")
        if self.kv_dtype in ("int8", "int4") and self.cache != "dynamic":
            raise InvalidValue("kv_dtype", self.kv_dtype, f"bf16 or fp16 with a {self.cache} cache",
                               "transformers' quantized KV cache is a cache of its own: use cache=dynamic")
        if self.compute_dtype is not None and self.quant not in ("nf4", "fp4"):
            raise InvalidValue("compute_dtype", self.compute_dtype, f"unset with quant={self.quant}",
                               "the compute dtype applies to 4-bit weights only (nf4, fp4)")
        require_count("prompt_tokens", self.prompt_tokens, 1, maximum=MAX_TOKENS)
        require_count("max_new_tokens", self.max_new_tokens, 0, maximum=MAX_TOKENS)
        require_count("kv_group_size", self.kv_group_size, 1)
        require_count("kv_residual_length", self.kv_residual_length, 0)
        if self.prefill_chunk is not None:
            require_count("prefill_chunk", self.prefill_chunk, 1, maximum=MAX_TOKENS)
        if self.max_cache_len is not None:
            require_count("max_cache_len", self.max_cache_len, self.prompt_tokens + self.max_new_tokens,
                   "a static cache must hold the prompt and the new tokens")

    # ---- resolved values -------------------------------------------------------------------------------------
    @property
    def act_dtype(self) -> str:
        """dtype of activations and unquantized modules."""
        if self.dtype:
            return self.dtype
        return self.quant if self.quant in ("fp16", "fp32") else "bf16"

    @property
    def effective_attn(self) -> str:
        """The attention that runs: eager whenever attention maps are requested."""
        return "eager" if self.output_attentions else self.attn

    @property
    def weight_dtype(self) -> str:
        """dtype of linear weights that are not quantized (``quant`` for bf16/fp16/fp32, else ``act_dtype``)."""
        return self.quant if self.quant in DTYPES else self.act_dtype

    @property
    def resolved_compute_dtype(self) -> str:
        return self.compute_dtype or self.act_dtype

    @property
    def resolved_kv_dtype(self) -> str:
        return self.kv_dtype or (self.act_dtype if self.act_dtype != "fp32" else "fp32")

    @property
    def is_bnb(self) -> bool:
        return self.quant in ("nf4", "fp4", "int8")

    @property
    def is_4bit(self) -> bool:
        return self.quant in ("nf4", "fp4")

    @property
    def sequences(self) -> int:
        """Sequences decoded together: ``batch x num_beams`` (beam search) or ``batch x num_return_sequences``."""
        return self.batch * (self.num_beams if self.num_beams > 1 else self.num_return_sequences)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_new_tokens

    @property
    def cache_len(self) -> int:
        """Tokens the KV cache holds at its largest (static: its preallocated length)."""
        if self.cache == "static":
            return self.max_cache_len or self.total_tokens
        return self.total_tokens

    def with_(self, **changes) -> "Settings":
        """A copy with ``changes`` applied (validated again)."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(resolved_dtype=self.act_dtype, resolved_compute_dtype=self.resolved_compute_dtype,
                 resolved_kv_dtype=self.resolved_kv_dtype, sequences=self.sequences)
        return d
