#!/bin/bash
# H200 call of 2026-12-03 (session 43), from the repository root; $OUT is the device's output folder.
# stage 1 (carry .whl/a .whl/b): ERNIE-4.5-21B-A3B (4 of 28 layers), bf16, in a process that only loads its
#   checkpoint (`gpu_hybrid.py --fresh`), at 8,192 tokens (planned within 0.5% reserved) and 32,768 (planned 14.6%
#   under): each case's allocator trace from the segments at its start (`--trace`), to replay through the allocator
#   model and set beside the plan's tape (benchmarks/ernie_trace.py).
set -u
STAGE=${1:-1}
O=$OUT/s43_$STAGE; mkdir -p $O
export PYTHONPATH=/tmp/site:$PWD
for w in a b; do pip install -q --no-index --no-deps --target /tmp/site .whl/$w/*.whl 2>&1 | grep -v WARNING; done
if [ "$STAGE" = 1 ]; then
  timeout 400 python3 benchmarks/gpu_hybrid.py --archs ernie4.5-21b-a3b-4l --fresh --prompts 8192 32768 --trace \
    --out-dir $O/ernie --ckpt-dir /dev/shm/vg_s43 --plan-workers 2 > $O/ernie_log.txt 2>&1
  rm -rf /dev/shm/vg_s43
fi
# stage 2 (carry .whl/a .whl/b), the code that cuts the load's holes to its largest freed tensor: ERNIE at 16,384
#   and 32,768 tokens and Qwen3-Next (4 of 48 layers) at 16,384, each architecture in a fresh process, planned beside
#   the measurement (traces kept).
if [ "$STAGE" = 2 ]; then
  timeout 280 python3 benchmarks/gpu_hybrid.py --archs ernie4.5-21b-a3b-4l --fresh --prompts 16384 32768 --trace \
    --out-dir $O/ernie --ckpt-dir /dev/shm/vg_s43 --plan-workers 2 > $O/ernie_log.txt 2>&1
  rm -rf /dev/shm/vg_s43
  timeout 280 python3 benchmarks/gpu_hybrid.py --archs qwen3-next-4l --fresh --prompts 16384 --trace \
    --out-dir $O/qwen3next --ckpt-dir /dev/shm/vg_s43 --plan-workers 1 > $O/qwen3next_log.txt 2>&1
  rm -rf /dev/shm/vg_s43
fi
# stage 3 (carry .whl/a .whl/b): `vramguard plan` from the command line, a new process each, empty caches, the GPU
#   detected: ERNIE at 16,384 and 32,768 tokens (the cases of stage 2, to compare with their measurements) and the
#   Qwen3-Next config's first and second plan on the default cards (wall time on this image).
if [ "$STAGE" = 3 ]; then
  python3 -c "
from transformers import AutoConfig
from benchmarks.gpu_hybrid import CONFIGS, config_fields
for a in ('ernie4.5-21b-a3b-4l', 'qwen3-next-4l'):
    AutoConfig.for_model(CONFIGS[a]['model_type'], **config_fields(a, False)).save_pretrained('/tmp/cfg/' + a)
" > $O/configs.txt 2>&1
  for n in 16384 32768; do
    rm -rf /tmp/vgc; /usr/bin/time -f "ernie $n first plan: %e s wall" env VRAMGUARD_CACHE_DIR=/tmp/vgc \
      timeout 200 python3 -m vramguard plan /tmp/cfg/ernie4.5-21b-a3b-4l --quant bf16 --attn sdpa \
      --prompt-tokens $n --max-new-tokens 32 --vram 60GiB --format json > $O/cli_ernie_$n.json 2>> $O/cli_times.txt
  done
  rm -rf /tmp/vgc
  for run in first second; do
    /usr/bin/time -f "qwen3-next-4l $run plan: %e s wall" env VRAMGUARD_CACHE_DIR=/tmp/vgc \
      timeout 300 python3 -m vramguard plan /tmp/cfg/qwen3-next-4l --format json > $O/cli_qwen3next_$run.json \
      2>> $O/cli_times.txt
  done
fi
