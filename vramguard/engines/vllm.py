"""vLLM's own memory model (V1 engine): the flags to set, and the KV cache tokens and concurrency vLLM will log.

Knows nothing about serving: a pure function of a :class:`~vramguard.spec.ModelSpec`, the engine settings and a
card; no torch, no vLLM. The version read is vLLM 0.33.0 (the source in its PyPI wheel); the same terms stand in
vllm-project/vllm main at commit 35d5cda1 (an earlier V1) except where noted. Each term, with the file and function:

* budget: ``requested_memory = total x gpu_memory_utilization``; vLLM refuses to start when the free memory it
  measures after the CUDA context and the distributed init is below it ("Free memory on device ... on startup is
  less than desired GPU memory utilization": ``vllm/v1/worker/utils.py``, called from ``gpu_worker.py::Worker.
  init_device``).
* KV bytes: ``requested_memory - non_kv_cache_memory - cudagraph_estimate`` (``gpu_worker.py::Worker.
  determine_available_memory``); ``non_kv_cache_memory`` (``vllm/utils/mem_utils.py::memory_profiling``) is the
  free memory consumed since the start snapshot (the weights as loaded, memory outside torch that appeared: kernels
  loaded on first use) plus the transient peak of ``torch`` allocated bytes during
  ``GPUModelRunner.profile_run``: a forward of ``max_num_batched_tokens`` tokens split over
  ``min(max_num_seqs, max_num_batched_tokens)`` requests, then ``_dummy_sampler_run`` on their logits with
  ``top_k`` and ``top_p`` set (the top-k/top-p path: :attr:`VllmSettings.sampler`).
* NCCL at TP/PP >= 2: 0.33.0's ``Worker.init_device`` runs ``init_worker_distributed_environment`` (NCCL
  communicators, their warm-up all-reduce, the custom all-reduce buffers) *before* the start snapshot, "so NCCL
  buffers are allocated before we measure available memory": they lower the free memory of the start check and are
  not subtracted from the KV cache. Earlier V1 releases (commit 0012cf69) took the free memory before the
  distributed init, so the buffers landed in the non-torch term and came out of the KV cache:
  :attr:`VllmSettings.nccl_in_budget` True.
* CUDA graphs: ``GPUModelRunner.profile_cudagraph_memory`` captures the largest graph and one more per mode and
  estimates ``first capture + (n - 1) x max(second capture, 1 MiB)``; subtracted from the budget while
  ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS`` is 1 (the default since v0.21). At 35d5cda1 graphs were captured
  after the KV cache, outside the budget: :attr:`VllmSettings.cudagraph_in_budget` False.
* blocks, tokens and concurrency: :mod:`vramguard.engines.vllm_kv`; weights and activations:
  :mod:`vramguard.engines.vllm_weights`; quantized storage: :mod:`vramguard.engines.vllm_quant`; the model vLLM
  builds (gpt-oss, DeepSeek MLA, multimodal checkpoints): :mod:`vramguard.engines.vllm_arch`; what changed between
  releases: :mod:`vramguard.engines.vllm_versions` (:func:`settings_for_version`).
* defaults of ``max_num_batched_tokens`` / ``max_num_seqs`` for ``vllm serve``
  (``vllm/engine/arg_utils.py::EngineArgs.get_batch_defaults``): 16,384 / 1,024 on cards of at least 160 GiB;
  8,192 / 1,024 from 70 GiB except A100s; else 2,048 / 256.

Hand-modelled terms, not read from a trace (their error against published logs is in benchmarks/README.md): the
activation peak, the non-torch increase (:data:`NON_TORCH_BYTES`), NCCL's buffers (:data:`NCCL_BYTES`) and the CUDA
graph pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vramguard.catalog.gpus import GPUS, GpuSpec
from vramguard.dtypes import TORCH_BYTES
from vramguard.engines import vllm_kv as kv
from vramguard.engines import vllm_weights as w
from vramguard.engines.vllm_arch import VLLM_FAMILIES, VllmModel, vllm_model
from vramguard.engines.vllm_quant import AT_LOAD, refused_quantization
from vramguard.engines.vllm_versions import NCCL_BYTES, rules_for
from vramguard.errors import ConfigError, InvalidValue
from vramguard.memory.model import MemoryModel
from vramguard.memory.runtime import CUDA_CONTEXT_BYTES
from vramguard.plan.choice import choose
from vramguard.settings import TORCH_DTYPE_NAMES
from vramguard.spec import ModelSpec
from vramguard.units import GiB, MiB

DTYPES = ("auto", "bfloat16", "float16", "float32")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")

# memory outside torch that appears during the profile run at TP=1 (kernel images loaded on first use: FlashAttention,
# Inductor's Triton kernels; 0.33.0 creates the cuBLAS/cuBLASLt handles before its start snapshot, and the CUDA
# context is in it); vLLM logged 0.13-0.14 GiB on H100 (V1, llm-d-benchmark) and 0.25-0.35 GiB in V0 logs: the plan
# keeps 0.25 GiB, between the two
NON_TORCH_BYTES = 256 * MiB
# the same term as V0 (releases before 0.8) logged it: "non_torch_memory=0.35GiB" for Llama-3.1-8B on an RTX 3090
# (vLLM's V0 memory profiling line, github.com/vllm-project/vllm/issues/10517, at 20,000 and 29,000 tokens)
NON_TORCH_V0_BYTES = 358 * MiB
# CUDA graph estimate: the first (largest) capture, modelled as the forward peak at the largest capture size, plus
# at least 1 MiB per further graph (profile_cudagraph_memory's floor), for each of the two modes of the default
# FULL_AND_PIECEWISE cudagraph mode
CUDAGRAPH_BYTES_PER_GRAPH = 1 * MiB
CUDAGRAPH_MODES = 2
MAX_CAPTURE_SIZE = 512  # vllm/config/vllm.py: max_cudagraph_capture_size = min(max_num_seqs x 2, 512)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py: LoRAConfig's possible max_lora_rank


@dataclass(frozen=True)
class VllmSettings:
    """vLLM engine arguments that change memory (the names of ``vllm/engine/arg_utils.py::EngineArgs``).

    Attributes:
        tensor_parallel_size, pipeline_parallel_size: GPUs per stage and stages.
        gpu_memory_utilization: the fraction of each GPU's total vLLM may use (0 < u <= 1).
        max_model_len: tokens per request (prompt + output); ``None``: the model's ``max_position_embeddings``.
        kv_cache_dtype: ``auto`` (the model dtype) or an fp8 kind (1 byte).
        max_num_seqs, max_num_batched_tokens: ``None``: vLLM's defaults for the card.
        block_size: tokens per KV block (16).
        dtype: ``auto`` (the checkpoint's; float32 checkpoints run in bfloat16, float16 below compute 8.0).
        enforce_eager: no CUDA graphs.
        cudagraph_in_budget: the CUDA graph estimate is subtracted from the budget (vLLM >= 0.21's default;
            False for older versions, or with ``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS=0``).
        hybrid_kv_cache_manager: False is ``disable_hybrid_kv_cache_manager`` (sliding layers kept whole).
        kv_offloading_size_bytes: host memory for KV offloaded to the CPU (``kv_offloading_size``), 0 = none.
        sampler: the top-k/top-p path of the dummy sampler run (:data:`~vramguard.engines.vllm_weights.
            SAMPLER_BYTES_PER_LOGIT`): ``triton`` (0.33.0), ``sort`` (V1 before the Triton kernel), ``flashinfer``
            (0.10 with FlashInfer's sampler).
        nccl_in_budget: NCCL's buffers come out of the KV cache (V1 before the distributed init moved ahead of the
            start snapshot); False (0.33.0): they only lower the free memory at start.
        allow_long_max_model_len: ``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` is set: vLLM accepts a ``max_model_len``
            above the model's ``max_position_embeddings`` (``vllm/config/model.py::_get_and_verify_max_len``
            raises otherwise).
        engine: ``v1``, or ``v0`` (releases before 0.8: one prefill of ``max(max_model_len, 2048)`` tokens over
            256 sequences profiled, "# GPU blocks" logged).
        tokens_by_blocks: "GPU KV cache size" is ``blocks // groups x block_size`` (releases before 0.20).
        large_card_tier: the 16,384-token batch default from 160 GiB (releases from 0.20).
        quantization: ``bitsandbytes``: vLLM's ``--quantization bitsandbytes``, 4-bit NF4 applied at load to an
            unquantized checkpoint; ``fp8``: ``--quantization fp8``, FP8 weights with one scale per tensor made at
            load (a pre-quantized checkpoint's own format is read from its config.json).
        enable_lora, max_lora_rank, max_loras: LoRA slots vLLM allocates at start
            (:func:`~vramguard.engines.vllm_weights.lora_layer_bytes`).
        tp_comm_bytes: NCCL and all-reduce buffers at tensor parallel size >= 2 (:data:`~vramguard.engines.
            vllm_versions.NCCL_BYTES`; vLLM 0.19's all-reduce fusion workspace: ``TP_COMM_BYTES_0_19``); pipeline
            parallelism alone takes ``NCCL_BYTES``.
        mxfp4_hopper_backend: MXFP4 MoE kernel on compute capability 9.x: ``triton`` (Triton's kernels installed),
            or ``marlin`` (vLLM 0.10's PyPI install, without them; ``mxfp4.py::_should_use_marlin``).
        vllm_version: the release these rules were chosen for (:func:`settings_for_version`); None: as set.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    dtype: str = "auto"
    enforce_eager: bool = False
    cudagraph_in_budget: bool = True
    hybrid_kv_cache_manager: bool = True
    kv_offloading_size_bytes: int = 0
    sampler: str = "triton"
    nccl_in_budget: bool = False
    allow_long_max_model_len: bool = False
    engine: str = "v1"
    tokens_by_blocks: bool = False
    large_card_tier: bool = True
    quantization: str | None = None
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_loras: int = 1
    mxfp4_hopper_backend: str = "triton"
    tp_comm_bytes: int = NCCL_BYTES
    vllm_version: str | None = None

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1024:
                raise InvalidValue(name, v, "an integer from 1 to 1,024", f"set {name} to a positive integer")
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
            raise InvalidValue("gpu_memory_utilization", u, "a fraction above 0 and at most 1",
                               "set gpu_memory_utilization=0.9 (vLLM's default) or another fraction")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**31):
                raise InvalidValue(name, v, "a positive integer of at most 2**31", f"set {name} or leave it unset")
        if self.dtype not in DTYPES:
            raise InvalidValue("dtype", self.dtype, ", ".join(DTYPES), "pick one of them")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidValue("kv_cache_dtype", self.kv_cache_dtype, ", ".join(KV_CACHE_DTYPES), "pick one of them")
        if self.sampler not in w.SAMPLER_BYTES_PER_LOGIT:
            raise InvalidValue("sampler", self.sampler, ", ".join(w.SAMPLER_BYTES_PER_LOGIT), "pick one of them")
        if self.kv_offloading_size_bytes < 0:
            raise InvalidValue("kv_offloading_size_bytes", self.kv_offloading_size_bytes, "0 or more", "set 0")
        self._check_lora_and_quantization()

    def _check_lora_and_quantization(self) -> None:
        if self.quantization is not None and self.quantization not in AT_LOAD:
            raise refused_quantization(self.quantization)
        if self.engine not in ("v0", "v1"):
            raise InvalidValue("engine", self.engine, "v0 or v1", "pick one of them")
        if self.max_lora_rank not in LORA_RANKS:
            raise InvalidValue("max_lora_rank", self.max_lora_rank, ", ".join(map(str, LORA_RANKS)),
                               "pick one of vLLM's ranks (vllm/config/lora.py)")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or not 1 <= self.max_loras <= 1024:
            raise InvalidValue("max_loras", self.max_loras, "an integer from 1 to 1,024", "set max_loras=1")


@dataclass(frozen=True)
class VllmPlan:
    """What vLLM will do on ``gpu`` with ``settings`` (sizes in bytes, per worker: one GPU).

    ``available_kv_bytes = requested_bytes - weights_bytes - activation_bytes - non_torch_bytes
    - (nccl_bytes if settings.nccl_in_budget) - (cudagraph_bytes if settings.cudagraph_in_budget)``
    for the pipeline stage with the fewest blocks (its weights are ``weights_bytes``; every stage's in
    ``weights_by_stage``); ``free_at_start_bytes`` has ``nccl_bytes`` taken off when not ``nccl_in_budget``.
    ``kv_tokens`` and ``max_concurrency`` are the two startup log lines (``kv_tokens_by_blocks``: the tokens line of
    V1 releases before 0.33). ``refusal`` is the error vLLM would stop with (None when it starts); ``refused_by``
    its kind: ``max_model_len_limit`` (above the model's positions without ``VLLM_ALLOW_LONG_MAX_MODEL_LEN``),
    ``free_memory`` (less free than the budget at start), ``weights_load`` (the weights per GPU exceed the free
    memory: an out-of-memory while loading), ``weights_budget`` (the weights alone exceed the budget),
    ``kv_cache`` (nothing left for KV blocks) or ``max_model_len`` (one request does not fit the KV cache).
    ``lora_bytes`` / ``vision_bytes``: the LoRA slots and the vision encoder inside ``weights_bytes`` (the vision
    encoder on the first stage); ``encoder_peak_bytes``: the vision encoder's profile run; ``weight_format``: the
    checkpoint's quantization as vLLM stores it. ``fit_tp`` / ``fit_card``: for the memory refusals, the plan at the
    smallest valid tensor parallel size and on the smallest catalog card with room for the KV cache (None when none
    does). ``checkpoint_bytes``: the whole checkpoint the workers read (its safetensors' stored bytes when they were
    read, else the weights of one GPU at tensor and pipeline parallel 1 less the rope cache vLLM builds on the GPU).
    """

    model: str
    gpu: GpuSpec
    settings: VllmSettings
    dtype: str
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    total_bytes: int
    requested_bytes: int
    free_at_start_bytes: int
    weights_bytes: int
    weights_by_stage: tuple[int, ...]
    activation_bytes: int
    forward_peak_bytes: int
    sampler_peak_bytes: int
    non_torch_bytes: int
    nccl_bytes: int
    cudagraph_bytes: int
    available_kv_bytes: int
    kv_groups: tuple[kv.KvGroup, ...]
    padding_layers: int
    num_blocks: int
    kv_tokens: int
    kv_tokens_by_blocks: int
    max_concurrency: float
    request_kv_bytes: int
    largest_model_len: int
    refusal: str | None
    notes: tuple[str, ...] = field(default=())
    refused_by: str | None = None
    model_max_len: int = 0
    fit_tp: VllmPlan | None = None
    fit_card: VllmPlan | None = None
    checkpoint_bytes: int = 0
    encoder_peak_bytes: int = 0
    lora_bytes: int = 0
    vision_bytes: int = 0
    weight_format: str = "none"

    @property
    def starts(self) -> bool:
        return self.refusal is None

    def env(self) -> dict[str, str]:
        """The environment variables ``vllm serve`` needs for these flags (``VLLM_ALLOW_LONG_MAX_MODEL_LEN=1`` for
        a ``max_model_len`` above the model's, when the settings allow it)."""
        long = self.model_max_len and self.max_model_len > self.model_max_len
        return {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1"} if long and self.settings.allow_long_max_model_len else {}

    def flags(self) -> dict[str, object]:
        """The engine arguments to pass (``vllm serve`` names without ``--``), every one that sets memory."""
        s = self.settings
        out: dict[str, object] = {"tensor-parallel-size": s.tensor_parallel_size}
        if s.pipeline_parallel_size > 1:
            out["pipeline-parallel-size"] = s.pipeline_parallel_size
        out.update({"dtype": self.dtype, "max-model-len": self.max_model_len,
                    "gpu-memory-utilization": s.gpu_memory_utilization, "max-num-seqs": self.max_num_seqs,
                    "max-num-batched-tokens": self.max_num_batched_tokens})
        if s.kv_cache_dtype != "auto":
            out["kv-cache-dtype"] = s.kv_cache_dtype
        if s.block_size != 16:
            out["block-size"] = s.block_size
        if s.enforce_eager:
            out["enforce-eager"] = True
        if not s.hybrid_kv_cache_manager:
            out["disable-hybrid-kv-cache-manager"] = True
        if s.kv_offloading_size_bytes:
            out["kv-offloading-size"] = round(s.kv_offloading_size_bytes / GiB, 2)
        if s.quantization:
            out["quantization"] = s.quantization
        if s.enable_lora:
            out.update({"enable-lora": True, "max-lora-rank": s.max_lora_rank, "max-loras": s.max_loras})
        return out


def settings_for_version(version: str, **engine_args) -> VllmSettings:
    """:class:`VllmSettings` with the memory rules of vLLM ``version``
    (:func:`~vramguard.engines.vllm_versions.rules_for`); ``engine_args`` set the rest and override a rule.

    Raises:
        InvalidValue: a version that is not a number or older than the oldest modelled, or a bad engine argument.
    """
    r = rules_for(version)
    rules = dict(engine=r.engine, sampler=r.sampler, nccl_in_budget=r.nccl_in_budget,
                 cudagraph_in_budget=r.cudagraph_in_budget, tokens_by_blocks=r.tokens_by_blocks,
                 large_card_tier=r.large_card_tier, mxfp4_hopper_backend=r.mxfp4_hopper_backend, vllm_version=version,
                 tp_comm_bytes=r.tp_comm_bytes)
    return VllmSettings(**{**rules, **engine_args})


def batch_defaults(gpu: GpuSpec, large_card_tier: bool = True) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` that ``vllm serve`` picks for ``gpu``
    (``EngineArgs.get_batch_defaults``: at least 160 GiB -> 16,384 and 1,024 when ``large_card_tier``; at least
    70 GiB and not an A100 -> 8,192 and 1,024; else 2,048 and 256)."""
    if large_card_tier and gpu.total_bytes >= 160 * GiB:
        return 16384, 1024
    if gpu.total_bytes >= 70 * GiB and "a100" not in gpu.label.lower():
        return 8192, 1024
    return 2048, 256


def model_dtype(spec: ModelSpec, s: VllmSettings, gpu: GpuSpec) -> tuple[str, list[str]]:
    """The dtype vLLM runs: ``s.dtype``, or for ``auto`` the checkpoint's (float32 -> bfloat16; bfloat16 ->
    float16 on cards below compute capability 8.0), with a note for each change."""
    notes: list[str] = []
    if s.dtype != "auto":
        return s.dtype, notes
    name = TORCH_DTYPE_NAMES.get(spec.checkpoint_dtype or "bf16", "bfloat16")
    if name == "float32":
        name = "bfloat16"
        notes.append("dtype auto: the float32 checkpoint runs in bfloat16, as vLLM's auto dtype does")
    if name == "bfloat16" and gpu.supports_bf16 is False:
        name = "float16"
        notes.append(f"dtype auto: {gpu.label} has no bfloat16 (compute capability below 8.0): float16")
    return name, notes


def _stage_layer_kinds(spec: ModelSpec, pp: int) -> list[list[str]]:
    kinds = list(spec.layer_types) or ["full_attention"] * spec.num_layers
    out, start = [], 0
    for n in w.pp_layer_counts(spec.num_layers, pp):
        out.append(kinds[start:start + n])
        start += n
    return out


NO_VLLM_MODEL_FIX = ("plan it for transformers, the default engine ({plan}); vLLM itself may serve {model_type} (its "
                     "list of supported models says), but vramguard's vLLM model does not cover it yet")


def _check_model(model: MemoryModel) -> None:
    """Raise ConfigError for a quantized layout that is not modelled, or a model whose memory is taken from
    transformers: vLLM's per-rank shards are modelled for the hand-written families only (MLA's are not)."""
    spec = model.spec
    w.linear_format(spec)
    if model.needs_transformers:
        raise ConfigError("config.json:model_type", spec.model_type, "a family with a hand-written vLLM model "
                          "(llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_moe, gemma, gemma2, "
                          "gemma3_text, phi3)", NO_VLLM_MODEL_FIX.format(model_type=spec.model_type,
                                                                        plan="vramguard.plan"))


@dataclass(frozen=True)
class _Budget:
    weights: list[w.RankWeights]
    forward: int
    sampler: int
    encoder: int
    non_torch: int
    nccl: int
    graphs: int

    def activation(self, stage: int) -> int:
        """The profile run's peak on ``stage``: the forward; the vision encoder's on the first stage; the dummy
        sampler on the last (``GPUModelRunner.profile_run`` samples where the logits are)."""
        last = stage == len(self.weights) - 1
        return max(self.forward, self.encoder if stage == 0 else 0, self.sampler if last else 0)

    def non_kv(self, stage: int, s: VllmSettings) -> int:
        """Bytes of ``stage``'s budget that are not KV cache."""
        return (self.weights[stage].total_bytes + self.activation(stage) + self.non_torch
                + (self.nccl if s.nccl_in_budget else 0) + (self.graphs if s.cudagraph_in_budget else 0))


def _vllm_model(spec: ModelSpec, s: VllmSettings) -> VllmModel:
    """The model vLLM builds (:func:`~vramguard.engines.vllm_arch.vllm_model`); a generic family without a vLLM
    model here is refused by :func:`_check_model`."""
    memory = choose(spec).model
    if memory.needs_transformers and spec.config_dict().get("model_type") not in VLLM_FAMILIES:
        _check_model(memory)
    return vllm_model(spec, s.quantization, not memory.needs_transformers)


def _options(m: VllmModel, s: VllmSettings, gpu: GpuSpec) -> w.LayerOptions:
    major = (gpu.compute_capability or (9, 0))[0]
    backend = "marlin" if major < 9 else s.mxfp4_hopper_backend if major == 9 else "flashinfer"
    return w.LayerOptions(fmt=m.fmt, mla=m.mla, expert_bias=m.expert_bias, sinks=m.attention_sinks,
                          mxfp4_backend=backend, lora_rank=s.max_lora_rank if s.enable_lora else 0,
                          max_loras=s.max_loras)


def _budget_terms(m: VllmModel, s: VllmSettings, gpu: GpuSpec, dt: int, tokens: int, seqs: int) -> _Budget:
    spec, tp = m.text, s.tensor_parallel_size
    weights = w.rank_weights(spec, tp, s.pipeline_parallel_size, dt, _options(m, s, gpu),
                             m.vision.params if m.vision else 0)
    forward = w.forward_peak_bytes(spec, tp, tokens, dt)
    sampler = w.sampler_peak_bytes(spec, tokens, min(seqs, tokens), dt, s.sampler,
                                   w.SM_COUNTS.get(gpu.name, w.DEFAULT_SM_COUNT))
    encoder = w.encoder_peak_bytes(m.vision, spec.hidden_size, tokens, dt) if m.vision else 0
    graphs = 0
    if not s.enforce_eager:
        capture = min(seqs * 2, MAX_CAPTURE_SIZE)
        # CompilationConfig's default capture sizes: 1, 2, 4, then every 8 below 256, then every 16 up to the max
        sizes = len([n for n in [1, 2, 4, *range(8, 256, 8), *range(256, capture + 1, 16)] if n <= capture])
        graphs = (w.forward_peak_bytes(spec, tp, capture, dt)
                  + CUDAGRAPH_MODES * (sizes - 1) * CUDAGRAPH_BYTES_PER_GRAPH)
    nccl = s.tp_comm_bytes if tp > 1 else NCCL_BYTES if s.pipeline_parallel_size > 1 else 0
    non_torch = NON_TORCH_V0_BYTES if s.engine == "v0" else NON_TORCH_BYTES
    return _Budget(weights, forward, sampler, encoder, non_torch, nccl, graphs)


def _batch(spec: ModelSpec, s: VllmSettings, gpu: GpuSpec, max_len: int) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)``: as set, else the release's defaults (V0: one prefill of
    ``max(max_model_len, 2048)`` tokens, 256 sequences)."""
    if s.engine == "v0":
        return s.max_num_batched_tokens or max(max_len, 2048), s.max_num_seqs or 256
    tokens, seqs = batch_defaults(gpu, s.large_card_tier)
    return s.max_num_batched_tokens or tokens, s.max_num_seqs or seqs


def plan_vllm(model: ModelSpec | MemoryModel, gpu: GpuSpec, settings: VllmSettings | None = None) -> VllmPlan:
    """Plan ``model`` (a spec, or its memory model from :func:`vramguard.plan.choice.choose`) served by vLLM on GPUs
    like ``gpu`` (one per worker); a plan refused for memory carries the plans that fit (:attr:`VllmPlan.fit_tp`,
    :attr:`VllmPlan.fit_card`).

    Raises:
        InvalidValue: a parallel size vLLM refuses for this model (heads or vocabulary not divisible).
        ConfigError: a quantization format not modelled, or a family without a vLLM model here.
    """
    memory = model if isinstance(model, MemoryModel) else choose(model).model
    spec, s = memory.spec, settings or VllmSettings()  # the model vLLM builds is checked by _plan
    p = _plan(spec, gpu, s)
    if p.refused_by not in ("weights_load", "weights_budget", "kv_cache"):
        return p
    return replace(p, fit_tp=_fit_tp(spec, gpu, s), fit_card=_fit_card(spec, gpu, s))


def _room(p: VllmPlan) -> bool:
    return p.refused_by in (None, "max_model_len")


def _fit_tp(spec: ModelSpec, gpu: GpuSpec, s: VllmSettings) -> VllmPlan | None:
    """The plan at the smallest tensor parallel size above ``s``'s that vLLM accepts for the model's heads and
    that leaves room for KV blocks (up to 64 GPUs per stage)."""
    for tp in range(s.tensor_parallel_size + 1, 65):
        try:
            w.check_tensor_parallel(spec, tp)
        except InvalidValue:
            continue
        alt = _plan(spec, gpu, replace(s, tensor_parallel_size=tp))
        if _room(alt):
            return alt
    return None


def _fit_card(spec: ModelSpec, gpu: GpuSpec, s: VllmSettings) -> VllmPlan | None:
    """The plan on the smallest catalog card larger than ``gpu`` that leaves room for KV blocks."""
    for card in sorted(GPUS.values(), key=lambda g: g.total_bytes):
        if card.total_bytes > gpu.total_bytes:
            alt = _plan(spec, card, s)
            if _room(alt):
                return alt
    return None


def _plan(spec: ModelSpec, gpu: GpuSpec, s: VllmSettings) -> VllmPlan:
    m = _vllm_model(spec, s)
    spec = m.text
    _check_model(choose(spec).model)
    dtype, notes = model_dtype(spec, s, gpu)
    dt = TORCH_BYTES[dtype]
    kv_dt = dt if s.kv_cache_dtype in ("auto", "bfloat16", "float16") else 1
    if s.kv_cache_dtype in ("bfloat16", "float16"):
        kv_dt = 2
    max_len = s.max_model_len or spec.max_position_embeddings
    tokens, seqs = _batch(spec, s, gpu, max_len)
    if max_len > spec.max_position_embeddings and s.allow_long_max_model_len:
        notes.append(f"max_model_len {max_len:,} is above the model's {spec.max_position_embeddings:,}: allowed by "
                     "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (positions past those the model was trained on)")
    b = _budget_terms(m, s, gpu, dt, tokens, seqs)
    requested = int(gpu.total_bytes * s.gpu_memory_utilization)
    page = kv.page_bytes(spec, s.tensor_parallel_size, kv_dt, s.block_size)
    stages = _stage_layer_kinds(spec, s.pipeline_parallel_size)
    stage_groups = [kv.kv_groups(spec, kinds, page, s.hybrid_kv_cache_manager) for kinds in stages]
    # every worker gets the same number of blocks: the smallest over the stages (get_kv_cache_configs)
    stage_available = [requested - b.non_kv(i, s) for i in range(len(stages))]
    per_stage = [kv.num_blocks(g, a) for g, a in zip(stage_groups, stage_available)]
    worst = per_stage.index(min(per_stage))
    groups, blocks, available = stage_groups[worst], per_stage[worst], stage_available[worst]
    free = gpu.usable_bytes - CUDA_CONTEXT_BYTES - (0 if s.nccl_in_budget else b.nccl)
    need = kv.request_kv_bytes(groups, max_len, tokens, s.block_size)
    largest = kv.largest_model_len(groups, max(available, 0), max_len, tokens, s.block_size)
    over = spec.max_position_embeddings if max_len > spec.max_position_embeddings and \
        not s.allow_long_max_model_len else 0
    start = _Start(free, requested, max(r.total_bytes for r in b.weights), available, need)
    refused_by, refusal = _refusal(gpu, s, start, max_len, largest, over)
    by_blocks = kv.kv_tokens_by_blocks(groups, blocks, s.block_size)
    return VllmPlan(
        model=spec.name, gpu=gpu, settings=s, dtype=dtype, max_model_len=max_len, max_num_seqs=seqs,
        max_num_batched_tokens=tokens, total_bytes=gpu.total_bytes, requested_bytes=requested,
        free_at_start_bytes=free, weights_bytes=b.weights[worst].total_bytes,
        weights_by_stage=tuple(r.total_bytes for r in b.weights), activation_bytes=b.activation(worst),
        forward_peak_bytes=b.forward, sampler_peak_bytes=b.sampler, non_torch_bytes=b.non_torch, nccl_bytes=b.nccl,
        cudagraph_bytes=b.graphs, available_kv_bytes=available, kv_groups=tuple(groups),
        padding_layers=kv.padding_layers(stages[worst], groups), num_blocks=blocks,
        kv_tokens=by_blocks if s.tokens_by_blocks else kv.kv_tokens(groups, blocks, max_len, tokens, s.block_size),
        kv_tokens_by_blocks=by_blocks, max_concurrency=kv.max_concurrency(groups, blocks, max_len, tokens,
                                                                          s.block_size),
        request_kv_bytes=need, largest_model_len=largest, refusal=refusal, notes=tuple(notes + list(_notes(m, s))),
        refused_by=refused_by, model_max_len=spec.max_position_embeddings,
        checkpoint_bytes=_checkpoint_bytes(m, dt), encoder_peak_bytes=b.encoder,
        lora_bytes=b.weights[worst].lora_bytes, vision_bytes=b.weights[0].vision_bytes,
        weight_format=m.fmt.name or m.fmt.kind)


def _notes(m: VllmModel, s: VllmSettings) -> list[str]:
    """What the plan covers beyond a text model in the model dtype."""
    out = []
    if m.fmt.kind != "none":
        out.append(f"weights: {m.fmt.name or m.fmt.kind} ({m.fmt.kind}) as vLLM stores them after loading")
    if m.vision:
        out.append(f"multimodal: the {m.vision.kind} vision encoder and projector ({m.vision.params:,} parameters) "
                   "are loaded beside the language model, and profiled on its largest image")
    if s.vllm_version:
        out.append(f"rules of vLLM {s.vllm_version} ({s.engine.upper()} engine, {s.sampler} sampler, NCCL "
                   f"{'in' if s.nccl_in_budget else 'outside'} the budget, CUDA graphs "
                   f"{'in' if s.cudagraph_in_budget else 'outside'} it)")
    return out


def _checkpoint_bytes(m: VllmModel, dt: int) -> int:
    """The bytes of the checkpoint the workers read: the stored bytes of its safetensors headers, or the
    unsharded weights in the model dtype without the rope cache (Llama-3.1-8B in bf16: 16,094,076,928 B -
    33,554,432 B = 16,060,522,496 B, the size of its safetensors)."""
    stored = getattr(m.text.checkpoint, "total_bytes", None)
    if stored:
        return int(stored)
    opts = w.LayerOptions(fmt=m.fmt, mla=m.mla, expert_bias=m.expert_bias, sinks=m.attention_sinks)
    return sum(r.total_bytes - r.rope_cache_bytes
               for r in w.rank_weights(m.text, 1, 1, dt, opts, m.vision.params if m.vision else 0))


def _gib(n: int) -> str:
    return f"{n / GiB:.2f}"


@dataclass(frozen=True)
class _Start:
    free: int
    requested: int
    weights: int
    available: int
    need: int


def _refusal(gpu: GpuSpec, s: VllmSettings, m: _Start, max_len: int, largest: int,
             model_max: int) -> tuple[str | None, str | None]:
    """``(kind, the error vLLM stops with at start, in its words)``, in the order vLLM meets them (the config's
    check, the free memory at start, the weights' load, the profile run, one request); ``(None, None)`` when it
    starts. ``model_max``: the model's positions when ``max_len`` is above them and not allowed, else 0."""
    if model_max:
        return "max_model_len_limit", (
            f"User-specified max_model_len ({max_len}) is greater than the derived max_model_len "
            f"(max_position_embeddings={model_max}). To allow overriding this maximum, set the env var "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1")
    if m.free < m.requested:
        return "free_memory", (
            f"Free memory on device ({_gib(m.free)}/{_gib(gpu.total_bytes)} GiB) on startup is less than "
            f"desired GPU memory utilization ({s.gpu_memory_utilization}, {_gib(m.requested)} GiB)")
    if m.weights > m.free:
        return "weights_load", (f"CUDA out of memory while loading the weights ({_gib(m.weights)} GiB per GPU, "
                                f"{_gib(m.free)} GiB free)")
    if m.available <= 0:
        return ("weights_budget" if m.weights >= m.requested else "kv_cache"), \
            "No available memory for the cache blocks"
    if m.need > m.available:
        return "max_model_len", (
            f"To serve at least one request with the model's max seq len ({max_len}), ({_gib(m.need)} GiB KV "
            f"cache is needed, which is larger than the available KV cache memory ({_gib(m.available)} GiB). "
            f"Based on the available memory, the estimated maximum model length is {largest}")
    return None, None
