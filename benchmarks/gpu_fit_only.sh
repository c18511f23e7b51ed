#!/bin/bash
# fit under 24 GiB only (the fit steps of gpu_reserved_misses.sh): Llama-3.1-8B NF4 (64 new tokens) and
# Llama-3.2-1B NF4 (16 new tokens). Usage (GPU machine, repository root): bash benchmarks/gpu_fit_only.sh OUT_DIR
set -u
OUT=$1; mkdir -p $OUT/fit; START=$(date +%s)
at() { echo "$1 at $(( $(date +%s) - START )) s" | tee -a $OUT/steps.txt; }
build() {
  python3 -c "import sys; sys.path.insert(0, '.')
from pathlib import Path
from benchmarks.common import build_checkpoint
from tests.conftest import save_word_tokenizer
from vramguard.catalog.models import MODELS
build_checkpoint('$1', '/dev/shm/$1'); save_word_tokenizer(Path('/dev/shm/$1'), MODELS['$1']['vocab_size'])" \
    >> $OUT/build_log.txt 2>&1
  at "built $1 rc=$?"
}
fit() {  # fit ARCH NEW
  local t0=$(date +%s)
  python3 -m vramguard fit /dev/shm/$1 --vary prompt --vram-budget 24GiB --max-new-tokens $2 --max-runs 3 \
    --format json > $OUT/fit/$1.json 2> $OUT/fit/$1_stderr.txt
  at "fit $1 rc=$? wall $(( $(date +%s) - t0 )) s"
}
build llama-3.1-8b & build llama-3.2-1b & wait
fit llama-3.1-8b 64 & fit llama-3.2-1b 16 & wait
rm -rf /dev/shm/llama-3.1-8b /dev/shm/llama-3.2-1b
at total
