#!/bin/bash
# Final verification call A: Gemma-2-9B edge run at the planned 4,590 (background), GPU pytest, serve benchmark.
set -u
O=$OUT/a; mkdir -p $O
git log --oneline -1 > $O/versions.txt 2>&1; python3 -c "import torch,transformers,bitsandbytes,triton;print(torch.__version__,transformers.__version__,bitsandbytes.__version__,triton.__version__)" >> $O/versions.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $O/versions.txt
( t0=$(date +%s); timeout 100 python3 -c "from benchmarks.common import build_checkpoint; build_checkpoint('gemma-2-9b', '/dev/shm/gemma-2-9b')" > $O/gemma_build.txt 2>&1
  echo "build rc=$? $(( $(date +%s)-t0 )) s" >> $O/gemma_build.txt
  timeout 150 python3 benchmarks/gpu_edge.py --ckpt /dev/shm/gemma-2-9b --arch gemma-2-9b --quant bf16 --attn eager \
    --cap-gib 24 --lo 4588 --hi 4774 --step 24 --probe 4590 --run-seconds 110 --deadline $(( $(date +%s) + 145 )) \
    --out $O/edge_gemma.jsonl > $O/edge_gemma_log.txt 2>&1
  echo "edge rc=$? $(( $(date +%s)-t0 )) s" >> $O/gemma_build.txt; rm -rf /dev/shm/gemma-2-9b ) &
( timeout 280 bash benchmarks/gpu_first_hour.sh $O/fh > $O/first_hour_log.txt 2>&1 ) &
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fastdecode.py 2>&1 | tail -40 > $O/pytest_gpu.txt
wait
timeout 200 python3 benchmarks/gpu_serve.py --out $O/s --repeat 3 --skip seq,burst,big,serve_greedy 2>&1 | tail -60 > $O/serve_log.txt
mkdir -p $OUT/tr && mv $O/trace_*.json.gz $OUT/tr/ 2>/dev/null
cd $OUT && tar czf a.tgz a && rm -rf a && tar czf traces.tgz tr && rm -rf tr
