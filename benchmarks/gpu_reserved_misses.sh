#!/bin/bash
# The reserved-memory runs the allocator model misses, again, with the allocator's own trace (benchmarks/README.md,
# "Reserved memory and the edge"): gpu_matrix.py in the order of results/h200_matrix (one process ran
# Llama-3.1-8B then Llama-2-7B, the other Qwen2.5-7B then Phi-3-mini-128k, every case of a model in turn), each
# case's large-pool trace kept; the same cases in fresh processes (gpu_edge.py, with the trace of the load); then
# `vramguard fit --max-runs 3` under 24 GiB on Llama-3.1-8B NF4 (64 new tokens) and on Llama-3.2-1B NF4 (16 new
# tokens, the first-hour trial's case). All runs side by side under their per-process caps (the caching allocator
# is per process, so placements do not depend on the neighbours; times do).
# Usage (GPU machine, repository root): [BUDGET_S=270] bash benchmarks/gpu_reserved_misses.sh OUT_DIR
set -u
OUT=$1; mkdir -p $OUT/p1 $OUT/p2 $OUT/f1 $OUT/f2 $OUT/f3 $OUT/f4 $OUT/fit; START=$(date +%s)
END=$((START + ${BUDGET_S:-270}))
left() { echo $((END - $(date +%s))); }
at() { echo "$1 at $(( $(date +%s) - START )) s" | tee -a $OUT/steps.txt; }
build() {  # build ARCH [tokenizer]: a random-weight checkpoint in /dev/shm/ARCH, with a word tokenizer if asked
  timeout $(left) python3 - "$@" >> $OUT/build_log.txt 2>&1 <<'PY'
import sys; sys.path.insert(0, ".")
from pathlib import Path
from benchmarks.common import build_checkpoint
from vramguard.catalog.models import MODELS
arch = sys.argv[1]
tmp = Path(f"/dev/shm/building_{arch}")
build_checkpoint(arch, str(tmp))
if len(sys.argv) > 2:
    from tests.conftest import save_word_tokenizer
    save_word_tokenizer(tmp, MODELS[arch]["vocab_size"])
tmp.rename(f"/dev/shm/{arch}")  # whole, before a reader sees it
PY
  at "built $1 rc=$?"
}
matrix() {  # matrix NAME ARCH...: gpu_matrix.py over the archs in one process, traces kept
  timeout $(left) python3 benchmarks/gpu_matrix.py --archs "${@:2}" --out $OUT/$1/matrix.jsonl --ckpt-dir /dev/shm \
    --keep-ckpt --trace-dir $OUT/$1 > $OUT/$1/log.txt 2>&1
  at "matrix $1 rc=$?"
}
fresh() {  # fresh NAME ARCH QUANT ATTN PROBE...: the probes in a fresh process (gpu_edge.py), traces kept
  local name=$1 arch=$2 quant=$3 attn=$4; shift 4
  timeout $(left) python3 benchmarks/gpu_edge.py --ckpt /dev/shm/$arch --arch $arch --quant $quant --attn $attn \
    --cap-gib 24 --lo 4096 --hi 4097 --out $OUT/$name/edge.jsonl --run-seconds 200 --probe "$@" \
    > $OUT/$name/log.txt 2>&1
  at "fresh $name rc=$?"
}
fit() {  # fit ARCH NEW: vramguard fit --vary prompt under 24 GiB, at most 3 runs
  local t0=$(date +%s)
  timeout $(left) python3 -m vramguard fit /dev/shm/$1 --vary prompt --vram-budget 24GiB --max-new-tokens $2 \
    --max-runs 3 --format json > $OUT/fit/$1.json 2> $OUT/fit/$1_stderr.txt
  at "fit $1 rc=$? wall $(( $(date +%s) - t0 )) s"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia_smi.txt
python3 -c "import torch, transformers, bitsandbytes as b; print(torch.__version__, transformers.__version__, \
b.__version__)" > $OUT/versions.txt 2>&1
# two builds at a time: each holds its weights in host memory while writing them to /dev/shm
build llama-3.1-8b tok & build qwen2.5-7b & wait
matrix p1 llama-3.1-8b llama-2-7b &  # Llama-2-7B and Phi-3 are built before their process reaches them
matrix p2 qwen2.5-7b phi-3-mini-128k &
( ( fresh f1 llama-3.1-8b nf4 eager 4096 512x4 & fresh f2 qwen2.5-7b nf4 sdpa 16384x4 4096@eager &
    build phi-3-mini-128k & build llama-2-7b & wait
    fresh f3 phi-3-mini-128k nf4 eager 512x4 & fresh f4 llama-2-7b bf16 sdpa 512x4 & wait )
  fit llama-3.1-8b 64 ) &
( sleep 30; build llama-3.2-1b tok; fit llama-3.2-1b 16 ) &
wait
rm -rf /dev/shm/llama-3.1-8b /dev/shm/qwen2.5-7b /dev/shm/phi-3-mini-128k /dev/shm/llama-2-7b /dev/shm/llama-3.2-1b
at total
