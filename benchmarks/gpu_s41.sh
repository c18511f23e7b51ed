#!/bin/bash
# H200 calls of 2026-12-02 (session 41), from the repository root; $OUT is the device's output folder.
#   call 1 (carry .gguf/smol.part00 .whl/a): the register table check, imports, run on the 8B NF4 folder twice
#   call 2 (carry .gguf/smol.part01 .whl/b): SmolLM2 built from the GGUF, run on it twice, every verb's wall time
#   call 3: the quality table at 2,048 tokens (every path) beside the GPU tests
#   call 4 (a fresh machine; carry .whl/a .whl/b .whl/c .gguf/smolcfg): serve from the command line on a random-weight
#     folder of SmolLM2's config and tokenizer (memory and time do not depend on the weights' values), the GPU
#     tests of serve, and a profile of run's start
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
4)
  for w in a b c; do pip install -q --no-index --no-deps --target /tmp/site .whl/$w/*.whl 2>&1 | grep -v WARNING; done
  python3 -c "import torch,transformers,bitsandbytes,triton,fastapi;print(torch.__version__,transformers.__version__,bitsandbytes.__version__,triton.__version__,fastapi.__version__)" > $O/versions.txt 2>&1
  python3 - <<'PY' > $O/build.txt 2>&1
import shutil, torch
from transformers import AutoConfig, AutoModelForCausalLM
cfg = AutoConfig.from_pretrained(".gguf/smolcfg")
with torch.device("cuda"):
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
m.save_pretrained("/tmp/smolrand")
for f in ("chat_template.jinja", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
    shutil.copy(f".gguf/smolcfg/{f}", "/tmp/smolrand/")
print("built /tmp/smolrand")
PY
  python3 - <<'PY' > $O/serve_times.txt 2>&1
import json, os, signal, subprocess, sys, time, urllib.request
sys.path.insert(0, "benchmarks")
t0 = time.perf_counter()
p = subprocess.Popen([sys.executable, "-m", "vramguard", "serve", "/tmp/smolrand", "--port", "8391"],
                     stdout=open(os.environ["OUT"] + "/s41_4/serve_log.txt", "w"), stderr=subprocess.STDOUT)
ready = None
while time.perf_counter() - t0 < 240 and p.poll() is None:
    try:
        urllib.request.urlopen("http://127.0.0.1:8391/health", timeout=1).read()
        ready = time.perf_counter() - t0
        break
    except Exception:
        time.sleep(0.1)
body = json.dumps({"model": "smolrand", "max_tokens": 64, "temperature": 0,
                   "messages": [{"role": "user", "content": "Write one sentence about why the sky is blue."}]}).encode()
t1 = time.perf_counter()
try:
    r = urllib.request.urlopen(urllib.request.Request("http://127.0.0.1:8391/v1/chat/completions", body,
                                                      {"content-type": "application/json"}), timeout=60).read()
    answer = json.loads(r)["usage"]
except Exception as e:
    answer = repr(e)
t2 = time.perf_counter()
p.send_signal(signal.SIGTERM)
rc = p.wait(timeout=60)
t3 = time.perf_counter()
print(json.dumps({"ready_s": ready, "completion_s": round(t2 - t1, 3), "sigterm_to_exit_s": round(t3 - t2, 3),
                  "exit": rc, "usage": answer}))
PY
  cat $O/serve_times.txt
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tail -5 > $O/pytest_gpu.txt
  timeout 60 python3 benchmarks/gpu_compile_threads.py > $O/compile_threads.txt 2>&1
  python3 -m cProfile -o $O/run.prof -m vramguard run /tmp/smolrand --prompt hi --max-new-tokens 4 --quant nf4 \
    > $O/run_profiled.txt 2>&1
  ;;
esac
ls -la $O
