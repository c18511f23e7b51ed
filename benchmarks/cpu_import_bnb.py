"""What importing bitsandbytes costs a command, plain and as vramguard imports it
(:func:`vramguard.extras.import_bitsandbytes`: its import-time ``torch.compile`` calls deferred to their first call).

Each sample a new process: torch imported first (timed apart), then bitsandbytes, the two ways alternating; the
medians, the machine's load average and whether TorchDynamo / Inductor were imported. On the GPU machine run it
with bitsandbytes on ``PYTHONPATH`` as the other GPU scripts do.

    python benchmarks/cpu_import_bnb.py --repeat 5 --out benchmarks/results/cpu_import_bnb/import.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROBE = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
if sys.argv[1] == "plain":
    import bitsandbytes
else:
    from vramguard.extras import import_bitsandbytes
    import_bitsandbytes()
t2 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "bnb_s": t2 - t1, "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor.compile_fx" in sys.modules, "cuda": torch.cuda.is_available()}))
"""


def sample(how: str) -> dict:
    """One new process importing torch then bitsandbytes ``how`` (``plain`` or ``vramguard``)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])))
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    runs: dict[str, list[dict]] = {"plain": [], "vramguard": []}
    for _ in range(a.repeat):
        for how in runs:
            runs[how].append(sample(how))
    summary = {how: {"bnb_s_median": statistics.median(r["bnb_s"] for r in rs),
                     "torch_s_median": statistics.median(r["torch_s"] for r in rs),
                     "dynamo_imported": rs[0]["dynamo"], "inductor_imported": rs[0]["inductor"]}
               for how, rs in runs.items()}
    record = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "load_average": os.getloadavg(),
              "cuda": runs["plain"][0]["cuda"], "summary": summary, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
