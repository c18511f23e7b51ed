#!/bin/bash
# H200 call: the GPU tests and the first-hour trial of every verb (benchmarks/gpu_first_hour.sh) at this commit.
# From the repository root, wheels of .whl/ installed in /tmp/site, PYTHONPATH=/tmp/site:$PWD.
set -u
O=$OUT/d; mkdir -p $O
python3 -c "import torch,transformers,bitsandbytes,triton;print(torch.__version__,transformers.__version__,bitsandbytes.__version__,triton.__version__)" > $O/versions.txt 2>&1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >> $O/versions.txt
( timeout 300 bash benchmarks/gpu_first_hour.sh $O/fh > $O/first_hour_log.txt 2>&1 ) &
( timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fastdecode.py 2>&1 | tail -40 > $O/pytest_gpu.txt ) &
wait
cd $OUT && tar czf d.tgz d && rm -rf d
