"""The hand paths of ``plan`` against transformers: every catalog model of the hand-taped families (Llama, Qwen2,
Mistral without sliding windows), the default plan (and, for three of them, one at 8,192 prompt tokens), each
planned in a new process with the hand paths (the allocation tape, module tree and load plan written without torch)
and with them turned off (``vramguard.introspect.hand.ENABLED = False``: transformers' meta model and forward replay,
as before), both with empty plan and tape caches; the SHA-256 of the plan's JSON must be the same, and the hand
process must import neither torch nor transformers.

    python benchmarks/cpu_hand_paths.py --out benchmarks/results/cpu_plan_time/hand_paths.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LONG = ("llama-3.1-8b", "qwen2.5-7b", "mistral-nemo-12b")  # also planned at 8,192 prompt tokens
CODE = """
import hashlib, json, sys, time
t0 = time.process_time()
from vramguard.introspect import hand
hand.ENABLED = {enabled}
from vramguard.cli.render import plan_to_json
from vramguard.plan.planner import plan
from vramguard.settings import Settings
p = plan({model!r}, Settings(**{settings!r}))
text = json.dumps(plan_to_json(p), sort_keys=True)
print(json.dumps({{"sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
                  "cpu_s": round(time.process_time() - t0, 2),
                  "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}}))
"""


def one(model: str, settings: dict, enabled: bool) -> dict:
    """The plan of ``model`` in a new process with empty caches: its JSON's digest, CPU seconds, heavy imports."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "VRAMGUARD_PLAN_CACHE": "0",
               "VRAMGUARD_TAPE_CACHE": str(Path(tmp) / "tapes")}
        code = CODE.format(enabled=enabled, model=model, settings=settings)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    if r.returncode:
        return {"error": r.stderr.strip().splitlines()[-1][:300]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from vramguard.catalog.models import MODELS
    from vramguard.introspect import hand
    from vramguard.memory import hand_tape
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for name in MODELS:
            spec = resolve_model(name)
            if not hand.covers(spec):
                continue
            for settings in ({}, {"prompt_tokens": 8192}):
                if settings and name not in LONG:
                    continue
                t0 = time.perf_counter()
                fast, ref = one(name, settings, True), one(name, settings, False)
                by_hand = hand_tape.covers(spec, Settings(**settings))
                rec = {"model": name, "settings": settings, "tape_by_hand": by_hand, "hand": fast, "transformers": ref,
                       "same": fast.get("sha256") == ref.get("sha256"), "wall_s": round(time.perf_counter() - t0, 1)}
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
