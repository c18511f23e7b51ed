"""The runtime's spine: one loaded-model handle, one device-memory module, one dtype table, the layout rules
(functions under 80 lines, files under 600, no import cycle, no attribute set on another library's objects)."""

from __future__ import annotations

import ast
import collections
import functools
from pathlib import Path

import pytest

from vramguard.settings import Settings
from vramguard.plan.choice import choose

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vramguard"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=256)


@functools.cache
def _tree(path: Path) -> ast.Module:
    """The parsed source of ``path``, once per test session (the layout tests read every module)."""
    return ast.parse(path.read_text())


def _sources() -> dict[str, Path]:
    out = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _import_graph() -> dict[str, set[str]]:
    """Module -> the vramguard modules it imports, at module level or inside a function (TYPE_CHECKING blocks
    left out); importing ``a.b.c`` also runs ``a/b/__init__``, so a parent package that is not the importer's own
    counts too."""
    mods = _sources()
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for mod, path in mods.items():
        tree = _tree(path)
        skip = {id(n) for node in ast.walk(tree)
                if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) for n in ast.walk(node)}
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(pkg.split(".")[:len(pkg.split(".")) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for name in names:
                if name not in mods or name == mod:
                    continue
                graph[mod].add(name)
                parts = name.split(".")
                for i in range(2, len(parts)):
                    parent = ".".join(parts[:i])
                    if parent in mods and not f"{mod}.".startswith(f"{parent}."):
                        graph[mod].add(parent)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[set[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(comp)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    assert _cycles(_import_graph()) == []


def test_plan_solve_findings_and_load_check_import_one_way():
    g = _import_graph()
    assert "vramguard.plan" not in g["vramguard.plan.solve"] | g["vramguard.plan.findings"]
    assert not any(m.startswith("vramguard.runtime") for m in g["vramguard.probe.env"] | g["vramguard.probe.kernels"]
                   | g["vramguard.probe.checkpoint"])
    assert "vramguard.check" not in g["vramguard.runtime.load"]


def test_no_function_over_80_lines_and_no_file_over_600():
    long = []
    for mod, path in _sources().items():
        text = path.read_text()
        assert len(text.splitlines()) <= 600, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                long.append(f"{mod}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long == []


def test_no_attribute_is_set_on_another_librarys_object():
    """vramguard keeps what it knows about a model in its handle, never as ``obj._vramguard_*``."""
    found = []
    for mod, path in _sources().items():
        for node in ast.walk(_tree(path)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            found += [f"{mod}:{node.lineno}" for t in targets if isinstance(t, ast.Attribute)
                      and t.attr.startswith("_vramguard")]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("setattr", "getattr", "hasattr") \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) \
                    and str(node.args[1].value).startswith("_vramguard"):
                found.append(f"{mod}:{node.lineno}")
    assert found == []


def test_one_definition_of_each_memory_rule():
    from vramguard.run import generate as G
    from vramguard.runtime import device
    from vramguard.serve import _compat, engine, server
    assert G.usable_bytes is device.usable_bytes and G.is_oom is device.is_oom and G.memory_cap is device.memory_cap
    assert engine.is_oom is device.is_oom
    for mod in (_compat, server):  # they import the rule where they use it
        assert "vramguard.runtime.device import" in Path(mod.__file__).read_text()
        assert "def is_oom" not in Path(mod.__file__).read_text()
        assert "set_per_process_memory_fraction" not in Path(mod.__file__).read_text()


def test_is_oom_knows_the_allocation_failures_of_cuda_cublas_and_cudnn():
    import torch

    from vramguard.runtime.device import is_oom
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    # NCCL's CUDACHECK on its buffers, as torch.distributed raises it (DistBackendError is a RuntimeError)
    assert is_oom(RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error (run with "
                               "NCCL_DEBUG=INFO for details), NCCL version 2.21.5\nLast error:\nCuda failure "
                               "'out of memory'"))
    assert is_oom(RuntimeError("include/alloc.h:114 NCCL WARN Cuda failure 2 'out of memory'"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED"))
    assert not is_oom(ValueError("CUDA out of memory"))  # only errors PyTorch raises for it


def test_the_dtype_table_is_one():
    from vramguard.introspect import build
    from vramguard.settings import TORCH_DTYPE_NAMES, short_dtype
    assert build.TORCH_DTYPES is TORCH_DTYPE_NAMES
    import torch
    assert [short_dtype(x) for x in (torch.bfloat16, "torch.float16", "float32", "half", "float", "bf16")] == [
        "bf16", "fp16", "fp32", "fp16", "fp32", "bf16"]
    assert short_dtype(torch.int8) is None and short_dtype(None) is None
    for short, name in TORCH_DTYPE_NAMES.items():
        assert short_dtype(getattr(torch, name)) == short


def test_generate_recovers_from_a_cublas_allocation_failure():
    """cuBLAS reports a failed workspace allocation as a RuntimeError, not torch.OutOfMemoryError: generate
    takes the next strategy as for any out-of-memory error."""
    import torch
    import transformers

    from vramguard.run import generate as G
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval()

    def inject(phase, attempt, step):
        if attempt == 0 and phase == "prefill":
            raise RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    G.OOM_INJECTOR = inject
    r = G.generate(model, None, list(range(5, 25)), 4)
    assert [a.strategy for a in r.attempts][:1] == ["dynamic"] and r.attempts[0].phase == "prefill"
    assert r.attempts[0].oom.startswith("CUDA error: CUBLAS_STATUS_ALLOC_FAILED") and len(r.token_ids) == 4

    def fault(phase, attempt, step):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    G.OOM_INJECTOR = fault
    with pytest.raises(RuntimeError, match="illegal memory access"):  # a device fault is no OOM: not retried
        G.generate(model, None, list(range(5, 25)), 4)


def test_the_measured_run_reports_a_cudnn_allocation_failure_as_out_of_memory(monkeypatch):
    import torch
    import transformers
    from test_profile_fit import FakeProbe

    from vramguard.profile.measured_run import run_generate
    from vramguard.runtime import device
    monkeypatch.setattr(device, "PROBE", FakeProbe())
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval()

    def hook(_m, _a):
        raise RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED")
    h = model.register_forward_pre_hook(hook)
    try:
        r = run_generate(model, Settings(quant="bf16", prompt_tokens=8, max_new_tokens=2))
    finally:
        h.remove()
    assert not r.ok and r.error == "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"


def test_load_model_returns_the_handle_with_what_was_loaded(tiny):
    """The handle carries the resolved spec and the settings as loaded; a 4-bit model loaded with dtype=float32
    is planned with float32 activations (as it runs), and nothing is stored on the model object."""
    from vramguard.plan import estimate
    from vramguard.resolve import resolve_model
    from vramguard.run import generate as G
    from vramguard.runtime.handle import pin_of
    from vramguard.runtime.load import load_model, unload
    folder, _ = tiny("LlamaConfig", **TINY)
    loaded = load_model(str(folder), quant="nf4", dtype="fp32", verify=False)
    assert loaded.spec == resolve_model(str(folder))
    s = loaded.settings
    assert (s.quant, s.double_quant, s.compute_dtype, s.dtype, s.attn) == ("nf4", True, "fp32", "fp32", "sdpa")
    assert s.act_dtype == "fp32" and loaded.baseline is None and pin_of(loaded) is None  # the CPU: nothing measured
    assert not [k for k in vars(loaded.model) if "vramguard" in k]
    (first, need), = G.strategy_order(loaded, 20, 4, auto=False)[0]
    est = estimate(choose(loaded.spec).model, s.with_(prompt_tokens=20, max_new_tokens=4))
    assert first.name == "dynamic" and need == est.peak_reserved_bytes - est.weights.total_bytes
    bf16 = estimate(choose(loaded.spec).model, Settings(quant="nf4", prompt_tokens=20, max_new_tokens=4))
    assert need > bf16.peak_reserved_bytes - bf16.weights.total_bytes  # the float32 activations are counted
    unload(loaded)


def test_the_sdpa_pin_lives_in_the_handle_not_on_the_model():
    import torch
    import transformers

    from vramguard.runtime.handle import pin_of, pin_sdpa, sdpa_unpinned, unpin_sdpa
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**TINY)).eval()
    hooks = (len(model._forward_pre_hooks), len(model._forward_hooks))
    pin_sdpa(model, "math")
    assert pin_of(model).backend == "math" and (len(model._forward_pre_hooks), len(model._forward_hooks)) == (
        hooks[0] + 1, hooks[1] + 1)
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3]]))
    with sdpa_unpinned(model, "test") as note:  # math takes a mask: nothing to lift
        assert note is None and pin_of(model).backend == "math"
    pin_sdpa(model, "flash")
    with sdpa_unpinned(model, "a mask") as note:
        assert pin_of(model) is None and note == "the SDPA pin to flash was lifted for this call: a mask"
    assert pin_of(model).backend == "flash"
    unpin_sdpa(model)
    assert pin_of(model) is None and (len(model._forward_pre_hooks), len(model._forward_hooks)) == hooks
    assert not [k for k in vars(model) if "vramguard" in k]


def test_no_source_line_cites_what_is_not_in_the_repository():
    """Docstrings and comments cite code or public sources: no issue numbers, field-case numbers or files outside
    the repository."""
    import re
    cite = re.compile(r"issue #?\d+|\(#\d+\)|field case|\bC\d{1,2}\b|shared/")
    found = [f"{mod}:{i}" for mod, path in _sources().items()
             for i, line in enumerate(path.read_text().splitlines(), 1) if cite.search(line)]
    assert found == []


def test_library_errors_name_library_fields_and_the_cli_says_its_options():
    from vramguard.cli.common import as_flags
    from vramguard.errors import InvalidValue
    from vramguard.run.context import context_prompt
    with pytest.raises(InvalidValue) as e:
        context_prompt(None, None, "q", [], chunk_tokens=8)
    assert e.value.field == "chunk_tokens" and "--" not in str(e.value)
    assert as_flags("pass chunk_tokens=200, or file='-'; chat=False") == "pass --chunk-tokens 200, or --file -; --raw"
    assert as_flags("max_position_embeddings=64 and do_sample=True") == "max_position_embeddings=64 and --do-sample"


def test_library_raises_name_no_option():
    """No error raised in the library (outside the CLI) has a field spelled as a command-line option."""
    found = []
    for mod, path in _sources().items():
        if mod.startswith(("vramguard.cli", "vramguard.serve")):
            continue
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and node.exc.args:
                first = node.exc.args[0]
                if isinstance(first, ast.Constant) and str(first.value).startswith("--"):
                    found.append(f"{mod}:{node.lineno}")
    assert found == []


def test_plan_and_check_apply_the_same_rules():
    """The compute-dtype cost and the attention maps a plan finding and a check finding name are one computation:
    for Llama-3.1-8B NF4 with fp16 compute under bf16 activations, the largest dequantized weight is the
    14,336 x 4,096 MLP projection, 14,336 x 4,096 x 2 B = 117,440,512 B in either dtype."""
    from vramguard import plan
    from vramguard.check import rules as check_rules
    from vramguard.plan import findings as plan_findings
    from vramguard.plan.rules import attention_map_bytes, dequantized_weight_bytes
    from vramguard.resolve import resolve_model
    for mod in (plan_findings, check_rules):
        text = Path(mod.__file__).read_text()
        assert "dequantized_weight_bytes(" in text and "attention_map_bytes(" in text and "(8, 0)" not in text
        assert "supports_flash_attn2" in text and "supports_bf16" in text  # the catalog's rule of what a card runs
    spec = resolve_model("llama-3.1-8b")
    big, wide, narrow = dequantized_weight_bytes(choose(spec).model, "fp16", "bf16")
    assert (big.out_features, big.in_features, wide, narrow) in ((14336, 4096, 117_440_512, 117_440_512),
                                                                  (4096, 14336, 117_440_512, 117_440_512))
    s = Settings(output_attentions=True, attn="eager", prompt_tokens=1024)
    per_layer = attention_map_bytes(spec, s, "bf16")
    assert per_layer == 32 * 1024 * 1024 * 2  # 32 heads x 1,024^2 positions x 2 B
    p = plan(spec, s, gpu="h100-80gb", solve=False)
    f = next(f for f in p.findings if f.code == "output_attentions_eager")
    assert f.bytes == per_layer * 32  # 32 layers


def test_one_finding_type_for_plan_and_check():
    """check builds the shared Finding (no finding class of its own), and every dataclass named *Finding in the
    library is that one."""
    import importlib

    from vramguard import finding
    from vramguard.check import rules
    check_mod, plan = importlib.import_module("vramguard.check"), importlib.import_module("vramguard.plan")
    from vramguard.probe.env import Env
    classes = [f"{mod}.{node.name}" for mod, path in _sources().items()
               for node in ast.walk(_tree(path))
               if isinstance(node, ast.ClassDef) and node.name.endswith("Finding")]
    assert classes == ["vramguard.finding.Finding"]
    assert plan.Finding is finding.Finding and check_mod.Finding is finding.Finding
    r = check_mod.check("llama-3.1-8b", Settings(quant="nf4"), gpu="t4", verify=False, env=Env())
    assert r.findings and all(type(f) is finding.Finding and f.level in finding.LEVELS for f in r.findings)
    f = rules.finding_line("ram_vs_shard", "ok", "9.95 GB", "the shard fits in free RAM")
    assert (f.code, f.level, f.value, f.message, f.fix, f.bytes) == (
        "ram_vs_shard", "ok", "9.95 GB", "the shard fits in free RAM", None, None)


def test_the_check_json_keeps_its_keys_and_carries_the_shared_ones():
    from vramguard.cli.render import check_finding_to_json
    from vramguard.finding import Finding
    d = check_finding_to_json(Finding("plan", "fail", "needs more", "quantize", 5, "needs 9 GiB of 8 GiB"))
    assert d == {"code": "plan", "level": "fail", "message": "needs more", "fix": "quantize", "bytes": 5,
                 "value": "needs 9 GiB of 8 GiB", "name": "plan", "status": "fail", "reason": "needs more"}


def test_the_optional_packages_are_listed_once():
    """One table (vramguard.extras) names each optional package and its extra; the CLI, serve and the multi-card
    planner read it, no other module lists three or more of them, and each is in that extra of pyproject.toml."""
    import re
    import tomllib

    from vramguard import extras
    from vramguard.cli import serve as cli_serve
    names = set(extras.OPTIONAL_PACKAGES)
    lists = []
    for mod, path in _sources().items():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                strs = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(strs & names) >= 3:
                    lists.append(f"{mod}:{node.lineno}")
            if isinstance(node, ast.Dict) and len({k.value for k in node.keys if isinstance(k, ast.Constant)}
                                                  & names) >= 3 and mod != "vramguard.extras":
                lists.append(f"{mod}:{node.lineno}")
    assert lists == []
    assert extras.needed_by("serve") == ("torch", "transformers", "accelerate", "fastapi", "uvicorn",
                                         "sse_starlette", "prometheus_client", "httpx")
    assert extras.needed_by("load") == ("torch", "transformers", "accelerate")
    assert extras.extra_of("torch.cuda") == "gpu" and extras.extra_of("sse_starlette") == "serve"
    assert extras.extra_of("numpy") is None
    assert "vramguard.extras import" in Path(cli_serve.__file__).read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, (extra, _) in extras.OPTIONAL_PACKAGES.items():
        dists = [re.split(r"[<>=!;\s\[]", r)[0].lower().replace("_", "-") for r in pyproject[extra]]
        assert any(d.startswith(module.replace("_", "-")) for d in dists), (module, extra)
    with pytest.raises(ValueError, match="use='run'"):
        extras.needed_by("run")


def test_no_line_over_120_characters():
    wide = [f"{mod}:{i}: {len(line)} characters" for mod, path in _sources().items()
            for i, line in enumerate(path.read_text().splitlines(), 1) if len(line) > 120]
    assert wide == []


def _cli_options() -> set[str]:
    """Every ``--option`` of vramguard's CLI (typer's click commands)."""
    import typer.main

    from vramguard.cli import app
    group = typer.main.get_command(app)
    return {opt for cmd in group.commands.values() for p in cmd.params for opt in (*p.opts, *p.secondary_opts)
            if opt.startswith("--")}


# modules that write another program's command line: vLLM's (engines, export), vramguard's own for the router's
# workers, dmesg's and journalctl's, nvidia-smi's (the card catalog)
COMMAND_LINE_WRITERS = ("vramguard.engines.vllm_text", "vramguard.export", "vramguard.serve.router",
                        "vramguard.oomlog.sources", "vramguard.catalog.gpus")


def test_library_texts_name_no_cli_option():
    """No string the library produces (outside cli/: errors, findings, notes, server messages) names one of the
    CLI's options; the library names its parameter (``chunk_tokens=``) and the CLI renders it as its option.
    Docstrings may explain which option sets a field."""
    import re
    options = _cli_options()
    assert {"--chunk-tokens", "--vram", "--vram-budget", "--gpu", "--quant"} <= options
    flag = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
    found = []
    for mod, path in _sources().items():
        if mod.startswith("vramguard.cli") or mod in COMMAND_LINE_WRITERS:
            continue
        tree = _tree(path)
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
                and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                found += [f"{mod}:{node.lineno}: {f}" for f in flag.findall(node.value) if f in options]
    assert found == []


def test_the_cli_renders_library_fields_as_its_options():
    from vramguard.cli.flags import as_flags
    assert as_flags("raise vram_budget= by at least 2 GiB, lower max_batch_tokens= / max_running=") == (
        "raise --vram-budget by at least 2 GiB, lower --max-batch-tokens / --max-running")
    assert as_flags("pass dtype=torch.bfloat16; device_map='auto' offloads; attn='eager'") == (
        "pass dtype=torch.bfloat16; device_map='auto' offloads; --attn eager")
    assert as_flags("a catalog name (vramguard.catalog.models.MODELS), quant=nf4") == (
        "a catalog name (vramguard plan --list-models), --quant nf4")
    assert as_flags("started with greedy=True") == "started with --greedy"


def test_a_server_the_cli_starts_words_its_errors_with_the_options():
    pytest.importorskip("fastapi")
    from vramguard.cli.flags import as_flags
    from vramguard.serve.apierrors import ApiError, word_messages_with
    err = ApiError.of("unsupported_parameter", "this server decodes greedily (started with greedy=True)", "temperature")
    assert err.body()["error"]["message"].endswith("(started with greedy=True)")
    previous = word_messages_with(as_flags)
    try:
        assert err.body()["error"]["message"].endswith("(started with --greedy)")
    finally:
        assert word_messages_with(previous) is as_flags
    assert err.body()["error"]["message"].endswith("(started with greedy=True)")
