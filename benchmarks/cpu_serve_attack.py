"""serve under attack, round two, on the CPU (loopback only, every loop bounded): one ``vramguard serve`` process of
a real model (SmolLM2-135M-Instruct, float32) limited to 1,024 file descriptors, and what a normal chat request
costs while it is attacked:

* ``baseline``: the median of 15 normal chat requests (4 new tokens) alone;
* ``flood_1mb`` / ``flood_cjk``: the same with four clients sending ~1 MB prompts (ASCII words, CJK text) that can
  never fit the context, in a loop (each refused after a prefix);
* ``browser``: the status of a DNS-rebinding Host, a cross-site Origin, a text/plain POST, and a loopback request;
* ``idle_1100``: 1,100 connections that send nothing or part of their headers, then normal requests;
* ``sigterm``: seconds from SIGTERM (a stream generating, the idle connections open) to the process's exit.

One JSON line per case on stdout and in OUTDIR/results.jsonl; the server's log in OUTDIR/serve.log.

    python benchmarks/cpu_serve_attack.py OUTDIR [--model FOLDER]

(default FOLDER: the test suite's ~/.cache/vramguard-tests/smollm2-135m-instruct-fp32, built by tests/real_model.py)
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
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchmarks.common import emit  # noqa: E402

DEFAULT_MODEL = os.path.expanduser("~/.cache/vramguard-tests/smollm2-135m-instruct-fp32")
DESCRIPTORS = 1024


def spawn(model: str, log: str):
    ready = log + ".url"
    if os.path.exists(ready):
        os.remove(ready)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    proc = subprocess.Popen([sys.executable, "-m", "vramguard", "serve", model, "--port", "0", "--ready-file", ready,
                             "--quant", "fp32", "--max-running", "8", "--max-queue", "16", "--served-model-name", "m"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, hard)))
    deadline = time.time() + 300
    while not os.path.exists(ready):
        if proc.poll() is not None or time.time() > deadline:
            raise RuntimeError(f"server did not start (exit {proc.poll()}): {open(log).read()[-3000:]}")
        time.sleep(0.2)
    return proc, open(ready).read().strip()


def normal_p50(url: str, n: int = 15) -> tuple[float, list[int]]:
    import httpx
    times, codes = [], []
    with httpx.Client(timeout=60) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json={"model": "m", "max_tokens": 4, "temperature": 0,
                                                           "messages": [{"role": "user", "content": f"Count to {i}"}]})
            times.append(time.perf_counter() - t0)
            codes.append(r.status_code)
    return statistics.median(times), sorted(set(codes))


def flooded(url: str, prompt: str) -> dict:
    """The normal requests' median while four clients send ``prompt`` (at most 100 each)."""
    import httpx
    raw = json.dumps({"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": 4},
                     ensure_ascii=False).encode()
    stop, seen, took = threading.Event(), [], []

    def flood():
        with httpx.Client(timeout=60) as c:
            for _ in range(100):
                if stop.is_set():
                    return
                t0 = time.perf_counter()
                r = c.post(url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
                took.append(time.perf_counter() - t0)
                seen.append(r.status_code)

    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    p50, codes = normal_p50(url)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    return {"body_bytes": len(raw), "normal_p50_ms": round(1000 * p50, 1), "normal_status": codes,
            "flood_requests": len(seen), "flood_status": sorted(set(seen)),
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
    p50, codes = normal_p50(url, 9)
    idle = {"connections": 1100, "descriptor_limit": DESCRIPTORS, "normal_p50_ms": round(1000 * p50, 1),
            "normal_status": codes}
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = os.path.join(args.out, "results.jsonl")
    proc, url = spawn(args.model, os.path.join(args.out, "serve.log"))
    try:
        p50, codes = normal_p50(url)
        emit(res, {"case": "baseline", "normal_p50_ms": round(1000 * p50, 1), "normal_status": codes,
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
    log = open(os.path.join(args.out, "serve.log")).read()
    emit(res, {"case": "log", "tracebacks": log.count("Traceback"),
               "cap_lines": sum("to stay under the cap" in x for x in log.splitlines())})


if __name__ == "__main__":
    main()
