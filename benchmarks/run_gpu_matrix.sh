#!/usr/bin/env bash
# Runs on the GPU machine: installs the carried bitsandbytes wheel, records the transformers source that decides
# memory behaviour, then measures the matrix. Usage: bash benchmarks/run_gpu_matrix.sh OUTDIR ARCH...
set -u
out=$1; shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site
export PYTHONUNBUFFERED=1
python3 - >"$out/transformers_src.txt" 2>&1 <<'PY'
import inspect, transformers
from transformers.integrations import sdpa_attention
from transformers import cache_utils
print(transformers.__version__)
print(inspect.getsource(sdpa_attention))
print(inspect.getsource(cache_utils.DynamicLayer))
PY
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv > "$out/nvidia_smi.txt" 2>&1
python3 benchmarks/gpu_matrix.py --out "$out/matrix.jsonl" --archs "$@" 2> "$out/stderr.txt"
