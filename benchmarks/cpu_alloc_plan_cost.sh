#!/usr/bin/env bash
# The CPU cost of the allocator model in `plan`, in a fresh process: the formula plan (`--alloc-conf formula`), the
# default plan (the allocator model) with an empty tape cache (cold) and with the tapes of the first plan on disk
# (warm), each twice, for 256 and 64 new tokens.
# Prints one line per run: the 1-minute load average before it, wall and user CPU seconds from /usr/bin/time.
# Usage: bash benchmarks/cpu_alloc_plan_cost.sh [MODEL ARGS...]   (default: Llama-3.1-8B NF4, 24 GiB, 4,096 tokens)
# PYTORCH_CUDA_ALLOC_CONF is unset for the runs (the default plan models the allocator of its environment).
set -u
args=("$@")
[ ${#args[@]} -eq 0 ] && args=(llama-3.1-8b --quant nf4 --vram 24GiB --prompt-tokens 4096)
cache=$(mktemp -d)
export VRAMGUARD_CACHE_DIR=$cache
unset PYTORCH_CUDA_ALLOC_CONF PYTORCH_ALLOC_CONF
for new in 256 64; do
  for what in formula cold warm formula cold warm; do
    extra=()
    case $what in formula) extra=(--alloc-conf formula);; cold) rm -rf "$cache/tapes";; esac
    load=$(cut -d' ' -f1 /proc/loadavg)
    /usr/bin/time -f "new=$new $what load=$load %e s wall %U s user" \
      python -m vramguard plan "${args[@]}" --max-new-tokens $new "${extra[@]}" 2>&1 >/dev/null | tail -1
  done
done
rm -rf "$cache"
