#!/bin/bash
# H200 call of 2026-12-03 (session 44), from the repository root; $OUT is the device's output folder.
# stage 1 (carry .whl/a .whl/b): Ctrl-C and SIGTERM on the GPU (benchmarks/gpu_interrupt.py): `vramguard run` of a
#   random Llama (16 layers, hidden 2048) interrupted while it streams, with the graph decoder (NF4 and bf16) and
#   the eager steps, each a new process; `vramguard serve` stopped by SIGTERM after one completion.
STAGE=${1:-1}
source benchmarks/gpu_stage.sh s44 "$STAGE"
if [ "$STAGE" = 1 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $O/gpu.txt 2>&1
  python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)" >> $O/gpu.txt 2>&1
  timeout 540 python3 benchmarks/gpu_interrupt.py --out-dir $O --model-dir /tmp/gi_model > $O/log.txt 2>&1
fi
# stage 2 (carry .whl/a .whl/b, now with opentelemetry-api, which fastapi 0.165 imports): the serve case alone.
if [ "$STAGE" = 2 ]; then
  timeout 300 python3 benchmarks/gpu_interrupt.py --out-dir $O --model-dir /tmp/gi_model --cases "serve, SIGTERM" \
    > $O/log.txt 2>&1
  rm -rf /tmp/gi_model
fi
