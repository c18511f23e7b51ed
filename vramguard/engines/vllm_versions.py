"""Which of vLLM's memory rules a release follows: the engine (V0 or V1), the dummy sampler's top-k/top-p path, where
NCCL's buffers and the CUDA graph estimate sit, how the KV cache tokens are logged and the batch defaults.

Knows nothing about a model: a version string in, a :class:`VersionRules` out. Each rule names the vLLM file it was
read from and the releases it was read in (the PyPI wheels of vLLM 0.10.1.1, 0.11.0, 0.14.0 and 0.19.0, and 0.33.0
for the newest rules); a release between two read ones follows the older one's rule unless stated:

* engine: V1 by default from 0.8.0 (``vllm/envs.py``: ``VLLM_USE_V1`` defaults to 1); V0 before. V0 profiles one
  prefill of ``max(max_model_len, 2048)`` tokens over 256 sequences (no chunked prefill below 32k tokens), keeps its
  CUDA graphs outside the budget and logs "# GPU blocks: N".
* sampler (``vllm/v1/sample/ops/topk_topp_sampler.py``): 0.10.1.1 and 0.11.0 take FlashInfer's top-k/top-p sampler
  when FlashInfer is installed (``VLLM_USE_FLASHINFER_SAMPLER is not False``: on unless set off) -- the rule assumes
  the vllm/vllm-openai image, which has it; their PyPI wheels list ``flashinfer-python`` only in the ``flashinfer``
  extra, and without it they sort (``sampler="sort"``); 0.14.0 makes it opt-in and sorts the vocabulary in PyTorch
  (``apply_top_k_top_p``); 0.19.0 runs the Triton kernel (``apply_top_k_top_p_triton`` when ``HAS_TRITON``). V0
  sorts.
* NCCL (``vllm/v1/worker/gpu_worker.py::Worker.init_device``): 0.10.1.1 takes the start snapshot before
  ``init_worker_distributed_environment``, so the communicators fall in the non-torch term; 0.11.0 and later take it
  after, yet the non-torch term still grew by 0.42 GiB from TP 1 to TP 2 on H100 in logs of that period (NCCL's
  buffers are set up at the first collectives, in the profile run; github.com/llm-d/llm-d-benchmark,
  config_explorer/empirical-vllm-memory-results.md): in the budget until 0.33.0, which sets them up before its
  snapshot. How much: :data:`NCCL_BYTES` (0.42 GiB) before 0.19.0; from 0.19.0 :data:`TP_COMM_BYTES_0_19` at
  tensor parallel sizes >= 2. 0.19.0 enables the all-reduce + RMSNorm fusion pass at TP >= 2 ("Enabled custom
  fusions: allreduce_rms", ``vllm/compilation/passes/fusion/allreduce_rms_fusion.py``), whose FlashInfer workspace
  (``vllm/distributed/device_communicators/flashinfer_all_reduce.py::_create_workspace``: the ``trtllm`` IPC
  buffers, ``cudaMalloc`` outside torch) and NCCL's lazily connected algorithms are set up during the profile run:
  the H100 sweep of vLLM 0.19.0 (github.com/jgchn/llm-d-planner, accuracy/results/v0.19.0) logged 2.06-2.21 GiB of
  non-torch memory in the profile run at TP 2 and 4 against 0.24-0.27 GiB at TP 1, and 0.07 GiB at pipeline
  parallelism alone (no all-reduce), which keeps :data:`NCCL_BYTES`.
* CUDA graphs: the estimate is subtracted from the budget from 0.21.0 (``VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS``
  defaults to 0 in 0.19.0's ``vllm/envs.py``; vLLM's own log says "CUDA graph memory profiling is enabled (default
  since v0.21.0)").
* KV tokens line (``vllm/v1/core/kv_cache_utils.py``): ``num_blocks // len(groups) * block_size`` in 0.10.1.1 to
  0.19.0; ``int(max_concurrency * max_model_len)`` in 0.33.0 (from 0.20.0 here).
* MXFP4 experts on compute capability 9.x (``vllm/model_executor/layers/quantization/mxfp4.py``): Marlin when
  Triton's kernels are not installed (``_should_use_marlin`` in 0.10.1.1, ``get_mxfp4_backend`` in 0.11.0), as in
  vLLM 0.10's PyPI install (a 0.10.1 log on H100: "Weight-only FP4 compression will be used leveraging the Marlin
  kernel", github.com/vllm-project/vllm/issues/23278); Triton's kernels from 0.11 (the H100 logs of 0.14).
* batch defaults (``vllm/engine/arg_utils.py::EngineArgs.get_batch_defaults``): 0.19.0 has two tiers (8,192 tokens
  and 1,024 sequences from 70 GiB except A100s, else 2,048 and 256); 0.33.0 adds 16,384 from 160 GiB (from 0.20.0
  here).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vramguard.errors import InvalidValue

LATEST_MODELLED = "0.33.0"
MiB = 2**20
# NCCL's buffers at TP/PP >= 2 (NCCL_BUFFSIZE, 4 MiB by default, per channel and peer, send and receive:
# docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html) with vLLM's custom all-reduce buffers: measured as the
# step of vLLM's own non-torch memory from TP 1 to TP 2 on H100 NVLink, 0.14 -> 0.55 GiB (llm-d-benchmark,
# config_explorer/empirical-vllm-memory-results.md); PCIe cards without P2P showed less (about 0.13 GiB)
NCCL_BYTES = 420 * MiB
# vLLM 0.19.0 at TP >= 2 (H100 SXM): the step of the logged non-torch memory of the profile run from TP 1 (0.24-0.27
# GiB) to TP 2 and 4 (2.06-2.21 GiB), github.com/jgchn/llm-d-planner accuracy/results/v0.19.0/results_raw.csv
# (column non_torch_forward_gib, eleven TP runs): 1.85 GiB, the middle of the 1.79-1.97 GiB steps
TP_COMM_BYTES_0_19 = 1894 * MiB
OLDEST_MODELLED = "0.5.0"


@dataclass(frozen=True)
class VersionRules:
    """The memory rules of one vLLM release (see the module docstring for each rule's source).

    Attributes:
        version: the release, as given (``0.19.0``).
        engine: ``v0`` or ``v1``.
        sampler: the dummy sampler's top-k/top-p path (``flashinfer``, ``sort``, ``triton``).
        nccl_in_budget: NCCL's buffers at TP/PP >= 2 come out of the KV cache.
        cudagraph_in_budget: the CUDA graph estimate comes out of the KV cache.
        tokens_by_blocks: "GPU KV cache size" is ``num_blocks // groups * block_size`` (else
            ``int(max_concurrency * max_model_len)``).
        large_card_tier: the 16,384-token batch default from 160 GiB exists.
        mxfp4_hopper_backend: the MXFP4 MoE kernel on compute capability 9.x (``marlin`` or ``triton``).
        tp_comm_bytes: bytes of NCCL and all-reduce buffers at tensor parallel size >= 2 (pipeline parallelism
            alone keeps :data:`NCCL_BYTES`).
    """

    version: str
    engine: str
    sampler: str
    nccl_in_budget: bool
    cudagraph_in_budget: bool
    tokens_by_blocks: bool
    large_card_tier: bool
    mxfp4_hopper_backend: str = "triton"
    tp_comm_bytes: int = NCCL_BYTES


def parse_version(text: str) -> tuple[int, int, int]:
    """``"0.10.1.1"`` -> (0, 10, 1); a local or dev suffix is dropped (``0.9.2.dev7548+gbaba038`` -> (0, 9, 2)).

    Raises:
        InvalidValue: not a vLLM version number.
    """
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", str(text).strip())
    if not m:
        raise InvalidValue("vllm_version", text, "a vLLM release number such as 0.19.0",
                           f"pass the version `pip show vllm` prints, or leave it out for {LATEST_MODELLED}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def rules_for(version: str) -> VersionRules:
    """The rules of vLLM ``version``.

    Raises:
        InvalidValue: not a version number, or older than the oldest modelled release.
    """
    v = parse_version(version)
    if v < parse_version(OLDEST_MODELLED):
        raise InvalidValue("vllm_version", version, f"{OLDEST_MODELLED} or newer",
                           "upgrade vLLM; releases before 0.5 profiled memory differently")
    if v < (0, 8, 0):
        return VersionRules(version, "v0", "sort", True, False, True, False, "marlin")
    if v < (0, 12, 0):
        sampler = "flashinfer"
    elif v < (0, 19, 0):
        sampler = "sort"
    else:
        sampler = "triton"
    return VersionRules(version, "v1", sampler, nccl_in_budget=v < (0, 33, 0), cudagraph_in_budget=v >= (0, 21, 0),
                        tokens_by_blocks=v < (0, 20, 0), large_card_tier=v >= (0, 20, 0),
                        mxfp4_hopper_backend="marlin" if v < (0, 11, 0) else "triton",
                        tp_comm_bytes=TP_COMM_BYTES_0_19 if (0, 19, 0) <= v < (0, 33, 0) else NCCL_BYTES)


def installed_version() -> str | None:
    """The vLLM installed beside vramguard (its distribution metadata; vLLM itself is not imported), else None."""
    from importlib import metadata
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


def default_version() -> str:
    """The installed vLLM's version, else :data:`LATEST_MODELLED`."""
    return installed_version() or LATEST_MODELLED
