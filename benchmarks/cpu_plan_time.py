"""The generic plan's cost on the CPU: need evaluations, replays of transformers' forward and CPU seconds of one
``vramguard plan`` (the estimate, the card solvers and the ranked changes) for tiny random models of
tests/archs.py and a DeepSeek-V2-Lite-sized config.json, with every card's solved values (which must not change
when the solver gets faster).

    python benchmarks/cpu_plan_time.py --out benchmarks/results/cpu_plan_time/after.jsonl

``--wall``: what a person waits for instead: the wall time of ``vramguard plan`` in a new process, for a catalog
name, a hand family's folder and two other architectures, each the first time (empty plan and tape caches) and the
second (what the first kept), with the CPU seconds of the process (user + system: less sensitive to other work on
the machine than the wall time), the machine's load average and the SHA-256 of what each printed (the second
must print what the first did).

    python benchmarks/cpu_plan_time.py --wall --out benchmarks/results/cpu_plan_time/wall.jsonl

``--hand``: only the catalog name and the hand family's folder; ``--repeat N``: each case N times (fresh caches
each time), for the minimum and the median on a shared machine.

    python benchmarks/cpu_plan_time.py --wall --hand --repeat 3 --out benchmarks/results/cpu_plan_time/wall_fast.jsonl

``--generic``: the four non-family architectures instead (DeepSeek-V2-Lite's size on an 80 GiB card, tiny OLMoE on
the default cards, and ``gpu_hybrid.py``'s Falcon-H1-1.5B-Deep config, attention and Mamba-2 side by side, and
Qwen3-Next config of 4 of its 48 layers, gated DeltaNet and a 512-expert MoE), their
config folders written under ``--models DIR`` (the same paths before and after a change, so that the plans' output
hashes compare) and planned by the vramguard of ``--root`` (default: this checkout; an export of an older commit for
a "before"):

    python benchmarks/cpu_plan_time.py --wall --generic --models /tmp/generic --out generic.jsonl

``--cases`` picks some of them by folder name (``dsv2lite``, ``olmoe``, ``falcon-h1-1.5b-deep``); ``--repeat N`` plans
each N times, and ``--root`` given more than once plans each case with each checkout in turn (before and after
interleaved, so that a change of the machine's load falls on both alike):

    python benchmarks/cpu_plan_time.py --wall --generic --cases dsv2lite,olmoe --repeat 3 \
        --root /tmp/base --root . --models /tmp/generic --out generic.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# DeepSeek-V2-Lite's config.json fields (deepseek-ai/DeepSeek-V2-Lite): 27 layers, MLA, 64 routed experts
DSV2_LITE = {"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 2048,
             "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
             "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64, "n_shared_experts": 2,
             "num_experts_per_tok": 6, "first_k_dense_replace": 1, "kv_lora_rank": 512, "q_lora_rank": None,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
             "max_position_embeddings": 163840, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
             "routed_scaling_factor": 1.0, "rms_norm_eps": 1e-6, "rope_theta": 10000,
             "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def measure(model: str, vram: str | None) -> dict:
    """One plan in this process (a fresh process per case: nothing memoized before it)."""
    from vramguard.introspect import generic
    from vramguard.plan import estimator, planner
    calls = {"need": 0}
    peak = estimator._peak

    def counted(spec, s):
        calls["need"] += 1
        return peak(spec, s)
    estimator._peak = counted
    t0 = time.process_time()
    p = planner.plan(model, vram=vram)
    cpu_s = time.process_time() - t0
    return {"need_evaluations": calls["need"], "replays": generic._replayed.cache_info().misses,
            "cpu_s": round(cpu_s, 2),
            "cards": [[c.gpu.name, c.max_prompt_tokens, c.max_new_tokens, c.max_batch] for c in p.cards],
            "changes": [[c.description, c.need_bytes] for c in p.changes]}


def _timed_plan(args: list[str], cache: Path, root: Path = ROOT) -> dict:
    """One ``vramguard plan ARGS`` in a new process with its plan and tape caches in ``cache``: wall seconds, exit
    code, load average before it, and the SHA-256 of its stdout."""
    import hashlib
    import os
    import resource
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}  # as an install: .pyc files
    env.update(PYTHONPATH=str(root), VRAMGUARD_PLAN_CACHE=str(cache / "plans"), VRAMGUARD_TAPE_CACHE=str(cache /
                                                                                                      "tapes"),
               VRAMGUARD_CACHE_DIR=str(cache))  # nothing kept anywhere else either
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "vramguard", "plan", *args], capture_output=True, env=env, cwd=root)
    wall_s = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"wall_s": round(wall_s, 2), "cpu_s": round(cpu_s, 2), "exit": r.returncode,
            "load_avg_1min": round(load, 2), "stdout_sha256": hashlib.sha256(r.stdout).hexdigest()[:16]}


def wall(out: str, hand: bool = False, repeat: int = 1) -> None:
    """The ``--wall`` cases (see the module docstring), written to ``out`` one JSON object a line."""
    import subprocess
    from vramguard.catalog.models import MODELS
    tmp = Path(tempfile.mkdtemp())
    subprocess.run([sys.executable, "-m", "vramguard", "--help"], capture_output=True, check=True)  # .pyc written
    folder = tmp / "llama-3.1-8b-folder"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({k: v for k, v in MODELS["llama-3.1-8b"].items()
                                                    if k != "source"}))
    (tmp / "dsv2lite").mkdir()
    (tmp / "dsv2lite" / "config.json").write_text(json.dumps(DSV2_LITE))
    sys.path.insert(0, str(ROOT / "tests"))
    from archs import ARCHS
    from transformers import AutoConfig
    AutoConfig.for_model("olmoe", **ARCHS["olmoe"]).save_pretrained(tmp / "olmoe")
    cases = [("catalog name", ["llama-3.1-8b", "--prompt-tokens", "8192"]),
             ("hand-family folder", [str(folder), "--prompt-tokens", "8192"]),
             ("non-family: DeepSeek-V2-Lite size", [str(tmp / "dsv2lite"), "--vram", "80GiB"]),
             ("non-family: tiny OLMoE", [str(tmp / "olmoe")])][:2 if hand else 4]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for i, (name, args) in ((i, c) for _ in range(repeat) for i, c in enumerate(cases)):
            cache = Path(tempfile.mkdtemp(dir=tmp))
            for when in ("first", "second"):
                rec = {"case": name, "when": when, "args": ["vramguard", "plan", *args[:1], *args[1:]],
                       **_timed_plan(args, cache / f"cache{i}")}
                rec["args"][2] = Path(rec["args"][2]).name if "/" in rec["args"][2] else rec["args"][2]
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")


def generic_cases(models: Path) -> list[tuple[str, list[str]]]:
    """The ``--generic`` cases, their config folders written under ``models``."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from archs import ARCHS
    from gpu_hybrid import CONFIGS
    from transformers import AutoConfig
    for name, fields in (("dsv2lite", DSV2_LITE), ("falcon-h1-1.5b-deep", {
            k: v for k, v in CONFIGS["falcon-h1-1.5b-deep"].items() if k != "source"})):
        (models / name).mkdir(parents=True, exist_ok=True)
        (models / name / "config.json").write_text(json.dumps(fields))
    from gpu_hybrid import config_fields
    AutoConfig.for_model("olmoe", **ARCHS["olmoe"]).save_pretrained(models / "olmoe")
    AutoConfig.for_model("qwen3_next", **config_fields("qwen3-next-4l", False)).save_pretrained(models / "qwen3-next-4l")
    return [("non-family: DeepSeek-V2-Lite size", [str(models / "dsv2lite"), "--vram", "80GiB"]),
            ("non-family: tiny OLMoE", [str(models / "olmoe")]),
            ("non-family: Falcon-H1-1.5B-Deep size", [str(models / "falcon-h1-1.5b-deep")]),
            ("non-family: Qwen3-Next-80B-A3B, 4 of 48 layers", [str(models / "qwen3-next-4l")])]


def wall_generic(out: str, models: Path, roots: list[Path], save_json: Path | None = None, cases: str | None = None,
                 repeat: int = 1) -> None:
    """The ``--generic`` cases (see the module docstring), first and second plan each, ``repeat`` times, with each
    checkout of ``roots`` in turn, written to ``out``; ``save_json``: each plan's ``--format json`` output saved
    there (``<folder name>.json``, the last root's)."""
    import subprocess
    for root in roots:
        subprocess.run([sys.executable, "-m", "vramguard", "--help"], capture_output=True, check=True, cwd=root,
                       env={**os.environ, "PYTHONPATH": str(root)})  # .pyc files written
    caches = Path(tempfile.mkdtemp())
    chosen = [c for c in generic_cases(models) if cases is None or Path(c[1][0]).name in cases.split(",")]
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for n, ((name, args), root) in enumerate((c, r) for _ in range(repeat) for c in chosen for r in roots):
            cache = caches / f"cache{n}"
            for when in ("first", "second"):
                rec = {"case": name, "when": when, "args": ["vramguard", "plan", Path(args[0]).name, *args[1:]],
                       "root": root.name, **_timed_plan(args, cache, root)}
                print(json.dumps(rec), flush=True)
                f.write(json.dumps(rec) + "\n")
            if save_json is not None:  # the plan kept by the first, as JSON (read from the cache: no replay)
                env = {**os.environ, "PYTHONPATH": str(root), "VRAMGUARD_PLAN_CACHE": str(cache / "plans"),
                       "VRAMGUARD_TAPE_CACHE": str(cache / "tapes"), "VRAMGUARD_CACHE_DIR": str(cache)}
                r = subprocess.run([sys.executable, "-m", "vramguard", "plan", *args, "--format", "json"],
                                   capture_output=True, env=env, cwd=root, check=True)
                save_json.mkdir(parents=True, exist_ok=True)
                (save_json / f"{Path(args[0]).name}.json").write_bytes(r.stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--case", help="internal: run one case in this process")
    ap.add_argument("--wall", action="store_true", help="wall time of vramguard plan in new processes")
    ap.add_argument("--hand", action="store_true", help="with --wall: the catalog name and hand-family folder only")
    ap.add_argument("--repeat", type=int, default=1, help="with --wall: each case this many times (--generic too)")
    ap.add_argument("--generic", action="store_true", help="with --wall: the four non-family architectures")
    ap.add_argument("--models", help="with --generic: the folder of their configs (default: a new one)")
    ap.add_argument("--root", action="append", help="with --generic: the vramguard checkout to run (default: this "
                                                    "one); given again, each in turn")
    ap.add_argument("--cases", help="with --generic: the cases to run, by folder name (dsv2lite,olmoe,...)")
    ap.add_argument("--save-json", help="with --generic: save each plan's --format json output in this folder")
    args = ap.parse_args()
    if args.wall and args.generic:
        return wall_generic(args.out, Path(args.models or tempfile.mkdtemp()),
                            [Path(r).resolve() for r in args.root or [ROOT]],
                            Path(args.save_json) if args.save_json else None, args.cases, args.repeat)
    if args.wall:
        return wall(args.out, args.hand, args.repeat)
    if args.case:
        model, _, vram = args.case.partition("@")
        print(json.dumps(measure(model, vram or None)))
        return
    import subprocess
    sys.path.insert(0, str(ROOT / "tests"))
    from archs import ARCHS
    from transformers import AutoConfig
    tmp = Path(tempfile.mkdtemp())
    cases = []
    for t in ("deepseek_v2", "qwen3_next", "olmoe", "bloom"):
        AutoConfig.for_model(t, **ARCHS[t]).save_pretrained(tmp / t)
        cases.append((t, str(tmp / t / "config.json"), None))
    (tmp / "dsv2lite").mkdir()
    (tmp / "dsv2lite" / "config.json").write_text(json.dumps(DSV2_LITE))
    cases.append(("DeepSeek-V2-Lite size", str(tmp / "dsv2lite" / "config.json"), "80GiB"))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for name, path, vram in cases:
            r = subprocess.run([sys.executable, __file__, "--out", args.out, "--case", f"{path}@{vram or ''}"],
                               capture_output=True, text=True, check=True)
            rec = {"case": name, "vram": vram, **json.loads(r.stdout.strip().splitlines()[-1])}
            print(json.dumps(rec)[:300], flush=True)
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
