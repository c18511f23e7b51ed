"""`vramguard run` as a user runs it, each call a new process: where its wall time goes, and whether the decode rate
it reports matches the wall clock.

1. A random-weight Llama-3.1-8B folder (``from_config`` + ``save_pretrained``, bf16) with a word-level tokenizer
   (``w0 w1 ...``: one token per word, so a 2,000-word prompt file is 2,000 tokens and each streamed word is one
   token), unless it exists.
2. ``vramguard run FOLDER --quant nf4 --prompt-file P2000 --raw --max-new-tokens 256 --ignore-eos --format json``
   twice (the first call pays the one-time costs: Triton compilation, kernel self-test, graph capture), then once
   in the text format with stdout read as it streams: the wall clock from the first streamed token to the last
   against the reported ``prefill + one-time + decode`` split.
3. The same for the SmolLM2 folder given by ``--smollm2`` (a chat prompt, 256 tokens with ``--ignore-eos``), plus one
   call without ``--ignore-eos``: it must stop at the end of turn and say so.

Every call's record (JSON lines in OUT/run_session.jsonl): wall time of the process, the reported timings
(startup, import, tokenizer, load, plan, prefill = TTFT, one-time, decode, decode ms/token), what was loaded, why it
stopped; the streamed call adds ``wall_decode_ms_per_token`` (first to last streamed token over the tokens between)
and its ratio to the reported figure.

    python3 benchmarks/gpu_run_session.py --out OUT [--smollm2 ~/.cache/vramguard-tests/smollm2-135m-instruct-fp32]
    python3 benchmarks/gpu_run_session.py --out OUT --tiny   # a tiny Llama on the CPU, to try the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from benchmarks.common import build_checkpoint, emit  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096)


def word_tokenizer(folder: str, vocab_size: int) -> None:
    """A word-level tokenizer ``[UNK] [BOS] [EOS] w0 w1 ...`` of ``vocab_size`` ids in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["[UNK]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]",
                            eos_token="[EOS]").save_pretrained(folder)


def build(folder: str, tiny: bool) -> float:
    """The random-weight folder (8B, or the tiny Llama) with its tokenizer; seconds it took (0 if it existed)."""
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return 0.0
    t0 = time.perf_counter()
    if tiny:
        from benchmarks.common import save_random
        save_random("llama", {**TINY, "vocab_size": 1000}, folder)
    else:
        build_checkpoint("llama-3.1-8b", folder)
    cfg = json.load(open(os.path.join(folder, "config.json")))
    word_tokenizer(folder, cfg["vocab_size"])  # every id decodes to one word
    return time.perf_counter() - t0


def call(args: list[str], stream: bool) -> dict:
    """``python -m vramguard ARGS`` in a new process; wall seconds, stdout, stderr, and with ``stream`` the times
    (seconds after the start) at which stdout's pieces arrived."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "vramguard", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=env)
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(p.stderr.read()))
    reader.start()
    out, times = b"", []
    while True:
        piece = os.read(p.stdout.fileno(), 65536)
        if not piece:
            break
        if piece.strip():  # a piece holding a token (not the closing newline)
            times.append(time.perf_counter() - t0)
        out += piece
    p.wait()
    reader.join()
    return {"rc": p.returncode, "wall_s": time.perf_counter() - t0, "stdout": out.decode(errors="replace"),
            "stderr": b"".join(err).decode(errors="replace"), "times": times if stream else None}


def record(log: str, tag: str, args: list[str], stream: bool = False) -> dict:
    """One call: JSON figures, or (``stream``) the text format with the wall clock of the streamed tokens."""
    c = call(args if stream else args + ["--format", "json"], stream)
    rec = {"tag": tag, "args": args, "rc": c["rc"], "process_wall_s": round(c["wall_s"], 3)}
    if c["rc"] != 0:
        rec["stderr"] = c["stderr"][-3000:]
        emit(log, rec)
        return rec
    if not stream:
        r = json.loads(c["stdout"])
        rec.update(tokens=len(r["token_ids"]), stop=r["stop"], stop_detail=r["stop_detail"], loaded=r["loaded"],
                   strategy=r["strategy"], decode_mode=r["decode_mode"], decode_ms_per_token=r["decode_ms_per_token"],
                   ttft_s=r["ttft_s"], timings=r["timings"], reason=r["reason"][:600])
    else:
        words = c["stdout"].split()
        t = c["times"]
        summary = " ".join(c["stderr"].split())
        n = re.search(r"([\d,]+) tokens?, (?:peak|time to first)", summary)  # generated (a BPE word may be several)
        tokens = int(n.group(1).replace(",", "")) if n else len(words)
        rec.update(streamed_pieces=len(t), streamed_words=len(words), tokens=tokens, summary=summary[-1500:])
        if len(t) > 2 and tokens > 2:
            first, last = t[0], t[-1]
            rec["wall_first_to_last_token_s"] = round(last - first, 4)
            rec["wall_decode_ms_per_token"] = round((last - first) * 1000 / (tokens - 1), 3)
    emit(log, rec, width=3000)
    return rec


def compare(log: str, streamed: dict) -> None:
    """The streamed call's wall clock (first to last token) against the decode ms/token and one-time seconds its
    own summary reports; agreement within 5% once the one-time work is counted, and of decode alone."""
    wall = streamed.get("wall_decode_ms_per_token")
    summary = streamed.get("summary", "")
    rep = re.search(r"decode ([\d.]+) ms/token", summary)
    one = re.search(r"one-time ([\d.]+)", summary)
    if wall is None or rep is None:
        return
    rep_ms, one_s = float(rep.group(1)), float(one.group(1)) if one else 0.0
    n = max(streamed["tokens"] - 1, 1)
    with_one_time = rep_ms + one_s * 1000 / n
    emit(log, {"tag": f"{streamed['tag']}_check", "wall_decode_ms_per_token": wall,
               "reported_decode_ms_per_token": rep_ms, "reported_one_time_s": one_s,
               "ratio_wall_to_reported_decode": round(wall / rep_ms, 3),
               "ratio_wall_to_reported_decode_plus_one_time": round(wall / with_one_time, 3),
               "decode_alone_agrees_within_5pct": abs(wall / rep_ms - 1) <= 0.05,
               "with_one_time_agrees_within_5pct": abs(wall / with_one_time - 1) <= 0.05})


def session(log: str, tag: str, folder: str, prompt_args: list[str], new: int, quant: str) -> None:
    base = ["run", folder, *prompt_args, "--max-new-tokens", str(new), "--quant", quant, "--ignore-eos"]
    record(log, f"{tag}_first", base)
    record(log, f"{tag}_second", base)
    streamed = record(log, f"{tag}_streamed", base, stream=True)
    if streamed["rc"] == 0:
        compare(log, streamed)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--folder", default="/dev/shm/vg_run_session_8b", help="the random-weight 8B folder (built "
                                                                           "when missing)")
    ap.add_argument("--smollm2", default=None, help="the SmolLM2-135M-Instruct folder (skipped when missing)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B (a CPU trial)")
    ap.add_argument("--skip-8b", action="store_true", help="only the SmolLM2 part (the 8B measured in another call)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = os.path.join(args.out, "run_session.jsonl")
    import torch
    import transformers
    on_cuda = torch.cuda.is_available()
    emit(log, {"tag": "versions", "torch": torch.__version__, "transformers": transformers.__version__,
               "gpu": torch.cuda.get_device_name() if on_cuda else None})
    folder = args.folder + ("_tiny" if args.tiny else "")
    quant = "nf4" if on_cuda else "fp32"
    if not args.skip_8b:
        emit(log, {"tag": "build", "folder": folder, "seconds": round(build(folder, args.tiny), 1)})
        prompt = os.path.join(args.out, f"prompt_{args.prompt_tokens}.txt")
        with open(prompt, "w") as f:  # one token per word: ids 3 .. 2002 cycle through common embedding rows
            f.write(" ".join(f"w{i % 2000}" for i in range(args.prompt_tokens)))
        session(log, "8b" if not args.tiny else "tiny", folder, ["--prompt-file", prompt, "--raw"], args.new, quant)
    if args.smollm2 and os.path.exists(os.path.join(args.smollm2, "config.json")):
        chat = ["--prompt", "Write one sentence about why the sky is blue."]
        session(log, "smollm2", args.smollm2, chat, args.new, quant)
        record(log, "smollm2_stops", ["run", args.smollm2, *chat, "--max-new-tokens", str(args.new), "--quant", quant])


if __name__ == "__main__":
    main()
