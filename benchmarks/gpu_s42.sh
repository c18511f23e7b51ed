#!/bin/bash
# H200 call of 2026-12-03 (session 42), from the repository root; $OUT is the device's output folder.
# stage 1 (carry .whl/a .whl/b), two things at once:
#  - `vramguard plan` from the command line, a new process each, empty caches, of the Falcon-H1 config the held-back
#    runs measured (benchmarks/gpu_hybrid.py's dimensions), in the two measured settings, as a user plans on this
#    machine (its GPU detected, the kernels installed here): the figures to compare with
#    results/h200_session_1202/hybrid_falcon_h1.jsonl and results/h200_hybrid3/falcon_h1_nf4_fresh.jsonl, and the wall
#    time of each first plan;
#  - Qwen3-Next (4 of 48 layers) in a process that only loads its checkpoint from disk (`gpu_hybrid.py --fresh`):
#    reserved memory as a user's process has it (the earlier record built and freed the checkpoint on the GPU first).
# stage 2 (carry .whl/a .whl/b): three MoE architectures whose experts transformers stacks at load, each in a process
#   that only loads its checkpoint (`gpu_hybrid.py --fresh`), at the lengths of gpu_hybrid.py's CASES (one beyond
#   the holes the load leaves), planned beside the measurement by the code that models those holes.
set -u
STAGE=${1:-1}
O=$OUT/s42_$STAGE; mkdir -p $O
export PYTHONPATH=/tmp/site:$PWD
if [ "$STAGE" = 2 ]; then
  for w in a b; do pip install -q --no-index --no-deps --target /tmp/site .whl/$w/*.whl 2>&1 | grep -v WARNING; done
  for arch in qwen3-next-4l ernie4.5-21b-a3b-4l qwen1.5-moe-a2.7b; do
    timeout 240 python3 benchmarks/gpu_hybrid.py --archs $arch --fresh --out-dir $O/$arch --ckpt-dir /dev/shm/vg_s42 \
      --plan-workers 3 > $O/${arch}_log.txt 2>&1
    rm -rf /dev/shm/vg_s42
  done
  exit 0
fi
for w in a b; do pip install -q --no-index --no-deps --target /tmp/site .whl/$w/*.whl 2>&1 | grep -v WARNING; done
python3 -c "import torch,transformers,bitsandbytes;print(torch.__version__,transformers.__version__,bitsandbytes.__version__)" > $O/versions.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $O/versions.txt
python3 -c "
from transformers import AutoConfig
from benchmarks.gpu_hybrid import CONFIGS, config_fields
AutoConfig.for_model('falcon_h1', **config_fields('falcon-h1-1.5b-deep', False)).save_pretrained('/tmp/falcon-h1-1.5b-deep')
" > $O/falcon_config.txt 2>&1
( timeout 500 python3 benchmarks/gpu_hybrid.py --archs qwen3-next-4l --fresh --out-dir $O/q3n_fresh \
    --ckpt-dir /dev/shm/vg_s42 --plan-workers 2 > $O/q3n_fresh_log.txt 2>&1; rm -rf /dev/shm/vg_s42 ) &
for c in "bf16 4096 64" "nf4 8192 32"; do
  set -- $c
  for run in first second; do
    [ $run = first ] && rm -rf /tmp/vgcache_$1 /tmp/vgtape_$1
    /usr/bin/time -f "$1 $2+$3 $run plan: %e s wall, %U s user" env VRAMGUARD_PLAN_CACHE=/tmp/vgcache_$1 \
      VRAMGUARD_TAPE_CACHE=/tmp/vgtape_$1 timeout 300 python3 -m vramguard plan /tmp/falcon-h1-1.5b-deep --quant $1 \
      --attn sdpa --prompt-tokens $2 --max-new-tokens $3 --vram 60GiB --format json \
      > $O/cli_falcon_${1}_$2_$run.json 2>> $O/cli_falcon_times.txt
  done
done
wait
