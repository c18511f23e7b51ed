"""`vramguard run` as a user runs it, each call a new process, streamed: the decode rate it reports against the wall
clock of its stream, and the time from the command to the first token against the same process's import + load.

1. A random-weight Llama-3.1-8B folder (``from_config`` + ``save_pretrained``, bf16, the catalog's dimensions) with
   a word-level tokenizer (``w0 w1 ...``: one token per word, so a 2,000-word prompt file is 2,000 tokens), unless
   it exists.
2. ``vramguard run FOLDER --quant nf4 --prompt-file P2000 --raw --max-new-tokens 256 --ignore-eos`` twice, in the
   text format with stdout read as it streams. The first call starts with empty caches of its own (Triton's
   ``TRITON_CACHE_DIR`` and vramguard's ``VRAMGUARD_CACHE_DIR``, fresh folders under OUT's folder: what a new user
   pays, Triton's compilation and the kernels' full check); the second finds what the first kept.
3. The same for SmolLM2-135M-Instruct (``--smollm2 FOLDER``, or ``--smollm2-gguf FILE``: the folder is built from
   the GGUF by ``tests/real_model.py``), a chat prompt, 256 tokens with ``--ignore-eos``.

Per call: the process wall; the summary's split (startup, import, tokenizer, load, plan, one-time work and how the
kernels were checked, prefill = TTFT, first token, decode ms/token); measured here: the time from the spawn to the
first streamed piece, and the first to the last piece over the tokens between (``wall_decode_ms_per_token``).
The figures the goals name are gathered under ``"checks"``: decode reported vs wall within 5%, reported decode at
most 8 ms/token on the first call and 5 on the second, TTFT at most 0.25 s on the second, and the first token
within 1.5 s of import + load (import counted with and without the interpreter's startup).

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_run_session.py --out $OUT/run_session.json \\
        --smollm2 ~/.cache/vramguard-tests/smollm2-135m-instruct-fp32
    python3 benchmarks/gpu_run_session.py --out /tmp/rs.json --tiny   # a tiny Llama on the CPU, to try the script
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
from benchmarks.common import build_checkpoint  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=4096)
PHASES = {"startup": "startup_s", "import torch + transformers": "import_s", "tokenizer + context check": "prepare_s",
          "load": "load_s", "plan": "plan_s", "one-time": "one_time_s", "prefill (TTFT)": "prefill_s",
          "first token at": "first_token_s", "command total": "total_s"}


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


def call(args: list[str], env: dict) -> dict:
    """``python -m vramguard ARGS`` in a new process: wall seconds, stdout, stderr, and the times (seconds after
    the spawn) at which stdout's pieces arrived."""
    env = {**os.environ, **env, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONUNBUFFERED": "1", "COLUMNS": "400"}
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
            "stderr": b"".join(err).decode(errors="replace"), "times": times}


def parse_summary(stderr: str) -> dict:
    """The figures of `run`'s summary on stderr: tokens, decode ms/token and mode, the ``time:`` line's phases (as
    :class:`vramguard.run.timing.RunTimings` names them) and how the kernels were checked."""
    text = " ".join(stderr.split())
    out: dict = {}
    n = re.search(r"([\d,]+) tokens?, (?:peak|time to first)", text)
    out["tokens"] = int(n.group(1).replace(",", "")) if n else None
    d = re.search(r"decode ([\d.]+) ms/token(?: \((\w+)\))?", text)
    out["decode_ms_per_token"], out["decode_mode"] = (float(d.group(1)), d.group(2)) if d else (None, None)
    line = re.search(r"time: (.+?command total [\d.]+ s)", text)
    if line:
        for name, key in PHASES.items():
            m = re.search(re.escape(name) + r" ([\d.]+)", line.group(1))
            out[key] = float(m.group(1)) if m else None
        steps = re.search(r"decode ([\d.]+) \(([\d,]+) steps?\)", line.group(1))
        out["decode_s"] = float(steps.group(1)) if steps else None
        out["decode_steps"] = int(steps.group(2).replace(",", "")) if steps else None
        check = re.search(r"one-time [\d.]+ \((.+?)\)(?:, prefill|, first|, decode)", line.group(1))
        out["one_time_detail"] = check.group(1) if check else None
        out["kernel_check"] = ("kept" if "kept verdict" in line.group(1) else
                               "full" if "kernel self-test" in line.group(1) else None)
    return out


def record(tag: str, args: list[str], env: dict) -> dict:
    """One streamed call: the summary's figures and the wall clock measured here."""
    c = call(args, env)
    rec: dict = {"tag": tag, "args": args, "rc": c["rc"], "process_wall_s": round(c["wall_s"], 3)}
    if c["rc"] != 0:
        rec["stderr"] = c["stderr"][-3000:]
        print(json.dumps(rec), flush=True)
        return rec
    rec.update(parse_summary(c["stderr"]))
    t, tokens = c["times"], rec.get("tokens") or 0
    rec["streamed_pieces"] = len(t)
    if t:
        rec["wall_first_token_s"] = round(t[0], 4)  # from the spawn: the interpreter's start is in it
    if len(t) > 2 and tokens > 2:
        rec["wall_first_to_last_token_s"] = round(t[-1] - t[0], 4)
        rec["wall_decode_ms_per_token"] = round((t[-1] - t[0]) * 1000 / (tokens - 1), 4)
    imp, load, start = rec.get("import_s"), rec.get("load_s"), rec.get("startup_s") or 0.0
    if t and imp is not None and load is not None:
        rec["first_token_minus_import_load_s"] = round(t[0] - imp - load, 4)
        rec["first_token_minus_startup_import_load_s"] = round(t[0] - start - imp - load, 4)
    rec["summary_tail"] = " ".join(c["stderr"].split())[-1200:]
    print(json.dumps({k: v for k, v in rec.items() if k != "summary_tail"}), flush=True)
    return rec


def checks(tag: str, first: dict, second: dict) -> dict:
    """The goals for one model's two calls (None where a figure is missing)."""
    def agree(r):
        w, d = r.get("wall_decode_ms_per_token"), r.get("decode_ms_per_token")
        return None if w is None or not d else {"ratio": round(w / d, 4), "within_5pct": abs(w / d - 1) <= 0.05}

    def at_most(v, limit):
        return None if v is None else v <= limit
    out = {f"{tag}_decode_vs_wall_first": agree(first), f"{tag}_decode_vs_wall_second": agree(second),
           f"{tag}_first_token_minus_import_load_le_1.5s":
               [at_most(r.get("first_token_minus_import_load_s"), 1.5) for r in (first, second)],
           f"{tag}_first_token_minus_startup_import_load_le_1.5s":
               [at_most(r.get("first_token_minus_startup_import_load_s"), 1.5) for r in (first, second)]}
    if tag == "8b":
        out["8b_decode_first_le_8ms"] = at_most(first.get("decode_ms_per_token"), 8.0)
        out["8b_decode_second_le_5ms"] = at_most(second.get("decode_ms_per_token"), 5.0)
        out["8b_ttft_second_le_0.25s"] = at_most(second.get("prefill_s"), 0.25)
    return out


def session(tag: str, folder: str, prompt_args: list[str], new: int, quant: str, caches: str) -> tuple[list, dict]:
    """Two calls in new processes, the first with empty Triton and vramguard caches (``caches``/tag), the second
    with what the first kept."""
    env = {"TRITON_CACHE_DIR": os.path.join(caches, tag, "triton"),
           "VRAMGUARD_CACHE_DIR": os.path.join(caches, tag, "vramguard")}
    base = ["run", folder, *prompt_args, "--max-new-tokens", str(new), "--quant", quant, "--ignore-eos"]
    first = record(f"{tag}_first", base, env)
    second = record(f"{tag}_second", base, env)
    return [first, second], checks(tag, first, second)


def smollm2_folder(args) -> str | None:
    if args.smollm2:
        return args.smollm2 if os.path.exists(os.path.join(args.smollm2, "config.json")) else None
    if args.smollm2_gguf:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        from real_model import build as build_smollm2
        return str(build_smollm2(os.path.join(os.path.dirname(os.path.abspath(args.out)), "smollm2"),
                                 args.smollm2_gguf))
    return None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="the JSON file to write")
    ap.add_argument("--folder", default="/dev/shm/vg_run_session_8b", help="the random-weight 8B folder (built "
                                                                           "when missing)")
    ap.add_argument("--smollm2", default=None, help="a SmolLM2-135M-Instruct folder")
    ap.add_argument("--smollm2-gguf", default=None, help="or its GGUF file (the folder is built beside --out)")
    ap.add_argument("--prompt-tokens", type=int, default=2000)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--tiny", action="store_true", help="a tiny Llama instead of the 8B (a CPU trial)")
    ap.add_argument("--skip-8b", action="store_true", help="only the SmolLM2 calls (the 8B measured in another call)")
    args = ap.parse_args()
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    import torch
    import transformers
    on_cuda = torch.cuda.is_available()
    result: dict = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                 "gpu": torch.cuda.get_device_name() if on_cuda else None}, "calls": [], "checks": {}}
    caches = tempfile.mkdtemp(prefix="caches_", dir=out_dir)
    quant = "nf4" if on_cuda else "fp32"
    folder = args.folder + ("_tiny" if args.tiny else "")
    if not args.skip_8b:
        result["build_s"] = round(build(folder, args.tiny), 1)
        prompt = os.path.join(out_dir, f"prompt_{args.prompt_tokens}.txt")
        with open(prompt, "w") as f:  # one token per word
            f.write(" ".join(f"w{i % 2000}" for i in range(args.prompt_tokens)))
        calls, c = session("8b" if not args.tiny else "tiny", folder, ["--prompt-file", prompt, "--raw"], args.new,
                           quant, caches)
        result["calls"] += calls
        result["checks"].update(c)
    small = smollm2_folder(args)
    if small:
        calls, c = session("smollm2", small, ["--prompt", "Write one sentence about why the sky is blue."],
                           args.new, quant, caches)
        result["calls"] += calls
        result["checks"].update(c)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["checks"], indent=1))


if __name__ == "__main__":
    main()
