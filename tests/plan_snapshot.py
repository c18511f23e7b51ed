"""The plans of every catalog model and every architecture of ``tests/archs.py`` (but :data:`UNSTABLE_ARCHS`),
digested to their figures: a guard that a change of the planner's structure leaves every planned byte as it was.

``python tests/plan_snapshot.py`` writes ``tests/data/plan_snapshot.json`` from the code as it is;
``python tests/plan_snapshot.py --check`` recomputes every case and prints the first figures that differ (exit 1).
``tests/test_plan_snapshot.py`` recomputes the cases and compares them to the byte.

A digest keeps every number, bool and None of the result (the estimate's components, the weights, KV cache,
forward peaks, the load, the reserve, each card's need, headroom and solved maxima, each change's need), a card by
its name, a finding by its code, level and bytes; a sentence (a note, a reason) is kept as ``"<text>"`` (present or
not), so that rewording a message does not break the guard while a figure always does.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SNAPSHOT = HERE / "data" / "plan_snapshot.json"
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

# string fields of a result that are a figure's name or kind, not a sentence
KEPT_TEXT = {"phase", "peak_phase", "code", "level", "layout", "device_map_mode", "name", "refused_by", "dtype",
             "kv_cache_dtype", "alloc_conf", "misfit_reason"}
SKIPPED = {"model", "spec", "settings_obj"}

VARIANTS = {  # name -> Settings keywords
    "default": {},
    "nf4-8192": {"quant": "nf4", "prompt_tokens": 8192},
    "bf16-8192": {"quant": "bf16", "prompt_tokens": 8192},
}
# a plan of an architecture outside the hand families replays transformers' forward on meta tensors, and its
# solvers replay it again per candidate length (seconds per case): every architecture's estimate in two formats, the
# solved plan (largest prompt, new tokens, batch, the changes) of a few that cover each kind of layer
ARCH_VARIANTS = {"nf4": {}, "bf16": {"quant": "bf16"}, "solved": {}}
SOLVED_ARCHS = ("cohere2", "deepseek_v2", "granitemoehybrid", "qwen3_next", "llama4_text")
# the caching-allocator model (a replay of transformers' forward) is slow: a few cases of each allocator setting
REPLAY_CASES = [("llama-3.2-1b", "default", ""), ("qwen2.5-0.5b", "bf16-8192", "expandable_segments:True"),
                ("gemma-2-2b", "default", "")]
ARCH_REPLAY_CASES = [("olmoe", "solved", ""), ("qwen3_next", "bf16", "expandable_segments:True")]


def digest(obj, key: str | None = None):
    """The figures of ``obj`` (see the module docstring) as JSON values."""
    from vramguard.catalog.gpus import GpuSpec
    from vramguard.settings import Settings
    from vramguard.spec import ModelSpec
    if isinstance(obj, GpuSpec):
        return obj.name
    if isinstance(obj, ModelSpec):
        return None
    if isinstance(obj, Settings):
        return {k: digest(v) for k, v in dataclasses.asdict(obj).items()}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: digest(getattr(obj, f.name), f.name) for f in dataclasses.fields(obj) if f.name not in SKIPPED}
    if isinstance(obj, enum.Enum):
        return str(obj.value)
    if isinstance(obj, dict):
        return {str(k): digest(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [digest(v) for v in obj]
        return sorted(items, key=json.dumps) if isinstance(obj, (set, frozenset)) else items
    if isinstance(obj, str):
        return obj if key is None or key in KEPT_TEXT else "<text>"
    if obj is None or isinstance(obj, (bool, int, float)):
        return obj
    return f"<{type(obj).__name__}>"


def cards():
    """The four default card sizes (8, 12, 16, 24 GiB) as given cards: no detected GPU changes a case."""
    from vramguard.catalog.gpus import DEFAULT_CARD_SIZES_GIB
    from vramguard.hardware import gpu_from_vram
    return [gpu_from_vram(f"{n}GiB") for n in DEFAULT_CARD_SIZES_GIB]


def _plan(spec, variant: dict, alloc_conf: str | None, solve: bool = True) -> dict:
    from vramguard.errors import VramguardError
    from vramguard.plan.planner import plan
    from vramguard.settings import Settings
    try:
        p = plan(spec, Settings(**variant), gpus=cards(), alloc_conf=alloc_conf, freed_before=False,
                 solve=solve)
    except VramguardError as e:  # a prompt beyond the model's context: the refusal is the figure
        return {"error": type(e).__name__, "field": getattr(e, "field", None)}
    d = digest(p)
    d["findings"] = sorted(d["findings"], key=json.dumps)
    return d


def arch_spec(model_type: str):
    """The spec of a tiny random architecture from its config alone (no weights: a config-only plan)."""
    from transformers import AutoConfig

    from archs import ARCHS
    from vramguard.spec import spec_from_config
    cfg = AutoConfig.for_model(model_type, **ARCHS[model_type]).to_dict()
    cfg.pop("transformers_version", None)
    return spec_from_config(cfg, name=model_type, source=f"tests/archs.py ({model_type})")


def catalog_cases() -> list[tuple[str, str, str | None]]:
    from vramguard.catalog.models import MODELS
    return [(m, v, None) for m in MODELS for v in VARIANTS] + REPLAY_CASES


# GPT-2's decode step is planned with 245,760 or 294,912 B of KV cache depending on which replays ran before in the
# process (a state outside vramguard's caches: clearing them does not settle it); its figures cannot be held to the
# byte until the replay is made independent of what ran before
UNSTABLE_ARCHS = ("gpt2",)


def arch_cases() -> list[tuple[str, str, str | None]]:
    from archs import ARCHS
    return ([(a, v, None) for a in sorted(ARCHS) if a not in UNSTABLE_ARCHS for v in ("nf4", "bf16")]
            + [(a, "solved", None) for a in SOLVED_ARCHS] + ARCH_REPLAY_CASES)


def case_key(kind: str, name: str, variant: str, alloc_conf: str | None) -> str:
    return f"{kind}:{name}:{variant}:" + ("formula" if alloc_conf is None else f"replay[{alloc_conf}]")


def compute_case(key: str) -> dict:
    """The digest of one case, named as :func:`case_key` names it."""
    from vramguard.resolve import resolve_model
    kind, name, variant, reserve = key.split(":", 3)
    alloc_conf = None if reserve == "formula" else reserve[len("replay["):-1]
    if kind == "catalog":
        return _plan(resolve_model(name), VARIANTS[variant], alloc_conf)
    if kind == "arch":
        return _plan(arch_spec(name), ARCH_VARIANTS[variant], alloc_conf, solve=variant == "solved")
    if kind == "multigpu":
        return _multigpu(name, variant)
    if kind == "vllm":
        return _vllm(name, variant)
    raise ValueError(key)


MULTIGPU_CASES = [("llama-3.1-8b", "device_map-2x24GiB-bf16"), ("qwen2.5-7b", "tp2-2x24GiB-bf16"),
                  ("mixtral-8x7b", "device_map-2x24GiB-nf4"), ("olmoe", "device_map-2x24GiB-bf16")]
VLLM_CASES = [("llama-3.1-8b", "h100"), ("gemma-2-9b", "rtx-4090"), ("qwen2.5-14b", "h100-tp2"),
              ("deepseek_v2", "h100")]


def _spec(name: str):
    from archs import ARCHS
    from vramguard.resolve import resolve_model
    return arch_spec(name) if name in ARCHS else resolve_model(name)


def _multigpu(name: str, variant: str) -> dict:
    from vramguard.hardware import gpu_from_vram
    from vramguard.plan.multigpu import plan_gpus
    from vramguard.settings import Settings
    layout, _, quant = variant.split("-")
    tp = 2 if layout == "tp2" else None
    p = plan_gpus(_spec(name), Settings(quant=quant), gpus=[gpu_from_vram("24GiB")] * 2, tp=tp)
    return digest(p)


def _vllm(name: str, variant: str) -> dict:
    from vramguard.engines.vllm import VllmSettings, plan_vllm
    from vramguard.hardware import gpu_from_catalog
    from vramguard.errors import VramguardError
    card, _, tp = variant.partition("-tp")
    try:
        return digest(plan_vllm(_spec(name), gpu_from_catalog(card), VllmSettings(tensor_parallel_size=int(tp or 1))))
    except VramguardError as e:  # an architecture vramguard's vLLM model does not cover: the refusal is the result
        return {"error": type(e).__name__, "field": getattr(e, "field", None)}


def all_keys() -> list[str]:
    return ([case_key("catalog", *c) for c in catalog_cases()] + [case_key("arch", *c) for c in arch_cases()]
            + [f"multigpu:{n}:{v}:formula" for n, v in MULTIGPU_CASES]
            + [f"vllm:{n}:{v}:formula" for n, v in VLLM_CASES])


QUICK_SOLVED_ARCHS = ("cohere2",)
QUICK_REPLAY = "catalog:llama-3.2-1b:default:replay[]"  # one allocator replay: a cold tape takes seconds


def quick_keys() -> list[str]:
    """The cases the test suite recomputes (under a minute of CPU): every catalog case with the reserve formula,
    one allocator replay, every architecture's NF4 estimate, one solved architecture, the multi-GPU and vLLM cases;
    ``--check`` runs all."""
    def quick(k: str) -> bool:
        kind, name, variant, reserve = k.split(":", 3)
        if reserve != "formula":
            return k == QUICK_REPLAY
        return kind != "arch" or variant == "nf4" or (variant == "solved" and name in QUICK_SOLVED_ARCHS)
    return [k for k in all_keys() if quick(k)]


def differences(want, got, path: str = "") -> list[str]:
    """The paths where two digests differ, with both values."""
    if isinstance(want, dict) and isinstance(got, dict):
        out = []
        for k in sorted(set(want) | set(got)):
            out += differences(want.get(k, "<absent>"), got.get(k, "<absent>"), f"{path}.{k}")
        return out
    if isinstance(want, list) and isinstance(got, list) and len(want) == len(got):
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in differences(a, b, f"{path}[{i}]")]
    return [] if want == got else [f"{path}: {want!r} -> {got!r}"]


def main(argv: list[str]) -> int:
    os.environ["VRAMGUARD_PLAN_CACHE"] = "0"  # computed, never read back
    sys.path.insert(0, str(HERE))
    got = {}
    for k in all_keys():
        t = time.perf_counter()
        got[k] = compute_case(k)
        print(f"{time.perf_counter() - t:6.2f} s {k}", file=sys.stderr)
    if "--check" in argv:
        want = json.loads(SNAPSHOT.read_text())
        diffs = differences(want, got)
        print("\n".join(diffs[:50]) or "every planned figure unchanged")
        return 1 if diffs else 0
    SNAPSHOT.write_text(json.dumps(got, indent=None, sort_keys=True, separators=(",", ":")).replace('},"', '},\n"')
                        + "\n")
    print(f"wrote {SNAPSHOT} ({len(got)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
