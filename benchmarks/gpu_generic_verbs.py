"""Every GPU verb on architectures outside the hand-written families, as a user runs them: tiny random models of
real architectures (``tests/archs.py``) with a word-level tokenizer, then ``vramguard check`` (the kernel that ran),
``run``, ``profile`` and ``fit`` on the GPU. One JSON line per command: exit code, seconds and the output's tail.

    python benchmarks/gpu_generic_verbs.py --types olmoe qwen3_next deepseek_v2 gpt_oss --out verbs.jsonl
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
sys.path.insert(0, os.path.join(HERE, ".."))
from benchmarks.common import emit  # noqa: E402


def commands(folder: str) -> list[list[str]]:
    return [["check", folder, "--quant", "nf4"],
            ["run", folder, "--prompt", "w1 w2 w3 w4", "--max-new-tokens", "8", "--raw"],
            ["profile", folder, "--quant", "nf4", "--prompt-tokens", "256", "--max-new-tokens", "16", "--format",
             "json"],
            ["fit", folder, "--vary", "prompt", "--vram-budget", "1GiB", "--quant", "bf16", "--max-new-tokens", "16",
             "--max-runs", "4"]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--types", nargs="+", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--dir", default="/tmp/vg_verbs")
    args = ap.parse_args()
    from archs import save_arch
    from conftest import save_word_tokenizer
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, ".."), os.environ.get("PYTHONPATH", "")]))
    for model_type in args.types:
        folder = os.path.join(args.dir, model_type)
        save_arch(folder, model_type)
        save_word_tokenizer(folder, 256)
        for cmd in commands(folder):
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "vramguard", *cmd], capture_output=True, text=True, env=env,
                               timeout=300)
            emit(args.out, {"model_type": model_type, "cmd": cmd[0], "rc": p.returncode,
                            "secs": round(time.perf_counter() - t0, 1), "stdout_tail": p.stdout[-1500:],
                            "stderr_tail": p.stderr[-800:]}, width=400)


if __name__ == "__main__":
    main()
