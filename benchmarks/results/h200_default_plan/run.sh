#!/bin/bash
# H200 call: the default plan's largest prompt at its default 256 new tokens, measured (Llama-3.1-8B NF4, SDPA,
# 24 GiB cap, both allocator settings, in parallel), beside the GPU tests and the first-hour trial of every verb.
# From the repository root, wheels of .whl/ installed in /tmp/site, PYTHONPATH=/tmp/site:$PWD.
set -u
O=$OUT/d; mkdir -p $O
python3 -c "import torch,transformers,bitsandbytes,triton;print(torch.__version__,transformers.__version__,bitsandbytes.__version__,triton.__version__)" > $O/versions.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $O/versions.txt
( timeout 280 bash benchmarks/gpu_first_hour.sh $O/fh > $O/first_hour_log.txt 2>&1 ) &
( timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fastdecode.py 2>&1 | tail -40 > $O/pytest_gpu.txt ) &
t0=$(date +%s)
timeout 120 python3 -c "from benchmarks.common import build_checkpoint; build_checkpoint('llama-3.1-8b', '/dev/shm/llama')" > $O/build.txt 2>&1
echo "build rc=$? $(( $(date +%s)-t0 )) s" >> $O/build.txt
left=$(( 330 - ($(date +%s)-t0) ))
( PYTORCH_CUDA_ALLOC_CONF= timeout $left python3 benchmarks/gpu_edge.py --ckpt /dev/shm/llama --arch llama-3.1-8b \
    --quant nf4 --attn sdpa --cap-gib 24 --new 256 --probe 64948 65531 --lo 65531 --hi 66048 --step 128 \
    --run-seconds $(( left - 90 )) --deadline $(( $(date +%s) + left - 15 )) --out $O/edge_default.jsonl > $O/edge_default_log.txt 2>&1 ) &
( PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout $left python3 benchmarks/gpu_edge.py --ckpt /dev/shm/llama \
    --arch llama-3.1-8b --quant nf4 --attn sdpa --cap-gib 24 --new 256 --probe 77773 78403 --lo 78403 --hi 79616 \
    --step 256 --run-seconds $(( left - 90 )) --deadline $(( $(date +%s) + left - 15 )) --out $O/edge_exp.jsonl > $O/edge_exp_log.txt 2>&1 ) &
wait
rm -rf /dev/shm/llama
mkdir -p $OUT/tr && mv $O/trace_*.json.gz $OUT/tr/ 2>/dev/null
cd $OUT && tar czf d.tgz d && rm -rf d && tar czf traces.tgz tr && rm -rf tr
