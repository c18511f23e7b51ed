"""Tensor parallelism as transformers really loads it, on the CPU: ``from_pretrained(tp_plan="auto")`` in 2 processes
over a gloo process group (torch.multiprocessing), on tiny random checkpoints of several architectures, against
vramguard's per-rank shards (``vramguard.plan.multigpu.tensorparallel.tp_shards``).

Per architecture and rank: every parameter's local shape after loading, the bytes the rank holds, and the shape of
the logits of one forward (gathered whole by ``lm_head``'s ``colwise_gather_output``). The CI test
(``tests/test_multigpu.py``) makes the same comparison with transformers' tensor-parallel code on meta tensors under
a fake process group, which needs no second process; this script is the slower check on real loads.

    python benchmarks/cpu_tp_gloo.py OUTDIR        # about a minute on 2 cores
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SMALL = dict(hidden_size=64, intermediate_size=100, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=301, max_position_embeddings=512)
ARCHS = {
    "llama": dict(SMALL),
    "qwen2": dict(SMALL),  # q/k/v biases
    "qwen3": dict(SMALL, head_dim=16),  # q/k norms
    # fused experts; an intermediate of 128 (64 per rank): torch's CPU grouped_mm needs 16-byte strides
    "mixtral": dict(SMALL, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "phi3": dict(SMALL, pad_token_id=0),  # fused qkv and gate_up
}
WORLD = 2


def _rank(rank: int, folders: dict, port: int, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    result = {}
    for name, folder in folders.items():
        m = AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto", dtype=torch.bfloat16)
        shapes = {n: list(p.to_local().shape if isinstance(p, DTensor) else p.shape) for n, p in m.named_parameters()}
        try:
            with torch.no_grad():
                logits = list(m(torch.tensor([[1, 2, 3]])).logits.shape)
        except RuntimeError as e:  # recorded, not fatal: the shapes are what is compared
            logits = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        result[name] = {"shapes": shapes, "logits_shape": logits}
        del m
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def main():
    import transformers

    from vramguard.plan.multigpu.tensorparallel import tp_shards
    from vramguard.settings import Settings
    from vramguard.spec import spec_from_config
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/tp_gloo"
    os.makedirs(out, exist_ok=True)
    tmp = tempfile.mkdtemp()
    folders, configs = {}, {}
    for name, kw in ARCHS.items():
        cfg = transformers.AutoConfig.for_model(name, **kw)
        torch.manual_seed(0)
        folders[name] = os.path.join(tmp, name)
        transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(folders[name])
        configs[name] = {"model_type": name, **kw}
    mp.spawn(_rank, args=(folders, 29000 + os.getpid() % 1000, tmp), nprocs=WORLD)
    loaded = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(WORLD)]
    rows = []
    for name in ARCHS:
        mine = tp_shards(spec_from_config(configs[name], name=name), Settings(quant="bf16"), WORLD)
        for r in range(WORLD):
            theirs = {k: tuple(v) for k, v in loaded[r][name]["shapes"].items()}
            rows.append({"arch": name, "rank": r, "parameters": len(theirs),
                         "shapes_equal": theirs == mine.shapes[r],
                         "differing": sorted(k for k in theirs if theirs[k] != mine.shapes[r].get(k)),
                         "logits_shape": loaded[r][name]["logits_shape"], "vramguard_rank_bytes": mine.weight_bytes[r],
                         "transformers": transformers.__version__, "torch": torch.__version__})
    with open(os.path.join(out, "results.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row))


if __name__ == "__main__":
    main()
