"""Prometheus metrics of one server process (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
OUTCOMES = ("completed", "cancelled", "rejected_overload", "rejected_invalid", "rejected_auth", "failed")


class Metrics:
    """Counters, gauges and histograms exposed on /metrics (names prefixed ``vramguard_``; bytes, seconds)."""

    def __init__(self, engine_stats=None):
        r = self.registry = CollectorRegistry()
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
        return generate_latest(self.registry)
