"""What importing bitsandbytes and transformers' caches (which import hqq where it is installed) costs a command,
plain and once vramguard is imported (:func:`vramguard.extras.defer_import_time_compiles`: their import-time
``torch.compile`` calls deferred to the first call).

Each sample a new process: torch imported first (timed apart), then ``vramguard`` (only the second way), then
bitsandbytes and ``transformers.cache_utils``, the two ways alternating; the medians, the machine's load average
and whether TorchDynamo / Inductor were imported. On the GPU machine run it with bitsandbytes and hqq on
``PYTHONPATH`` as the other GPU scripts do.

    python benchmarks/cpu_import_deferred.py --repeat 5 --out benchmarks/results/cpu_import_deferred/import.json
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
if sys.argv[1] == "vramguard":
    import vramguard
t2 = time.perf_counter()
import bitsandbytes
t3 = time.perf_counter()
import transformers.cache_utils
t4 = time.perf_counter()
print(json.dumps({"torch_s": t1 - t0, "vramguard_s": t2 - t1, "bnb_s": t3 - t2, "cache_utils_s": t4 - t3,
                  "hqq": "hqq.core.quantize" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                  "inductor": "torch._inductor.compile_fx" in sys.modules, "cuda": torch.cuda.is_available()}))
"""


def sample(how: str) -> dict:
    """One new process importing torch, then (``how`` ``"vramguard"``) vramguard, then bitsandbytes and
    transformers' caches."""
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
    summary = {how: {**{f"{k}_median": statistics.median(r[k] for r in rs)
                        for k in ("torch_s", "vramguard_s", "bnb_s", "cache_utils_s")},
                     "hqq_imported": rs[0]["hqq"], "dynamo_imported": rs[0]["dynamo"],
                     "inductor_imported": rs[0]["inductor"]}
               for how, rs in runs.items()}
    record = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "load_average": os.getloadavg(),
              "cuda": runs["plain"][0]["cuda"], "summary": summary, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
