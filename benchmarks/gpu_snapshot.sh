#!/usr/bin/env bash
# GPU check of `vramguard profile --memory-snapshot` as a user runs it, on a small random Llama folder.
# Usage (GPU machine): bash benchmarks/gpu_snapshot.sh OUTDIR
set -u
out=$1
python3 - <<'PY'
import torch, transformers
cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=8,
                               num_key_value_heads=2, vocab_size=8000, max_position_embeddings=4096)
transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained("/dev/shm/vg_small")
PY
python3 -m vramguard profile /dev/shm/vg_small --prompt-tokens 1024 --max-new-tokens 32 --out "$out/prof" \
  --memory-snapshot > "$out/profile.txt" 2>&1
echo "exit $?" >> "$out/profile.txt"
ls -la "$out/prof" >> "$out/profile.txt"
