#!/bin/bash
# Runs after a freed model with expandable segments (benchmarks/README.md, "After a freed model"): gpu_matrix.py
# processes as h200_matrix's began (bf16, then NF4 once the bf16 model is freed; every case in turn), each under its
# own 24 GiB cap, with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: REPEATS of Qwen2.5-7B (whose NF4 SDPA
# cases gave a different peak reserved in each default-allocator process history) and one of Llama-3.1-8B.
# Usage (GPU machine, repository root): [BUDGET_S=420] [REPEATS=2] bash benchmarks/gpu_freed_expandable.sh OUT_DIR
set -u
OUT=$1; mkdir -p $OUT; START=$(date +%s); END=$((START + ${BUDGET_S:-420}))
left() { echo $((END - $(date +%s))); }
at() { echo "$1 at $(( $(date +%s) - START )) s" | tee -a $OUT/steps.txt; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia_smi.txt
python3 -c "import torch, transformers, bitsandbytes as b; print(torch.__version__, transformers.__version__, \
b.__version__)" > $OUT/versions.txt 2>&1
for arch in qwen2.5-7b llama-3.1-8b; do
  timeout $(left) python3 -c "import sys; sys.path.insert(0, '.'); from benchmarks.common import build_checkpoint; \
build_checkpoint('$arch', '/dev/shm/$arch')" >> $OUT/build_log.txt 2>&1
  at "built $arch rc=$?"
done
run() {  # run NAME ARCH
  mkdir -p $OUT/$1
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $(left) python3 benchmarks/gpu_matrix.py --archs $2 \
    --out $OUT/$1/matrix.jsonl --ckpt-dir /dev/shm --keep-ckpt > $OUT/$1/log.txt 2>&1
  at "matrix $1 $2 rc=$?"
}
for i in $(seq 1 ${REPEATS:-2}); do run r$i qwen2.5-7b & done
run r$(( ${REPEATS:-2} + 1 )) llama-3.1-8b &
wait
rm -rf /dev/shm/qwen2.5-7b /dev/shm/llama-3.1-8b
at "done"
