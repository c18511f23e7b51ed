"""/metrics under the Gateway API Inference Extension's Model Server Protocol names (vLLM's), scraped from the real
server on a tiny random Llama on the CPU while requests queue, run and finish. Every wait is bounded."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from conftest import save_tiny_llama

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=300, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
PAGE, BLOCKS = 16, 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("gateway") / "tiny-llama", **CFG)


def _scrape(url: str) -> dict[str, object]:
    """``{'name{labels}': value}`` of every sample, and ``{"# TYPE name": type}`` of every TYPE line."""
    out: dict[str, object] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            out["# TYPE " + name] = kind
        elif line and not line.startswith("#"):
            head, value = line.rsplit(" ", 1)
            out[head] = float(value)
    return out


W, R, KV, KV_OLD = (f'vllm:{n}{{model_name="tiny"}}' for n in ("num_requests_waiting", "num_requests_running",
                                                                "kv_cache_usage_perc", "gpu_cache_usage_perc"))


def _until(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.time() + timeout_s
    while not cond() and time.time() < deadline:
        time.sleep(0.005)
    return cond()


def test_gateway_metrics_follow_the_queue_and_the_kv_pool(folder):
    from vramguard.serve.server import build
    s = build(str(folder), quant="fp32", page_size=PAGE, max_batch_tokens=64, max_running=1, max_queue=3,
              max_kv_blocks=BLOCKS, verify=False, served_name="tiny")
    url = s.start_background()
    e = s.engine
    e.before_step = lambda i, ids: time.sleep(0.02)  # steps slow enough to scrape between them
    try:
        m = _scrape(url)
        for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                     "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"):
            assert m["# TYPE " + name] == "gauge", name  # the protocol's types: all gauges
        assert (m[W], m[R], m[KV], m[KV_OLD]) == (0, 0, 0, 0)
        # the pool as the endpoint picker's prefix scorer reads it: 16 tokens per block, 20 blocks
        assert m['vllm:cache_config_info{block_size="16",num_gpu_blocks="20"}'] == 1.0

        def one(prompt, n):
            httpx.post(url + "/v1/completions", timeout=60, json={"model": "tiny", "prompt": prompt, "max_tokens": n,
                                                                  "temperature": 0, "ignore_eos": True})
        threads = [threading.Thread(target=one, args=([1, 4, 5], 60))]
        threads[0].start()
        assert _until(lambda: any(h.generated >= 2 for h in e.handles.values())), e.stats()
        threads += [threading.Thread(target=one, args=([1, 6, 7 + i], 5)) for i in range(2)]
        for t in threads[1:]:
            t.start()
        # one request runs (max_running=1); the two behind it wait for their first token
        assert _until(lambda: e.waiting() == 2), e.stats()
        m = _scrape(url)
        busy = e.stats()
        assert (m[W], m[R]) == (2, 1), busy
        # the running request holds 1 to 4 blocks of 16 tokens (3 prompt + at most 60 new: ceil(63 / 16) = 4)
        assert round(m[KV] * BLOCKS, 9) in (1, 2, 3, 4), (m[KV], busy)
        assert m[KV_OLD] == m[KV]
        for t in threads:
            t.join(timeout=60)
        assert _until(lambda: e.in_flight() == 0 and e.kv_blocks_used() == 0), e.stats()
        m = _scrape(url)
        assert (m[W], m[R], m[KV], m[KV_OLD]) == (0, 0, 0, 0)
        assert m['vramguard_requests_total{outcome="completed"}'] == 3
    finally:
        e.before_step = None
        s.stop()


def test_a_pod_of_several_workers_reports_them_as_one_server():
    """``serve --gpus 0,1``: the front process's /metrics sums its healthy workers' queues and KV blocks (from their
    /health), so the gateway sees one model server: 3 + 1 waiting, (5 - 3) + (2 - 1) running, (6 + 2) / (20 + 20)
    of the blocks held; a worker that is down is left out."""
    import asyncio

    from vramguard.serve.router import Worker, _Router
    stats = [dict(model="m", waiting=3, in_flight=5, kv_blocks_used=6, kv_blocks_total=20, kv_page_size=16),
             dict(model="m", waiting=1, in_flight=2, kv_blocks_used=2, kv_blocks_total=20, kv_page_size=16),
             dict(model="m", waiting=9, in_flight=9, kv_blocks_used=9, kv_blocks_total=9, kv_page_size=16)]
    workers = [Worker(n, f"http://127.0.0.1:{9 + i}", stats=st, healthy=i < 2) for i, (n, st) in
               enumerate(zip("abc", stats))]
    router = _Router(workers)
    try:
        body = asyncio.run(router.metrics()).body.decode()
    finally:
        asyncio.run(router.client.aclose())
    m = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
         if line and not line.startswith("#")}
    assert m['vllm:num_requests_waiting{model_name="m"}'] == 4
    assert m['vllm:num_requests_running{model_name="m"}'] == 3
    assert m['vllm:kv_cache_usage_perc{model_name="m"}'] == 8 / 40
    assert m['vllm:cache_config_info{block_size="16",num_gpu_blocks="40"}'] == 1
