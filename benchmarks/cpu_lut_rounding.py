"""What the CUDA register lookup's rounding of the NF4 table costs on the whole real model, on the CPU.

:func:`vramguard.run.kernels.nf4.lut_asm` holds the 16 NF4 values as bfloat16 (the byte permutes move 16-bit
values), so on CUDA the fused step and the "lut" GEMM multiply the block scale by ``bfloat16(code)`` where
bitsandbytes' dequantize multiplies by the float32 code. Triton's interpreter cannot run that PTX, and the
interpreted fused step is too slow for the 30 layers, so this replaces every bitsandbytes 4-bit layer of the NF4 model
(double quant, float32 compute) by a plain linear layer whose weight is
:func:`vramguard.run.kernels.nf4.reference_dequantize` of the same packed bytes and scales with the exact table, the
table rounded to bfloat16 (the lookup) and to float16, and scores each teacher-forced over the text
(``benchmarks/quality.py``'s method, one forward) against bitsandbytes' own forward. Float32 activations: the table
is the only difference.

    python3 benchmarks/cpu_lut_rounding.py MODEL_DIR OUT_DIR [--tokens 512]     # SmolLM2: 4 to 8 min on 2 cores

writes ``OUT_DIR/lut_rounding.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def dequantized_copy(module, code):
    """A ``torch.nn.Linear`` whose weight is the bitsandbytes 4-bit ``module``'s, dequantized with ``code``."""
    from vramguard.run.kernels.nf4 import reference_dequantize
    qs = module.weight.quant_state
    scales = (qs.absmax, qs.state2.absmax, qs.state2.code, torch.as_tensor(qs.offset).float()) if qs.nested \
        else (qs.absmax,)
    w = reference_dequantize(module.weight.data, qs.shape, qs.blocksize, code, *scales)
    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=module.bias is not None)
    lin.weight.data = w
    if module.bias is not None:
        lin.bias.data = module.bias.data.float()
    return lin


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from benchmarks import quality as Q
    from vramguard.run.kernels.nf4 import code_table
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--tokens", type=int, default=512)
    a = ap.parse_args(argv)
    ids = Q.text_ids(AutoTokenizer.from_pretrained(a.model), a.tokens)
    model, _ = Q.load_models(a.model, "cpu", torch.float32, None, need_bf16=False)
    ref = Q.forward_scores(model, ids)
    layers = [(n, m) for n, m in model.named_modules() if getattr(getattr(m, "weight", None), "quant_state", None)
              is not None]
    exact = code_table(layers[0][1].weight.quant_state.quant_type, "cpu")
    rows = {"bnb_nf4": {"perplexity": ref.perplexity}}
    for name, code in (("exact table", exact), ("bfloat16 table (CUDA lookup)", exact.to(torch.bfloat16).float()),
                       ("float16 table", exact.half().float())):
        for n, m in layers:
            parent, attr = n.rsplit(".", 1)
            setattr(model.get_submodule(parent), attr, dequantized_copy(m, code))
        s = Q.forward_scores(model, ids)
        rows[name] = {"perplexity": s.perplexity, "max_abs_table_error": float((code - exact).abs().max()),
                      **Q.compare(s, ref)}
        print(name, rows[name], file=sys.stderr, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lut_rounding.json").write_text(json.dumps({"model": a.model, "tokens": len(ids), "rows": rows},
                                                      indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
