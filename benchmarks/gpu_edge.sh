#!/bin/bash
# The edge runs of benchmarks/README.md ("Reserved memory and the edge"), with the allocator's trace of every run:
# random-weight checkpoints are built on the GPU, then benchmarks/gpu_edge.py runs once per (architecture, allocator
# setting) in its own process. Processes run side by side under their per-process caps, in two waves that keep the
# caps' sum under the card (112 GiB, then 52 GiB): the caching allocator is per process, so the placements do not
# depend on the neighbours, only the times do. Then `vramguard fit --max-runs 3` on a random-weight Llama-3.2-1B
# folder under a 4 GiB budget. Usage: [EDGE_BUDGET_S=245] bash benchmarks/gpu_edge.sh OUT_DIR
set -u
OUT=$1; mkdir -p $OUT; START=$(date +%s); END=$((START + ${EDGE_BUDGET_S:-245}))
X=expandable_segments:True
at() { echo "$1 at $(( $(date +%s) - START )) s" | tee -a $OUT/steps.txt; }
build() { timeout $((END - $(date +%s))) python3 -c "from benchmarks.common import build_checkpoint; \
build_checkpoint('$1', '/dev/shm/$1')" >> $OUT/build_log.txt 2>&1; at "built $1 rc=$?"; }
edge() {  # until_s arch quant attn cap_gib lo hi conf [probe...]: one gpu_edge.py process, stopped by START+until_s
  local until=$((START + $1)) arch=$2 quant=$3 attn=$4 cap=$5 lo=$6 hi=$7 conf=$8; shift 8
  [ $until -gt $END ] && until=$END
  local t=$((until - $(date +%s))) name=${arch}_${quant}_${attn}_${conf:+exp}
  [ $t -lt 30 ] && { at "skip $name: $t s left"; return; }
  PYTORCH_CUDA_ALLOC_CONF=$conf timeout $t python3 benchmarks/gpu_edge.py --ckpt /dev/shm/$arch --arch $arch \
    --quant $quant --attn $attn --cap-gib $cap --lo $lo --hi $hi --out $OUT/edge_$name.jsonl --run-seconds $t \
    --deadline $until --probe "$@" > $OUT/log_$name.txt 2>&1
  at "$name rc=$?"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/nvidia_smi.txt
build llama-3.1-8b & build qwen2.5-7b & wait
build gemma-2-9b &  # beside wave 1: 112 GiB of caps + 17 GiB of Gemma weights + contexts < 139.8 GiB
# wave 1 (caps 24 + 24 + 24 + 20 + 20 GiB)
edge 150 llama-3.1-8b nf4 sdpa 24 57344 80012 "" 65182 57344 65536 &
edge 150 llama-3.1-8b nf4 sdpa 24 77006 80012 $X 77669 78509 79260 &
edge 150 llama-3.1-8b bf16 eager 24 4096 4097 "" 4096 512 512x4 4096 &  # the matrix's order
edge 150 qwen2.5-7b bf16 sdpa 20 26294 28651 "" 26851 &
edge 150 qwen2.5-7b bf16 sdpa 20 28651 29829 $X 28664 &
wait
rm -rf /dev/shm/llama-3.1-8b /dev/shm/qwen2.5-7b
# wave 2 (caps 24 + 24 GiB, and fit's 4 GiB)
edge 245 gemma-2-9b bf16 eager 24 4376 4960 "" 4588 &
edge 245 gemma-2-9b bf16 eager 24 5166 5398 $X 5166 5252 &
( timeout $((END - $(date +%s))) python3 - >> $OUT/build_log.txt 2>&1 <<'PY'
import sys; sys.path.insert(0, ".")
from pathlib import Path
from benchmarks.common import build_checkpoint
from tests.conftest import save_word_tokenizer
from vramguard.catalog.models import MODELS
build_checkpoint("llama-3.2-1b", "/dev/shm/vg_fit")
save_word_tokenizer(Path("/dev/shm/vg_fit"), MODELS["llama-3.2-1b"]["vocab_size"])
PY
  at "built llama-3.2-1b rc=$?"; t0=$(date +%s)
  timeout $((END - $(date +%s))) python3 -m vramguard fit /dev/shm/vg_fit --vary prompt --vram-budget 4GiB \
    --max-new-tokens 16 --max-runs 3 --format json > $OUT/fit.json 2> $OUT/fit_stderr.txt
  at "fit rc=$? wall $(( $(date +%s) - t0 )) s" ) &
wait
rm -rf /dev/shm/gemma-2-9b /dev/shm/vg_fit
cat $OUT/edge_*.jsonl > $OUT/edge.jsonl
at total
