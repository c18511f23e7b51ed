#!/bin/bash
# Runs after a freed model, repeated (benchmarks/README.md, "After a freed model"): three gpu_matrix.py processes
# of Qwen2.5-7B side by side, each as h200_matrix's second process began (bf16, then NF4 once the bf16 model is
# freed; every case in turn), each under its own 24 GiB cap (the caching allocator is per process, so placements
# do not depend on the neighbours); beside them, a process that loads the bf16 model, frees it and asks vramguard
# whether it has freed memory before, and what it plans for the NF4 case whose two earlier processes differed.
# Usage (GPU machine, repository root): [BUDGET_S=420] [REPEATS=3] bash benchmarks/gpu_freed_repeat.sh OUT_DIR
set -u
OUT=$1; mkdir -p $OUT; START=$(date +%s); END=$((START + ${BUDGET_S:-420}))
left() { echo $((END - $(date +%s))); }
at() { echo "$1 at $(( $(date +%s) - START )) s" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia_smi.txt
python3 -c "import torch, transformers, bitsandbytes as b; print(torch.__version__, transformers.__version__, \
b.__version__)" > $OUT/versions.txt 2>&1
timeout $(left) python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.common import build_checkpoint; \
build_checkpoint('qwen2.5-7b', '/dev/shm/qwen2.5-7b')" > $OUT/build_log.txt 2>&1
at "built rc=$?"
for i in $(seq 1 ${REPEATS:-3}); do
  mkdir -p $OUT/r$i
  ( timeout $(left) python3 benchmarks/gpu_matrix.py --archs qwen2.5-7b --out $OUT/r$i/matrix.jsonl \
      --ckpt-dir /dev/shm --keep-ckpt > $OUT/r$i/log.txt 2>&1; at "matrix r$i rc=$?" ) &
done
( timeout $(left) python3 - > $OUT/detect.json 2> $OUT/detect_log.txt <<'PY'
import gc, json, sys
import torch
sys.path.insert(0, ".")
from transformers import AutoModelForCausalLM
from vramguard.plan import plan
from vramguard.plan.allocator import process_freed_memory
from vramguard.settings import Settings
torch.cuda.set_per_process_memory_fraction(24 * 2**30 / torch.cuda.get_device_properties(0).total_memory)
out = {"before_load": process_freed_memory()}
m = AutoModelForCausalLM.from_pretrained("/dev/shm/qwen2.5-7b", dtype=torch.bfloat16, device_map="cuda")
out["loaded"] = process_freed_memory()
out["freed_bytes_after_load"] = torch.cuda.memory_stats()["reserved_bytes.all.freed"]
del m
gc.collect()
torch.cuda.empty_cache()
out["freed_bytes_after_free"] = torch.cuda.memory_stats()["reserved_bytes.all.freed"]
out["after_free"] = process_freed_memory()
p = plan("qwen2.5-7b", Settings(quant="nf4", attn="sdpa", batch=4, prompt_tokens=16384, max_new_tokens=64),
         vram="24GiB", solve=False)
out["plan_peak_reserved"] = p.estimate.peak_reserved_bytes
out["plan_freed_layout_reserved"] = p.estimate.freed_layout_reserved_bytes
out["findings"] = [f.code for f in p.findings]
print(json.dumps(out))
PY
  at "detect rc=$?" ) &
wait
rm -rf /dev/shm/qwen2.5-7b
at "done"
