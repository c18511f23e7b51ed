"""serve under attack, round two, on the CPU (loopback only, every loop bounded): one ``vramguard serve`` process
limited to 1,024 file descriptors, and what a normal chat request costs while it is attacked:

* ``baseline``: the median of 15 normal chat requests (4 new tokens) alone;
* ``flood_1mb`` / ``flood_cjk``: the same with four clients (a process of their own) sending ~1 MB prompts (ASCII
  words, CJK text) that can never fit the context, in a loop until the normal requests are done (each refused after
  a prefix, or before any tokenization);
* ``browser``: the status of a DNS-rebinding Host, a cross-site Origin, a text/plain POST, and a loopback request;
* ``idle_1100``: 1,100 connections that send nothing or part of their headers, then normal requests;
* ``sigterm``: seconds from SIGTERM (a stream generating, the idle connections open) to the process's exit;
* ``router_bodyless`` (with ``--router``): the multi-GPU front process (``vramguard.serve.router.run_router``) over
  one real worker process on the CPU, 2 x (running + queue) = 48 connections that send headers and no body held
  against it, and the normal requests' times and status meanwhile; then what each body-less connection got.

One JSON line per case on stdout and in OUTDIR/results.jsonl; the server's log in OUTDIR/serve.log (the router's in
OUTDIR/router.log).

    python benchmarks/cpu_serve_attack.py OUTDIR [--model FOLDER] [--tiny] [--router]

FOLDER (default: the test suite's ~/.cache/vramguard-tests/smollm2-135m-instruct-fp32, built by
tests/real_model.py) is served as it is; with ``--tiny``, a tiny random Llama (2 layers of width 64) with FOLDER's
tokenizer, chat template and context (in a temporary folder) is served instead: the same tokenizer's work per prompt,
with the model's compute out of the normal request's time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import emit  # noqa: E402

DEFAULT_MODEL = os.path.expanduser("~/.cache/vramguard-tests/smollm2-135m-instruct-fp32")
DESCRIPTORS = 1024
WORKER_ARGS = ["--quant", "fp32", "--max-running", "8", "--max-queue", "16", "--served-model-name", "m"]


def spawn(model: str, log: str):
    ready = log + ".url"
    if os.path.exists(ready):
        os.remove(ready)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.Popen([sys.executable, "-m", "vramguard", "serve", model, "--port", "0", "--ready-file", ready,
                             *WORKER_ARGS], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, hard)))
    return proc, wait_ready(proc, ready, log)


def spawn_router(model: str, log: str):
    """``run_router`` in a process of its own over one worker process (``--gpus 0`` as the CLI starts it; the
    CLI refuses ``--gpus`` without CUDA, so the router is started from Python): both run on the CPU."""
    ready = log + ".url"
    if os.path.exists(ready):
        os.remove(ready)
    code = ("import sys\nfrom vramguard.cli.serve import announcer\nfrom vramguard.serve.router import run_router\n"
            f"sys.exit(run_router({model!r}, [0], {WORKER_ARGS!r}, '127.0.0.1', 0, "
            f"on_listen=announcer({ready!r}, 'the router')))")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, wait_ready(proc, ready, log)


def wait_ready(proc, ready: str, log: str) -> str:
    deadline = time.time() + 300
    while not os.path.exists(ready):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server did not start (exit {proc.poll()}): {open(log).read()[-3000:]}")
        time.sleep(0.2)
    return open(ready).read().strip()


def tiny_model(tokenizer_folder: str, out: str) -> str:
    """A tiny random Llama (seed 0; 2 layers, width 64) with ``tokenizer_folder``'s tokenizer, chat template,
    generation config, vocabulary and context, saved in ``out``."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.from_pretrained(tokenizer_folder)
    cfg.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out)
    for name in os.listdir(tokenizer_folder):
        if name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(os.path.join(tokenizer_folder, name), out)
    return out


def normal_times(url: str, n: int) -> tuple[list[float], list[int]]:
    import httpx
    times, codes = [], []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 4, "temperature": 0,
                                                           "messages": [{"role": "user", "content": f"Count to {i}"}]})
            times.append(time.perf_counter() - t0)
            codes.append(r.status_code)
    return times, codes


def normal_p50(url: str, n: int = 15) -> tuple[float, list[int], float]:
    """The median and the slowest of ``n`` normal requests' times, and their statuses."""
    times, codes = normal_times(url, n)
    return statistics.median(times), sorted(set(codes)), max(times)


FLOOD_CLIENTS = 4
FLOOD_MOST = 2000  # requests per flood client at most (the flood runs until the normal requests are done)


def _flood_process(url: str, raw: bytes, stop, out) -> None:
    """Four clients (threads of this process, apart from the measuring client's) posting ``raw`` in a loop until
    ``stop`` is set; puts ``(statuses, seconds)`` of every request on ``out``."""
    import httpx
    seen, took = [], []

    def flood():
        with httpx.Client(timeout=60) as c:
            for _ in range(FLOOD_MOST):
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                r = c.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
                took.append(time.perf_counter() - t0)
                seen.append(r.status_code)

    threads = [threading.Thread(target=flood) for _ in range(FLOOD_CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    out.put((seen, took))


def flooded(url: str, prompt: str) -> dict:
    """The normal requests' median while four clients send ``prompt`` in a loop, from a process of their own (in
    the measuring process they would hold its GIL against the normal requests' client), from before the first
    normal request until after the last."""
    import multiprocessing
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4},
                     ensure_ascii=False).encode()
    ctx = multiprocessing.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_flood_process, args=(url, raw, stop, out))
    proc.start()
    time.sleep(0.5)
    p50, codes, slowest = normal_p50(url)
    stop.set()
    seen, took = out.get(timeout=180)
    proc.join(timeout=60)
    return {"body_bytes": len(raw), "normal_p50_ms": round(1000 * p50, 1), "normal_max_ms": round(1000 * slowest, 1),
            "normal_status": codes, "flood_requests": len(seen), "flood_status": sorted(set(seen)),
            "flood_p50_ms": round(1000 * statistics.median(took), 1) if took else None}


def browser(url: str) -> dict:
    import httpx
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return {"rebinding_host": httpx.get(url + "/v1/models", headers={"Host": "evil.example:8000"}).status_code,
            "cross_site_origin": httpx.get(url + "/v1/models", headers={"Origin": "http://evil.example"}).status_code,
            "text_plain_post": httpx.post(url + "/v1/chat/completions", content=json.dumps(body),
                                          headers={"content-type": "text/plain"}, timeout=60).status_code,
            "loopback_post": httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code,
            "models": [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]}


def idle_then_sigterm(url: str, proc) -> tuple[dict, dict]:
    import httpx
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for i in range(1100):
        c = socket.create_connection((host, int(port)), timeout=10)
        if i % 2:
            c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-")
        socks.append(c)
    time.sleep(1.5)
    p50, codes, slowest = normal_p50(url, 9)
    idle = {"connections": 1100, "descriptor_limit": DESCRIPTORS, "normal_p50_ms": round(1000 * p50, 1),
            "normal_max_ms": round(1000 * slowest, 1), "normal_status": codes}
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell a long story"}], "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        next(lines)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        rest = list(lines)
    proc.wait(timeout=60)
    term = {"seconds_to_exit": round(time.perf_counter() - t0, 2), "exit_code": proc.returncode,
            "stream_error_event": any("shutting down" in x for x in rest)}
    for c in socks:
        c.close()
    return idle, term


def router_bodyless(url: str, proc, running_plus_queue: int = 24) -> dict:
    """Normal requests alone, then with 2 x (running + queue) body-less connections held against the router; what
    the body-less ones got; then SIGTERM to the router and its exit."""
    alone, _ = normal_times(url, 9)
    host, port = url.removeprefix("http://").split(":")
    socks = []
    for _ in range(2 * running_plus_queue):
        c = socket.create_connection((host, int(port)), timeout=30)
        c.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\n"
                  b"content-length: 100\r\n\r\n")
        socks.append(c)
    time.sleep(0.5)  # each waiting for its body
    held, codes = normal_times(url, 9)
    answers = []
    for c in socks:
        try:
            answers.append(c.recv(65536).split(b"\r\n", 1)[0].decode())
        except OSError as e:
            answers.append(type(e).__name__)
        c.close()
    t0 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    return {"bodyless_connections": len(socks), "alone_p50_ms": round(1000 * statistics.median(alone), 1),
            "normal_p50_ms": round(1000 * statistics.median(held), 1), "normal_max_ms": round(1000 * max(held), 1),
            "normal_status": sorted(set(codes)),
            "bodyless_answers": {a: answers.count(a) for a in sorted(set(answers))},
            "sigterm_seconds_to_exit": round(time.perf_counter() - t0, 2), "exit_code": proc.returncode}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tiny", action="store_true", help="serve a tiny random Llama with the model's tokenizer")
    ap.add_argument("--router", action="store_true", help="also the router over a worker process")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = os.path.join(args.out, "results.jsonl")
    model = tiny_model(args.model, tempfile.mkdtemp(prefix="vramguard-tiny-")) if args.tiny else args.model
    emit(res, {"case": "setup", "model": args.model, "tiny": args.tiny, "load_avg_1m": os.getloadavg()[0],
               "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M")})
    proc, url = spawn(model, os.path.join(args.out, "serve.log"))
    try:
        p50, codes, slowest = normal_p50(url)
        emit(res, {"case": "baseline", "normal_p50_ms": round(1000 * p50, 1), "normal_max_ms": round(1000 * slowest, 1),
                   "normal_status": codes,
                   "load_avg_1m": os.getloadavg()[0], "cpus": os.cpu_count()})
        emit(res, {"case": "flood_1mb", **flooded(url, "the quick brown fox jumps " * 40_000)})
        emit(res, {"case": "flood_cjk", **flooded(url, "日本語の文章を繰り返します。" * 24_900)})
        emit(res, {"case": "browser", **browser(url)})
        idle, term = idle_then_sigterm(url, proc)
        emit(res, {"case": "idle_1100", **idle})
        emit(res, {"case": "sigterm", **term})
    finally:
        if proc.poll() is None:
            proc.kill()
    emit(res, {"case": "log", **log_counts(os.path.join(args.out, "serve.log"), cap_lines="to stay under the cap")})
    if args.router:
        proc, url = spawn_router(model, os.path.join(args.out, "router.log"))
        try:
            emit(res, {"case": "router_bodyless", **router_bodyless(url, proc)})
        finally:
            if proc.poll() is None:
                proc.kill()
        emit(res, {"case": "router_log", **log_counts(os.path.join(args.out, "router.log"),
                                                      timeout_lines="request_timeout")})


def log_counts(path: str, **markers: str) -> dict:
    """A server log's tracebacks, and for each ``name=text`` the lines that contain ``text``."""
    lines = open(path).read().splitlines()
    return {"tracebacks": sum("Traceback" in x for x in lines),
            **{name: sum(text in x for x in lines) for name, text in markers.items()}}


if __name__ == "__main__":
    main()
