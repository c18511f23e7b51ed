#!/bin/bash
# The edge runs of benchmarks/README.md ("Reserved memory and the edge"): for each architecture a random-weight
# checkpoint is built on the GPU, then benchmarks/gpu_edge.py runs once with the default allocator and once with
# expandable_segments:True (separate processes). Usage: bash benchmarks/gpu_edge.sh OUT_DIR
set -u
OUT=$1; mkdir -p $OUT; START=$(date +%s); END=$((START + ${EDGE_BUDGET_S:-330}))
build() { python3 -c "from benchmarks.common import build_checkpoint; build_checkpoint('$1', '/dev/shm/$1')" 2>>$OUT/stderr.txt; }
edge() {  # seconds arch quant attn cap lo hi conf [probe...]
  local secs=$1 arch=$2 quant=$3 attn=$4 cap=$5 lo=$6 hi=$7 conf=$8; shift 8
  local left=$((END - $(date +%s))); [ $left -lt 40 ] && { echo "skip $arch $conf: $left s left" | tee -a $OUT/stderr.txt; return; }
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout $left python3 benchmarks/gpu_edge.py --ckpt /dev/shm/$arch --arch $arch \
    --quant $quant --attn $attn --cap-gib $cap --lo $lo --hi $hi --out $OUT/edge.jsonl --run-seconds $secs \
    --deadline $END --probe "$@" 2>>$OUT/stderr.txt
  echo "$arch $conf done at $(( $(date +%s) - START )) s" | tee -a $OUT/stderr.txt
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia_smi.txt
build gemma-2-9b; edge 22 gemma-2-9b bf16 eager 24 4376 5545 ""; edge 22 gemma-2-9b bf16 eager 24 4376 5545 expandable_segments:True
rm -rf /dev/shm/gemma-2-9b
build qwen2.5-7b; edge 22 qwen2.5-7b bf16 sdpa 20 21581 31008 ""; edge 22 qwen2.5-7b bf16 sdpa 20 21581 31008 expandable_segments:True
rm -rf /dev/shm/qwen2.5-7b
build llama-3.1-8b; edge 70 llama-3.1-8b nf4 sdpa 24 65280 80012 expandable_segments:True 74000
rm -rf /dev/shm/llama-3.1-8b
echo "total $(( $(date +%s) - START )) s" | tee -a $OUT/stderr.txt
