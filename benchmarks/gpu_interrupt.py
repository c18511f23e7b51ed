"""Ctrl-C and SIGTERM on a CUDA device, as a user sends them: ``vramguard run`` interrupted while it streams (the
graph decoder on a static cache, the eager steps, NF4 and bf16 weights) must print the summary of what came and
exit 130 without a traceback; ``vramguard serve`` stopped by SIGTERM must exit 0 and say what it served.

A random Llama (16 layers, hidden 2048, a word-level tokenizer of 300 words: memory and timing do not depend on
the weights' values) is built in ``--model-dir``; each case is a new process of the CLI, interrupted once it has
streamed ``--after-words`` words. Writes ``interrupt.json`` (one record per case) to ``--out-dir``.

    python benchmarks/gpu_interrupt.py --out-dir $OUT/interrupt --model-dir /tmp/gi_model
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

CASES = {  # name -> extra options of `vramguard run`
    "default (NF4, graph decode)": [],
    "NF4, eager steps": ["--no-fast-decode"],
    "bf16, graph decode": ["--quant", "bf16"],
}


def build(folder: Path, hidden: int, layers: int) -> None:
    """The random Llama and its word-level tokenizer (``w0`` .. ``w296``), saved in ``folder``."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_hidden_layers=layers,
                      num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=300, max_position_embeddings=32768, bos_token_id=1,
                      eos_token_id=2)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(folder)
    words = ["[UNK]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(297)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]",
                            eos_token="[EOS]").save_pretrained(folder)


def interrupted_run(model: Path, extra: list[str], after_words: int, timeout_s: float) -> dict:
    """``vramguard run`` in a new process, SIGINT once ``after_words`` words have streamed: its exit code, the
    seconds from the signal to the exit, the words streamed and the last lines of its stderr."""
    cmd = [sys.executable, "-m", "vramguard", "run", str(model), "--prompt", "w1 w2 w3", "--raw",
           "--max-new-tokens", "20000", "--ignore-eos", *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    words, err = [0], []
    reader = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
    reader.start()
    t0, sent = time.monotonic(), None
    while p.poll() is None and time.monotonic() - t0 < timeout_s:
        chunk = p.stdout.read(64)
        if not chunk:
            break
        words[0] += chunk.count(" ")
        if sent is None and words[0] >= after_words:
            p.send_signal(signal.SIGINT)
            sent = time.monotonic()
    words[0] += p.stdout.read().count(" ")  # what streamed after the signal
    rc = p.wait(timeout=120)
    reader.join(timeout=10)
    text = "".join(err)
    return {"command": " ".join(cmd[1:]), "exit_code": rc, "signal_to_exit_s": time.monotonic() - sent if sent
            else None, "words_streamed": words[0], "traceback": "Traceback" in text,
            "stopped_line": next((ln for ln in text.splitlines() if ln.startswith("stopped:")), None),
            "stderr_tail": text.splitlines()[-12:]}


def stopped_server(model: Path, port: int, timeout_s: float) -> dict:
    """``vramguard serve`` in a new process: one greedy completion, then SIGTERM; its exit code and last line."""
    cmd = [sys.executable, "-m", "vramguard", "serve", str(model), "--port", str(port)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url, t0, answer = f"http://127.0.0.1:{port}", time.monotonic(), None
    while time.monotonic() - t0 < timeout_s and p.poll() is None:
        try:
            urllib.request.urlopen(url + "/health", timeout=1)
            break
        except OSError:
            time.sleep(0.5)
    if p.poll() is None:
        body = json.dumps({"model": model.name, "prompt": "w1 w2", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]["text"]
        p.send_signal(signal.SIGTERM)
    t1 = time.monotonic()
    _, err = p.communicate(timeout=60)
    return {"command": " ".join(cmd[1:]), "answer": answer, "exit_code": p.returncode,
            "signal_to_exit_s": time.monotonic() - t1, "traceback": "Traceback" in err,
            "last_line": err.strip().splitlines()[-1] if err.strip() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--model-dir", default="/tmp/gi_model")
    ap.add_argument("--after-words", type=int, default=200)
    ap.add_argument("--timeout", type=float, default=150.0)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--cases", default=";".join(CASES), help="case names separated by ; (default: all)")
    a = ap.parse_args()
    out, model = Path(a.out_dir), Path(a.model_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (model / "config.json").exists():
        build(model, a.hidden, a.layers)
    records = []
    for name, extra in CASES.items():
        if name not in a.cases.split(";"):
            continue
        r = {"case": name, **interrupted_run(model, extra, a.after_words, a.timeout)}
        records.append(r)
        print(json.dumps(r), flush=True)
    r = {"case": "serve, SIGTERM", **stopped_server(model, 8931, a.timeout)}
    records.append(r)
    print(json.dumps(r), flush=True)
    (out / "interrupt.json").write_text(json.dumps(records, indent=1))
    os.sync()


if __name__ == "__main__":
    main()
