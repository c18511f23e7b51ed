#!/usr/bin/env bash
# A new user's first hour on a GPU: every verb of the CLI on a random-weight folder of a catalog architecture
# (ARCH, default llama-3.2-1b; bf16 weights, a word-level tokenizer with a chat template), as the README shows
# them. Each command's exit code, wall time and
# stderr are recorded; stderr is searched for library noise (warnings that are not vramguard's).
# Usage (GPU machine, repository root): [ARCH=llama-3.1-8b] [ONLY="run fit"] [STEP_TIMEOUT=150] [SERVE_BUDGET=24GiB]
#   bash benchmarks/gpu_first_hour.sh OUTDIR
set -u
out=$1; m=/tmp/vg_first_hour; mkdir -p "$out"
ARCH=${ARCH:-llama-3.2-1b} python3 - <<'PY'
import os, sys; sys.path.insert(0, ".")
from benchmarks.common import build_checkpoint
from tests.conftest import save_word_tokenizer
from pathlib import Path
from transformers import AutoTokenizer
from vramguard.catalog.models import MODELS
arch = os.environ["ARCH"]
build_checkpoint(arch, "/tmp/vg_first_hour")
save_word_tokenizer(Path("/tmp/vg_first_hour"), MODELS[arch]["vocab_size"])
tok = AutoTokenizer.from_pretrained("/tmp/vg_first_hour")
tok.chat_template = ("{% for m in messages %}[BOS] {{ m['role'] }} {{ m['content'] }} [EOS] {% endfor %}"
                     "{% if add_generation_prompt %}[BOS] assistant {% endif %}")
tok.save_pretrained("/tmp/vg_first_hour")
PY
vg="python3 -m vramguard"
[ -n "${ONLY:-}" ] && skip() { [[ " $ONLY " != *" $1 "* ]]; } || skip() { false; }
step() {  # step NAME CMD...: run a verb (unless ONLY names others), keep stdout/stderr, exit code and ms
  local name=$1; shift
  skip "$name" && return
  local t0=$(date +%s%N)
  timeout "${STEP_TIMEOUT:-150}" "$@" > "$out/$name.out" 2> "$out/$name.err"; local rc=$?
  local ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  printf '%-10s rc=%-3s %7d ms  %s\n' "$name" "$rc" "$ms" "$*" >> "$out/summary.txt"
}
step plan    $vg plan $m --prompt-tokens 32768
step check   $vg check $m
step run     $vg run $m --prompt "Hello" --max-new-tokens 16 --vram-budget 24GiB
python3 -c "print(' '.join(f'w{i % 5000}' for i in range(30000)))" > /tmp/vg_long_prompt.txt
step runlong $vg run $m --prompt-file /tmp/vg_long_prompt.txt --raw --max-new-tokens 16 --vram-budget 24GiB
step profile $vg profile $m --prompt-tokens 4096 --max-new-tokens 16 --out "$out/prof"
step fit     $vg fit $m --vary prompt --vram-budget 24GiB --max-new-tokens 16 --max-runs 3
step explain $vg explain "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.64 GiB of which 1.2 GiB is free."
serve_once() {  # serve_once NAME ARGS...: start the server, one chat request by the served name, Ctrl-C, wait
  local name=$1; shift
  skip "$name" && return
  local t0=$(date +%s%N)
  ( $vg serve $m --port 8765 --vram-budget ${SERVE_BUDGET:-24GiB} "$@" > "$out/$name.out" 2> "$out/$name.err" & echo $! > "$out/$name.pid" )
  for i in $(seq 1 120); do
    curl -sf localhost:8765/health > /dev/null && break
    kill -0 "$(cat "$out/$name.pid")" 2> /dev/null || break  # the server exited: its stderr says why
    sleep 1
  done
  local ready_ms=$(( ($(date +%s%N) - t0) / 1000000 ))
  local served=$(curl -s localhost:8765/v1/models | python3 -c "import json,sys; print(json.load(sys.stdin)['data'][0]['id'])" 2> /dev/null)
  curl -s localhost:8765/v1/chat/completions -H 'content-type: application/json' \
    -d "{\"model\":\"$served\",\"messages\":[{\"role\":\"user\",\"content\":\"Hello\"}],\"max_tokens\":16}" \
    > "$out/${name}_chat.json"
  curl -s localhost:8765/health > "$out/${name}_health.json"
  kill -INT "$(cat "$out/$name.pid")"
  for i in $(seq 1 30); do kill -0 "$(cat "$out/$name.pid")" 2> /dev/null || break; sleep 1; done
  printf '%-10s ready=%-6s ms  %s\n' "$name" "$ready_ms" "serve $* (health: $(head -c 200 "$out/${name}_health.json"))" \
    >> "$out/summary.txt"
  echo "$name chat: $(head -c 300 "$out/${name}_chat.json")" >> "$out/summary.txt"
}
serve_once serve
serve_once servegen --engine generate
grep -HniE "warning|deprecat|traceback" "$out"/*.err > "$out/noise.txt" || echo "no warning, deprecation or traceback on stderr" > "$out/noise.txt"
cat "$out/summary.txt" "$out/noise.txt"
rm -rf "$m"
