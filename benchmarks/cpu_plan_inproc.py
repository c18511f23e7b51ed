"""CPU seconds of one generic plan in this process, apart from the imports before it (torch, transformers' cache and
the architecture's modeling module, vramguard), with the plan and tape caches off: the part of a first plan that
vramguard's own code decides, less noisy on a shared machine than the whole process.

    PYTHONPATH=<checkout> python benchmarks/cpu_plan_inproc.py <config folder> [<card size, e.g. 80GiB>]
"""

import importlib
import json
import os
import sys
import time

os.environ["VRAMGUARD_PLAN_CACHE"] = "0"
os.environ["VRAMGUARD_TAPE_CACHE"] = "0"
t0 = time.process_time()
import torch  # noqa: E402,F401
import transformers.cache_utils  # noqa: E402,F401

from vramguard.introspect import generic  # noqa: E402
from vramguard.plan import planner  # noqa: E402

mt = json.load(open(os.path.join(sys.argv[1], "config.json")))["model_type"]
importlib.import_module(f"transformers.models.{mt}.modeling_{mt}")
imp = time.process_time() - t0
t0 = time.process_time()
p = planner.plan(sys.argv[1], vram=sys.argv[2] if len(sys.argv) > 2 else None)
print(json.dumps({"model": os.path.basename(sys.argv[1]), "root": os.environ.get("PYTHONPATH", ""),
                  "import_cpu_s": round(imp, 2), "plan_cpu_s": round(time.process_time() - t0, 2),
                  "replays": generic._replayed.cache_info().misses,
                  "cards": [[c.max_prompt_tokens, c.max_new_tokens, c.max_batch, c.need_bytes] for c in p.cards]}))
