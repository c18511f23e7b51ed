"""Imports say what a module depends on: vramguard's own modules are imported at the top of a file, and the CLI's
start imports no optional heavy package (torch, transformers, fastapi, numpy...), which stay lazy on purpose."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

from test_spine import _sources as _modules  # every vramguard module by dotted name

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "vramguard"

# Function-local imports of vramguard's own modules allowed per package ("" is the top-level modules): 34 of 336
# once. Each left is a door from the CLI's start to a module it does not need: one that imports a heavy package
# when it is imported (fastapi's server, router and error table, asyncio's connections and vLLM's model in cli; the
# torch tracers replay and tracker in introspect; Triton's kernels in run and serve), or a path `vramguard plan`
# does not take, loaded when it runs so that the plan's start stays as fast (oom-log, explain, profile and fit in
# cli; several cards' planner in cli and plan; the CUDA-graph decoder in run). Other modules import at their top.
BUDGET = {"": 0, "catalog": 0, "check": 0, "cli": 12, "engines": 0, "export": 0, "hub": 0, "introspect": 6,
          "memory": 0, "oomlog": 0, "plan": 1, "probe": 0, "profile": 0, "run": 11, "runtime": 0, "serve": 5}
# the optional packages the CLI's start must not import (pyproject's extras, and what they bring)
HEAVY = {"torch", "transformers", "accelerate", "bitsandbytes", "safetensors", "huggingface_hub", "numpy", "triton",
         "fastapi", "starlette", "uvicorn", "pydantic", "httpx", "sse_starlette", "prometheus_client", "matplotlib",
         "yaml", "gguf", "hqq"}


def _is_own(node: ast.AST) -> bool:
    if isinstance(node, ast.ImportFrom):
        return bool(node.level) or (node.module or "").split(".")[0] == "vramguard"
    return isinstance(node, ast.Import) and any(a.name.split(".")[0] == "vramguard" for a in node.names)


def local_own_imports(path: Path) -> list[str]:
    """``line: statement`` of each import of a vramguard module inside a function of ``path``."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and _is_own(child):
                found.append(f"{child.lineno}: {ast.unparse(child)}")
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), False)
    return found


def module_level_imports(path: Path, module: str, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """The vramguard modules and the other top-level packages ``module`` imports when it is imported (its module
    level, ``try`` and ``if`` blocks included; functions and ``if TYPE_CHECKING:`` left out)."""
    own: set[str] = set()
    other: set[str] = set()
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def add(name: str) -> None:
        if name.split(".")[0] != "vramguard":
            other.add(name.split(".")[0])
            return
        parts = name.split(".")
        own.update(".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules)

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                for a in node.names:
                    add(a.name)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + [base] * bool(base))
                for a in node.names:
                    add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With, ast.ClassDef)):
                for field in ("body", "orelse", "finalbody"):
                    visit(getattr(node, field, []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    own.discard(module)
    return own, other


def test_function_local_imports_of_vramguard_stay_within_each_packages_budget():
    modules = _modules()
    by_package: dict[str, list[str]] = collections.defaultdict(list)
    for mod, path in modules.items():
        parts = mod.split(".")
        package = parts[1] if len(parts) > 2 or path.name == "__init__.py" and len(parts) > 1 else ""
        by_package[package] += [f"{path.relative_to(ROOT)}:{line}" for line in local_own_imports(path)]
    over = {p: found for p, found in by_package.items() if len(found) > BUDGET.get(p, 0)}
    assert not over, "\n".join(f"{p or 'top-level'}: {len(f)} > {BUDGET.get(p, 0)}\n  " + "\n  ".join(f)
                               for p, f in over.items())


def test_the_local_import_counter_counts_function_bodies_only(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from vramguard import units\n\ndef f():\n    import torch\n    from vramguard.units import GiB\n"
                 "    from . import x\n    return lambda: __import__('os')\n")
    assert local_own_imports(f) == ["5: from vramguard.units import GiB", "6: from . import x"]


def test_the_cli_start_imports_no_optional_heavy_package():
    """What ``python -m vramguard --help`` imports, read from the sources: no torch, transformers, fastapi..."""
    modules = _modules()
    seen, todo, heavy = {"vramguard.cli"}, ["vramguard.cli", "vramguard"], collections.defaultdict(set)
    while todo:
        mod = todo.pop()
        own, other = module_level_imports(modules[mod], mod, modules)
        for package in other & HEAVY:
            heavy[package].add(mod)
        for m in own - seen:
            seen.add(m)
            todo.append(m)
    assert not heavy, dict(heavy)
    assert "vramguard.serve.server" not in seen and "vramguard.engines.vllm" not in seen
    # the paths a plan does not take, loaded when they run (the doors above)
    assert not seen & {"vramguard.oomlog", "vramguard.explain", "vramguard.profile", "vramguard.plan.multigpu",
                       "vramguard.run.fastdecode", "vramguard.run.kernels.nf4", "vramguard.introspect.replay"}
