"""The first hour as a user lives it: every verb of ``vramguard`` in a new process, its wall time and exit code.

Each command runs as a person types it (``python -m vramguard VERB ...``, a new process, no warm cache unless a
case says "second"): ``--version``, ``plan`` of a catalog name and of the model folders (first and second time:
the plan cache), ``check``, ``explain`` of a pasted message, ``run`` on SmolLM2 (a chat question, stopping at
the end of turn) and on the 8B NF4 folder, ``profile`` and ``fit`` on SmolLM2, ``export`` of a vLLM command, and
``serve``: the time from the command to ``/health`` answering 200, one chat completion through it, and the time
from SIGTERM to the process's exit.

    python3 benchmarks/gpu_first_hour.py --out OUT --smollm2 /tmp/smol [--big /tmp/llama8b]   # GPU machine
    python3 benchmarks/gpu_first_hour.py --out OUT --smollm2 ~/.cache/vramguard-tests/smollm2-135m-instruct-fp32

writes ``OUT/first_hour.jsonl``: one record per command with ``wall_s``, ``exit``, the command and the last lines
of its output (``--big`` is the random-weight 8B folder that ``gpu_run_session.py`` builds; without it those cases
are skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
       "23.55 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 22.43 GiB memory in "
       "use. Of the allocated memory 18.20 GiB is allocated by PyTorch, and 3.90 GiB is reserved by PyTorch but "
       "unallocated.")
QUESTION = "Write one sentence about why the sky is blue."


def timed(args: list[str], env: dict, timeout: float = 300) -> dict:
    """``python -m vramguard ARGS`` in a new process: wall seconds, exit code and the output's last lines."""
    t0 = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-m", "vramguard", *args], capture_output=True, text=True, env=env,
                           cwd=ROOT, timeout=timeout)
        code, out = r.returncode, (r.stdout + r.stderr)
    except subprocess.TimeoutExpired as e:
        code, out = "timeout", str(e.stdout or "")
    return {"args": ["vramguard", *args], "wall_s": round(time.perf_counter() - t0, 2), "exit": code,
            "tail": out.strip().splitlines()[-6:]}


def serve_case(model: str, env: dict, port: int, extra: list[str]) -> dict:
    """``serve MODEL``: seconds to the first 200 of ``/health``, one chat completion, seconds from SIGTERM to exit."""
    args = ["serve", model, "--port", str(port), *extra]
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "vramguard", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    rec: dict = {"args": ["vramguard", *args]}
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < 300 and p.poll() is None:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.2)
    rec["ready_s"] = round(time.perf_counter() - t0, 2)
    if p.poll() is None:
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
            name = json.loads(r.read())["data"][0]["id"]
        body = json.dumps({"model": name, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 64,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/chat/completions", body, {"Content-Type": "application/json"})
        t1 = time.perf_counter()
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                answer = json.loads(r.read())
            rec["completion_s"] = round(time.perf_counter() - t1, 2)
            rec["answer"] = answer["choices"][0]["message"]["content"]
            rec["finish_reason"] = answer["choices"][0].get("finish_reason")
        except OSError as e:
            rec["completion_error"] = repr(e)
        t2 = time.perf_counter()
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
        rec["stop_s"] = round(time.perf_counter() - t2, 2)
    out = p.stdout.read() if p.stdout else ""
    rec.update(exit=p.wait(), wall_s=round(time.perf_counter() - t0, 2), tail=out.strip().splitlines()[-6:])
    return rec


def cases(smol: str, big: str | None, work: str) -> list[tuple[str, list[str]]]:
    """(name, arguments) of every timed command, in the order a person would meet them."""
    prompt = os.path.join(work, "p2000.txt")
    with open(prompt, "w") as f:
        f.write(" ".join(f"w{i % 1000}" for i in range(2000)))
    c = [("version", ["--version"]),
         ("plan catalog name, first", ["plan", "llama-3.1-8b", "--prompt-tokens", "8192"]),
         ("plan catalog name, second", ["plan", "llama-3.1-8b", "--prompt-tokens", "8192"]),
         ("plan SmolLM2 folder, first", ["plan", smol]),
         ("plan SmolLM2 folder, second", ["plan", smol]),
         ("check SmolLM2", ["check", smol]),
         ("explain", ["explain", OOM]),
         ("run SmolLM2 (stops at end of turn)", ["run", smol, "--prompt", QUESTION, "--format", "json"]),
         ("run SmolLM2, second", ["run", smol, "--prompt", QUESTION, "--format", "json"]),
         ("profile SmolLM2", ["profile", smol, "--prompt-tokens", "512", "--max-new-tokens", "64", "--out",
                              os.path.join(work, "profile")]),
         ("fit SmolLM2", ["fit", smol, "--vary", "batch", "--max-runs", "3", "--vram-budget", "4GiB"]),
         ("export vLLM command", ["export", "llama-3.1-8b", "--to", "vllm", "--gpu", "H100"])]
    if big:
        c += [("plan 8B folder, first", ["plan", big, "--prompt-tokens", "8192"]),
              ("check 8B NF4", ["check", big, "--quant", "nf4"]),
              ("run 8B NF4, 2000+256", ["run", big, "--quant", "nf4", "--prompt-file", prompt, "--raw",
                                        "--max-new-tokens", "256", "--ignore-eos", "--format", "json"]),
              ("run 8B NF4, 2000+256, second", ["run", big, "--quant", "nf4", "--prompt-file", prompt, "--raw",
                                                "--max-new-tokens", "256", "--ignore-eos", "--format", "json"])]
    return c


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--smollm2", required=True, help="the SmolLM2-135M-Instruct folder (tests/real_model.py)")
    ap.add_argument("--big", help="a random-weight Llama-3.1-8B folder (gpu_run_session.py builds one)")
    ap.add_argument("--port", type=int, default=8391)
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="first_hour_")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env.update(VRAMGUARD_PLAN_CACHE=os.path.join(work, "plans"), VRAMGUARD_TAPE_CACHE=os.path.join(work, "tapes"))
    path = os.path.join(a.out, "first_hour.jsonl")
    with open(path, "w") as f:
        for name, args in cases(a.smollm2, a.big, work):
            rec = {"case": name, **timed(args, env)}
            print(f"{name}: {rec['wall_s']} s, exit {rec['exit']}", file=sys.stderr, flush=True)
            f.write(json.dumps(rec) + "\n")
            f.flush()
        rec = {"case": "serve SmolLM2", **serve_case(a.smollm2, env, a.port, [])}
        print(f"serve: ready {rec.get('ready_s')} s, completion {rec.get('completion_s')} s, stop "
              f"{rec.get('stop_s')} s, exit {rec['exit']}", file=sys.stderr, flush=True)
        f.write(json.dumps(rec) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
