"""Load test of ``vramguard serve`` on a GPU, side by side with transformers in the same process and budget.

Llama-3.1-8B architecture (random weights), NF4, prompts of 512 random token ids, 128 new tokens each (greedy,
``ignore_eos`` so every request generates exactly its count), a per-process cap of ``--budget``:

1. transformers ``generate`` one request after another (``--seq`` requests): tokens/s;
2. transformers ``generate_batch`` (its continuous batching) on ``--concurrency`` requests with the same KV pool
   and step limits as vramguard's plan (after a warm-up call): tokens/s, peak memory;
3. ``vramguard serve`` started from the CLI in its own process (the budget enforced as a hard cap), driven over
   loopback with httpx from this process: ``--concurrency`` concurrent requests: aggregate tokens/s, peak memory
   against the budget; the same with ``--greedy`` (no sampling processors in the step);
4. a burst of ``--burst`` requests at once with ``--queue`` queue slots: accepted requests complete with exactly
   their tokens, the others get 429/503 (rejection latency), zero 5xx, zero OOM recoveries needed;
5. ``--big`` concurrent requests that each need 30% of the KV pool (pool capped with ``max_kv_blocks``): all
   complete or are refused cleanly.

    PYTHONPATH=/tmp/site:$PWD python benchmarks/gpu_serve.py --out OUTDIR
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import signal
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from benchmarks.common import build_checkpoint, emit  # noqa: E402

GiB = 2**30


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, vocab - 1000, (length,), generator=g).tolist() for _ in range(n)]


async def fire(url: str, bodies: list[dict], timeout: float = 600, connect_first: bool = False) -> list[dict]:
    """POST every body at once; returns status, tokens and latency per request (in input order).
    ``connect_first``: open one connection per request beforehand (concurrent GET /health), so a request's time is
    the server's answer and not this client opening hundreds of connections from one Python thread."""
    import httpx
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as c:
        if connect_first:
            await asyncio.gather(*[c.get(url + "/health") for _ in bodies])
        async def one(b):
            t0 = time.perf_counter()
            try:
                r = await c.post(url + "/v1/completions", json=b)
                dt = time.perf_counter() - t0
                toks = r.json().get("usage", {}).get("completion_tokens") if r.status_code == 200 else None
                return {"status": r.status_code, "tokens": toks, "s": dt,
                        "retry_after": r.headers.get("retry-after"), "worker": r.headers.get("x-vramguard-worker"),
                        "code": (r.json().get("error") or {}).get("code") if r.status_code != 200 else None}
            except Exception as e:  # noqa: BLE001 - recorded, counted as a failure
                return {"status": -1, "tokens": None, "s": time.perf_counter() - t0, "error": repr(e)[:200]}
        return await asyncio.gather(*[one(b) for b in bodies])


async def fire_raw(url: str, bodies: list[dict], timeout: float = 600) -> list[dict]:
    """The burst as a load generator should send it: one connection per request opened first, every request
    pre-serialized, then all written back to back (microseconds apart) and each timed from its own write to its
    complete response (its Content-Length). Plain asyncio streams and HTTP/1.1: an httpx client spends about a
    millisecond of Python per request, so the last of 300 would wait for the client itself. Returns what :func:`fire` returns."""
    import json as _json
    from urllib.parse import urlsplit
    u = urlsplit(url)
    conns = [await asyncio.open_connection(u.hostname, u.port) for _ in bodies]
    reqs = []
    for b in bodies:
        payload = _json.dumps(b).encode()
        reqs.append(b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\nconnection: close\r\n\r\n" % (u.netloc.encode(), len(payload))
                    + payload)

    async def read(i, reader, t0):
        async def complete():  # the response ends at Content-Length, as for any HTTP client (the server's close
            head = await reader.readuntil(b"\r\n\r\n")  # of the connection may come later)
            lines = head[:-4].decode("latin-1").split("\r\n")
            headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
            n = headers.get("content-length")
            if n is not None:
                body_ = await reader.readexactly(int(n))
            elif headers.get("transfer-encoding", "").lower() == "chunked":  # e.g. relayed by the router
                body_ = b""
                while True:
                    size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                    body_ += (await reader.readexactly(size + 2))[:-2]
                    if size == 0:
                        break
            else:
                body_ = await reader.read(-1)
            return int(lines[0].split()[1]), headers, body_
        status, headers, body_ = await asyncio.wait_for(complete(), timeout)
        dt = time.perf_counter() - t0
        try:
            data = _json.loads(body_)
        except ValueError:
            data = {}
        return {"status": status, "s": dt, "retry_after": headers.get("retry-after"),
                "worker": headers.get("x-vramguard-worker"),
                "tokens": data.get("usage", {}).get("completion_tokens") if status == 200 else None,
                "code": (data.get("error") or {}).get("code") if status != 200 else None}

    tasks = []
    for (reader, writer), req in zip(conns, reqs):
        t0 = time.perf_counter()
        writer.write(req)
        tasks.append(asyncio.ensure_future(read(len(tasks), reader, t0)))
    out = await asyncio.gather(*tasks)
    for _, writer in conns:
        writer.close()
    return out


def body(ids, new):
    return {"model": "m", "prompt": ids, "max_tokens": new, "temperature": 0, "ignore_eos": True}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--arch", default="llama-3.1-8b")
    ap.add_argument("--ckpt", default="/tmp/ckpt-llama3-8b")
    ap.add_argument("--budget", default="24")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--seq", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--burst", type=int, default=300)
    ap.add_argument("--queue", type=int, default=64)
    ap.add_argument("--big", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=1, help="runs of generate_batch and of each serve load (means "
                    "are in the last record)")
    ap.add_argument("--skip", default="", help="comma list of phases to skip: seq,batch,serve,burst,big")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, to check the script itself")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "results.jsonl")
    skip = set(args.skip.split(","))
    import transformers
    from transformers import GenerationConfig

    from vramguard.runtime.load import load_model
    from vramguard.resolve import resolve_model
    from vramguard.serve._compat import cb_config
    from vramguard.serve.pool import plan_pool
    transformers.utils.logging.disable_progress_bar()

    t0 = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.smoke
    if not os.path.exists(os.path.join(args.ckpt, "config.json")):
        if args.smoke:
            cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, vocab_size=3000,
                                           max_position_embeddings=4096)
            transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(args.ckpt)
        else:
            build_checkpoint(args.arch, args.ckpt)
    emit(out, {"phase": "checkpoint", "s": round(time.perf_counter() - t0, 1)})
    budget = int(float(args.budget) * GiB)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(budget / total)
    else:
        for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
            setattr(torch.cuda, name, lambda *a, **k: None)
        torch.cuda.max_memory_allocated = lambda *a, **k: 0
        torch.cuda.memory_allocated = lambda *a, **k: 0
    dev = "cuda" if cuda else "cpu"
    loaded = load_model(args.ckpt, quant="nf4" if cuda else "fp32", verify=cuda)
    m = loaded.model
    vocab = m.config.vocab_size
    emit(out, {"phase": "load", "weights_bytes": loaded.report.weights_bytes, "attn": m.config._attn_implementation,
               "sdpa_pin": loaded.sdpa_pin and loaded.sdpa_pin.backend,
               "transformers": transformers.__version__, "torch": torch.__version__})
    P = prompts(max(args.concurrency, args.burst, args.big, args.seq) + 8, args.prompt, vocab)

    # 1. sequential generate
    if "seq" not in skip:
        ids = torch.tensor([P[0]], device=dev)
        m.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        for i in range(args.seq):
            ids = torch.tensor([P[i]], device=dev)
            m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new, min_new_tokens=args.new,
                       do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        emit(out, {"phase": "sequential_generate", "requests": args.seq, "s": round(dt, 2),
                   "tokens_per_s": round(args.seq * args.new / dt, 1)})

    # the plan for the budget (what vramguard serve will use; given to generate_batch too)
    from vramguard.runtime.load import _unpin_sdpa
    _unpin_sdpa(m)
    spec = resolve_model(args.ckpt)
    usable = budget - torch.cuda.memory_allocated()
    pool = plan_pool(spec, usable, act_bytes=2, flash=False, page_size=256, max_batch_tokens=2048,
                     max_requests=args.concurrency)
    emit(out, {"phase": "plan", **pool.as_dict()})

    # 2. transformers generate_batch with the same pool and step limits
    if "batch" not in skip:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        gen = GenerationConfig(max_new_tokens=args.new, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cfg = dict(num_blocks=pool.num_blocks, page_size=pool.page_size, max_batch_tokens=pool.max_batch_tokens,
                   max_requests_per_batch=args.concurrency)
        try:
            m.generate_batch(P[:8], generation_config=gen, continuous_batching_config=cb_config(**cfg))
            for rep in range(args.repeat):
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = m.generate_batch(P[:args.concurrency], generation_config=gen,
                                       continuous_batching_config=cb_config(**cfg))
                torch.cuda.synchronize()
                dt = time.perf_counter() - t
                toks = sum(len(r.generated_tokens) for r in res.values())
                emit(out, {"phase": "generate_batch", "rep": rep, "requests": args.concurrency, "tokens": toks,
                           "s": round(dt, 2), "tokens_per_s": round(toks / dt, 1),
                           "peak_bytes": torch.cuda.max_memory_allocated(), "attn": m.config._attn_implementation})
        except Exception as e:  # noqa: BLE001
            emit(out, {"phase": "generate_batch", "error": repr(e)[:400]})
        m.set_attn_implementation("sdpa")
        gc.collect()
        torch.cuda.empty_cache()

    # 3-5. vramguard serve, as users run it: its own process (the CLI), driven from this one over loopback
    del m, loaded
    gc.collect()
    torch.cuda.empty_cache()
    base = ["--vram-budget", f"{args.budget}GiB", "--max-queue", str(args.queue), "--max-running",
            str(args.concurrency), "--served-model-name", "m"] + ([] if cuda else ["--quant", "fp32"])
    variants = [("serve", base), ("serve_greedy", base + ["--greedy"])]
    if "big" not in skip:
        variants.append(("big", ["--vram-budget", f"{args.budget}GiB", "--page-size", "64", "--max-kv-blocks",
                                 str(int(-(-(args.prompt + 64) // 64) / 0.3)), "--max-queue", str(args.big),
                                 "--max-running", str(args.big), "--served-model-name", "m"]
                         + ([] if cuda else ["--quant", "fp32"])))
    for name, flags in variants:
        if name in skip:
            continue
        t = time.perf_counter()
        proc, url = spawn_server(args.ckpt, flags, os.path.join(args.out, f"{name}.log"))
        try:
            health = httpx_get(url + "/health")
            emit(out, {"phase": f"{name}_start", "s": round(time.perf_counter() - t, 1), "flags": flags,
                       "pool": health["pool"], "notes": health["notes"]})
            asyncio.run(fire(url, [body(P[i], 16) for i in range(8)]))  # warm-up
            if name == "big":
                new = 64
                need = -(-(args.prompt + new) // 64)
                t = time.perf_counter()
                rs = asyncio.run(fire(url, [body(P[i], new) for i in range(args.big)]))
                dt = time.perf_counter() - t
                h = httpx_get(url + "/health")
                emit(out, {"phase": "big_requests", "requests": args.big, "blocks_per_request": need,
                           "pool_blocks": h["kv_blocks_total"], "share": round(need / h["kv_blocks_total"], 3),
                           "ok": sum(r["status"] == 200 for r in rs),
                           "exact_tokens": sum(r["tokens"] == new for r in rs),
                           "refused": sum(r["status"] in (400, 429, 503) for r in rs),
                           "other": [r for r in rs if r["status"] not in (200, 400, 429, 503)][:3], "s": round(dt, 1),
                           "oom_recoveries": h["oom_recoveries"],
                           "peak_bytes": metric(url, "vramguard_vram_peak_allocated_bytes")})
                continue
            for rep in range(args.repeat):
                t = time.perf_counter()
                rs = asyncio.run(fire(url, [body(P[i], args.new) for i in range(args.concurrency)]))
                dt = time.perf_counter() - t
                toks = sum(r["tokens"] or 0 for r in rs)
                emit(out, {"phase": f"{name}_concurrent", "rep": rep, "requests": args.concurrency,
                           "ok": sum(r["status"] == 200 for r in rs),
                           "exact_tokens": sum(r["tokens"] == args.new for r in rs),
                           "tokens": toks, "s": round(dt, 2), "tokens_per_s": round(toks / dt, 1),
                           "peak_bytes": metric(url, "vramguard_vram_peak_allocated_bytes"), "budget_bytes": budget,
                           "oom_recoveries": httpx_get(url + "/health")["oom_recoveries"],
                           "statuses": sorted({r["status"] for r in rs})})
            if name == "serve" and "burst" not in skip:
                t = time.perf_counter()
                rs = asyncio.run(fire_raw(url, [body(P[i % len(P)], args.new) for i in range(args.burst)]))
                dt = time.perf_counter() - t
                ok = [r for r in rs if r["status"] == 200]
                rej = [r for r in rs if r["status"] in (429, 503)]
                emit(out, {"phase": "burst", "requests": args.burst, "queue": args.queue, "accepted": len(ok),
                           "exact_tokens": sum(r["tokens"] == args.new for r in ok), "rejected": len(rej),
                           "rejected_median_ms": round(1000 * statistics.median([r["s"] for r in rej]), 1)
                           if rej else None,
                           "rejected_max_ms": round(1000 * max(r["s"] for r in rej), 1) if rej else None,
                           "retry_after": sorted({r["retry_after"] for r in rej}),
                           "5xx": sum(r["status"] >= 500 for r in rs),
                           "other": [r for r in rs if r["status"] not in (200, 429, 503)][:3],
                           "s": round(dt, 2), "tokens_per_s": round(sum(r["tokens"] for r in ok) / dt, 1),
                           "oom_recoveries": httpx_get(url + "/health")["oom_recoveries"],
                           "peak_bytes": metric(url, "vramguard_vram_peak_allocated_bytes")})
        finally:
            emit(out, {"phase": f"{name}_stop", "exit_code": stop_server(proc)})
    emit(out, summary(out))


def summary(path: str) -> dict:
    """Mean tokens/s of each throughput phase in this run's records, and serve's ratios to the baselines."""
    import json
    runs: dict = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "tokens_per_s" in r and r["phase"] in ("sequential_generate", "generate_batch", "serve_concurrent",
                                                       "serve_greedy_concurrent"):
                runs.setdefault(r["phase"], []).append(r["tokens_per_s"])
    mean = {k: round(statistics.mean(v), 1) for k, v in runs.items()}
    out = {"phase": "summary", "tokens_per_s_runs": runs, "tokens_per_s_mean": mean}
    for name in ("serve_concurrent", "serve_greedy_concurrent"):
        if name in mean and "generate_batch" in mean:
            out[f"{name}_vs_generate_batch"] = round(mean[name] / mean["generate_batch"], 3)
        if name in mean and "sequential_generate" in mean:
            out[f"{name}_vs_sequential"] = round(mean[name] / mean["sequential_generate"], 2)
    return out


def stop_server(proc, timeout_s: float = 90):
    """Ctrl-C once (a graceful stop), wait; kill after ``timeout_s``. Returns the exit code, or "killed"."""
    proc.send_signal(signal.SIGINT)
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "killed"


def spawn_server(ckpt: str, flags: list[str], log: str, timeout_s: float = 300):
    """``vramguard serve`` in its own process on a free loopback port; returns (process, base URL)."""
    ready = log + ".url"
    if os.path.exists(ready):
        os.remove(ready)
    proc = subprocess.Popen([sys.executable, "-m", "vramguard", "serve", ckpt, "--port", "0", "--ready-file", ready,
                             *flags], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    deadline = time.time() + timeout_s
    while not os.path.exists(ready):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server did not start (exit {proc.poll()}): {open(log).read()[-3000:]}")
        time.sleep(0.2)
    return proc, open(ready).read().strip()


def httpx_get(url: str) -> dict:
    import httpx
    return httpx.get(url, timeout=30).json()


def metric(url: str, name: str) -> float | None:
    import httpx
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return None


if __name__ == "__main__":
    main()
