"""Prometheus metrics of one server process (its own registry, so several apps can live in one process).

Besides its own ``vramguard_*`` names, /metrics carries the metrics an inference gateway scrapes to pick a model
server: the Gateway API Inference Extension's "Model Server Protocol"
(kubernetes-sigs/gateway-api-inference-extension, ``docs/proposals/003-model-server-protocol/README.md``) names,
for each required metric, the type and the vLLM name its endpoint picker (EPP) reads by default:

==========================  =====  ===================================  ============================================
protocol metric             type   name here (vLLM's)                   value
==========================  =====  ===================================  ============================================
TotalQueuedRequests         Gauge  ``vllm:num_requests_waiting``        admitted requests without a token yet
TotalRunningRequests        Gauge  ``vllm:num_requests_running``        admitted requests generating tokens
KVCacheUtilization          Gauge  ``vllm:kv_cache_usage_perc``         KV blocks held / blocks in the pool, 0 to 1
(the same, older EPP/vLLM)  Gauge  ``vllm:gpu_cache_usage_perc``        the same value
BlockSize, NumGPUBlocks     Gauge  ``vllm:cache_config_info``           1, labels ``block_size`` and ``num_gpu_blocks``
==========================  =====  ===================================  ============================================

The protocol calls KV-cache utilization a percentage; vLLM, whose names the EPP reads, reports it as a fraction
("1 means 100 percent usage"), and so does this server. The LoRA metric (``vllm:lora_requests_info``) is for servers
that load adapters named in the request's ``model``; this server serves one model and exposes none.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
OUTCOMES = ("completed", "cancelled", "rejected_overload", "rejected_invalid", "rejected_auth", "failed")


class Metrics:
    """Counters, gauges and histograms exposed on /metrics (names prefixed ``vramguard_``; bytes, seconds)."""

    def __init__(self, engine_stats=None, model_name: str | None = None):
        r = self.registry = CollectorRegistry()
        self.model_name = model_name
        self.requests = Counter("vramguard_requests", "Requests by outcome", ["outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(o)
        self.prompt_tokens = Counter("vramguard_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("vramguard_generation_tokens", "Tokens generated", registry=r)
        self.oom_recoveries = Counter("vramguard_oom_recoveries", "Out-of-memory errors recovered inside a step",
                                      registry=r)
        self.step_failures = Counter("vramguard_step_failures", "Engine steps that failed for a reason other than "
                                     "memory (the requests to blame failed alone; the others went on)", registry=r)
        self.refusals = Counter("vramguard_refusals", "Requests refused before admission, by error code",
                                ["code"], registry=r)
        self.ttft = Histogram("vramguard_time_to_first_token_seconds", "Time to first token", buckets=TTFT_BUCKETS,
                              registry=r)
        self.tpot = Histogram("vramguard_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=TPOT_BUCKETS, registry=r)
        self.rejection_seconds = Histogram("vramguard_overload_rejection_seconds",
                                           "Time to answer 429 once the request reached the handler",
                                           buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25),
                                           registry=r)
        self.vram_allocated = Gauge("vramguard_vram_allocated_bytes", "torch.cuda.memory_allocated", registry=r)
        self.vram_peak = Gauge("vramguard_vram_peak_allocated_bytes", "torch.cuda.max_memory_allocated since start",
                               registry=r)
        self.vram_reserved = Gauge("vramguard_vram_reserved_bytes", "torch.cuda.memory_reserved", registry=r)
        self.kv_blocks_used = Gauge("vramguard_kv_blocks_used", "KV blocks held by requests", registry=r)
        self.kv_blocks_total = Gauge("vramguard_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.queue_depth = Gauge("vramguard_queue_depth", "Admitted requests waiting for their first token",
                                 registry=r)
        self.running = Gauge("vramguard_requests_in_flight", "Admitted requests not finished", registry=r)
        self._engine_stats = engine_stats
        self.gateway = GatewayGauges(r)

    def generated_tokens(self) -> int:
        """Tokens generated so far (the ``vramguard_generation_tokens`` counter)."""
        return int(sum(s.value for m in self.generation_tokens.collect() for s in m.samples
                       if s.name.endswith("_total")))

    def requests_by_outcome(self) -> dict[str, int]:
        """Requests so far by outcome (:data:`OUTCOMES`), refused ones among them."""
        return {s.labels["outcome"]: int(s.value) for m in self.requests.collect() for s in m.samples
                if s.name.endswith("_total")}

    def render(self, device=None) -> bytes:
        """Refresh the gauges and return the text exposition format."""
        try:
            import torch
            if torch.cuda.is_available():
                self.vram_allocated.set(torch.cuda.memory_allocated(device))
                self.vram_reserved.set(torch.cuda.memory_reserved(device))
                self.vram_peak.set(torch.cuda.max_memory_allocated(device))
        except ImportError:
            pass
        if self._engine_stats is not None:
            s = self._engine_stats()
            self.kv_blocks_used.set(s["kv_blocks_used"])
            self.kv_blocks_total.set(s["kv_blocks_total"])
            self.queue_depth.set(s["waiting"])
            self.running.set(s["in_flight"])
            self.gateway.set(s, self.model_name or "vramguard")
        return generate_latest(self.registry)


class GatewayGauges:
    """The Model Server Protocol's gauges under vLLM's names (see the module docstring), in ``registry``."""

    def __init__(self, registry: CollectorRegistry):
        label = ["model_name"]
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests in the queue: admitted, no token yet "
                             "(Model Server Protocol: TotalQueuedRequests)", label, registry=registry)
        self.running = Gauge("vllm:num_requests_running", "Requests being served: admitted, generating "
                             "(Model Server Protocol: TotalRunningRequests)", label, registry=registry)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means 100 percent: blocks held / "
                              "blocks in the pool (Model Server Protocol: KVCacheUtilization)", label,
                              registry=registry)
        self.kv_usage_old = Gauge("vllm:gpu_cache_usage_perc", "The same as vllm:kv_cache_usage_perc (the name of "
                                  "earlier vLLM and endpoint-picker releases)", label, registry=registry)
        self.cache_info = Gauge("vllm:cache_config_info", "The KV pool: tokens per block and blocks (Model Server "
                                "Protocol: BlockSize, NumGPUBlocks)", ["block_size", "num_gpu_blocks"],
                                registry=registry)

    def set(self, s: dict, model_name: str) -> None:
        """The gauges from :meth:`vramguard.serve.engine.Engine.stats` (or :func:`combined_stats` of several)."""
        waiting = s.get("waiting", 0)
        self.waiting.labels(model_name).set(waiting)
        self.running.labels(model_name).set(max(s.get("in_flight", 0) - waiting, 0))
        total = s.get("kv_blocks_total", 0)
        usage = min(s.get("kv_blocks_used", 0) / total, 1.0) if total else 0.0
        self.kv_usage.labels(model_name).set(usage)
        self.kv_usage_old.labels(model_name).set(usage)
        self.cache_info.clear()  # the engine may make fewer blocks than planned: one series, the current one
        self.cache_info.labels(str(s.get("kv_page_size", 0)), str(total)).set(1)


def combined_stats(stats: list[dict]) -> dict:
    """The counts of several engines as one server's (a pod of ``serve --gpus 0,1``): requests and KV blocks
    summed, so the KV usage is all blocks held over all blocks; the block size of the first."""
    keys = ("waiting", "in_flight", "kv_blocks_used", "kv_blocks_total")
    out = {k: sum(int(s.get(k, 0)) for s in stats) for k in keys}
    out["kv_page_size"] = next((s["kv_page_size"] for s in stats if s.get("kv_page_size")), 0)
    return out
