"""vramguard.deferred: inside ``unused_by_plans()``, the packages a plan never runs are imported at their first use.
A small package written here stands in for TorchDynamo, accelerate and SciPy (nothing heavy is imported); the names
listed for the real ones are checked against the installed sources, and tests/test_plan_speed.py checks that a first
plan in a new process imports none of them."""

from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

import pytest

from vramguard import deferred

PACKAGE = {
    "__init__.py": "import builtins\nbuiltins.vg_heavy_runs = getattr(builtins, 'vg_heavy_runs', 0) + 1\n"
                   "from vg_heavy.api import Thing\n",
    "api.py": ("class Thing:\n    def __init__(self, x=1):\n        self.x = x\n\n"
               "def make(x):\n    return Thing(x)\n\n"
               "def mark(fn=None, *, tag='t'):\n"
               "    if fn is None:\n        return lambda f: mark(f, tag=tag)\n"
               "    fn.marked = tag\n    return fn\n\n"
               "VERSION = 3\n\n"
               "import sys\n\n"
               "def _keeps_its_frame():\n"  # as torch.fx.wrap, run at the top of modules TorchDynamo imports
               "    here = sys._getframe()\n\n"
               "_keeps_its_frame()\n"),
    "other.py": "VALUE = 42\n",
}


@pytest.fixture
def heavy(tmp_path, monkeypatch):
    """The package ``vg_heavy`` on the path, deferred in place of the real list; how many times its ``__init__``
    ran is ``runs()``."""
    import builtins
    root = tmp_path / "vg_heavy"
    root.mkdir()
    for name, text in PACKAGE.items():
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(deferred, "DEFERRED", {"vg_heavy": frozenset(),
                                               "vg_heavy.api": frozenset({"Thing", "make", "mark"})})
    monkeypatch.setattr(deferred, "ROOTS", ("vg_heavy",))
    monkeypatch.setattr(deferred, "DECORATORS", frozenset({("vg_heavy.api", "mark")}))
    monkeypatch.delenv("VRAMGUARD_DEFER_IMPORTS", raising=False)
    builtins.vg_heavy_runs = 0
    yield lambda: builtins.vg_heavy_runs
    for name in [n for n in sys.modules if n == "vg_heavy" or n.startswith("vg_heavy.")]:
        del sys.modules[name]


def test_names_taken_in_the_block_import_nothing_until_used(heavy):
    with deferred.unused_by_plans():
        from vg_heavy.api import Thing, make
        assert deferred._loaded("vg_heavy") is None and deferred._loaded("vg_heavy.api") is None
        assert not isinstance(object(), Thing) and isinstance(3, (int, Thing))
        assert not issubclass(int, Thing)
    assert "vg_heavy" not in sys.modules and "vg_heavy.api" not in sys.modules  # a later import is a plain one
    assert heavy() == 0
    t = make(5)  # the first use imports the package, once
    assert heavy() == 1 and type(t).__module__ == "vg_heavy.api" and t.x == 5
    assert isinstance(t, Thing) and issubclass(type(t), Thing) and Thing(2).x == 2
    assert Thing.__name__ == "Thing" and sys.modules["vg_heavy.api"].make is not make
    import vg_heavy.api
    assert heavy() == 1 and vg_heavy.api.Thing is type(t)


def test_an_import_inside_a_traced_call_keeps_none_of_its_variables_alive_with_the_collector_paused(heavy):
    """A deferred package imported in the middle of a call leaves a cycle of frames (one holding itself, its callers
    behind it): with the collector paused, as ``vramguard plan`` pauses it, the caller's variables (a forward's
    tensors) would stay alive after it returns, and a traced peak would count them."""
    import gc
    import weakref

    class Activation:
        pass
    freed: list[str] = []

    def forward(api):
        x = Activation()
        weakref.finalize(x, freed.append, "x")
        api.make(2)  # the real vg_heavy.api is imported here

    was = gc.isenabled()
    gc.disable()
    try:
        with deferred.unused_by_plans():
            import vg_heavy.api as api
            assert heavy() == 0
            forward(api)
            assert heavy() == 1 and freed == ["x"]  # freed as the call returned, the collector still paused
    finally:
        if was:
            gc.enable()


def test_a_name_not_listed_imports_the_real_package_there(heavy):
    with deferred.unused_by_plans():
        import vg_heavy.api as api
        assert heavy() == 0
        assert api.VERSION == 3 and heavy() == 1  # not listed: read from the real module, imported now
        from vg_heavy.api import Thing  # the package is real now: the real class
        assert Thing is sys.modules["vg_heavy.api"].Thing and not isinstance(Thing, deferred.StandIn)
    assert heavy() == 1


def test_a_submodule_not_listed_is_the_real_one_under_its_real_package(heavy):
    with deferred.unused_by_plans():
        import vg_heavy
        assert heavy() == 0
        import vg_heavy.other
        assert vg_heavy.other.VALUE == 42 and heavy() == 1
        real = sys.modules["vg_heavy.other"]
        assert isinstance(real.__spec__.loader, importlib.machinery.SourceFileLoader)
        assert sys.modules["vg_heavy"].other is real and deferred._loaded("vg_heavy") is sys.modules["vg_heavy"]


def test_a_deferred_decorator_runs_the_function_and_marks_it_once_the_package_is_imported(heavy):
    with deferred.unused_by_plans():
        from vg_heavy.api import mark

        @mark
        def f(x):
            return x + 1

        @mark(tag="b")
        def g():
            return "g"
        assert (f(1), g(), heavy()) == (2, "g", 0)  # the mark changes no call: the package is not needed
        assert not hasattr(f.__wrapped__, "marked") and f.__name__ == "f"
    importlib.import_module("vg_heavy.api")
    assert (f(2), g()) == (3, "g")  # with the package imported, the mark is made at the next call
    assert (f.__wrapped__.marked, g.__wrapped__.marked) == ("t", "b")


def test_a_package_imported_before_is_left_alone_and_the_switch_turns_it_off(heavy, monkeypatch):
    import vg_heavy.api
    with deferred.unused_by_plans():
        from vg_heavy.api import Thing
    assert Thing is vg_heavy.api.Thing and heavy() == 1
    del sys.modules["vg_heavy.api"], sys.modules["vg_heavy"]
    monkeypatch.setenv("VRAMGUARD_DEFER_IMPORTS", "0")
    with deferred.unused_by_plans():
        from vg_heavy.api import make
        assert heavy() == 2 and not isinstance(make, deferred.StandIn)
    assert sys.meta_path.count(deferred._FINDER) == 0


def _source(name: str) -> Path | None:
    """The source file of module ``name``, found without importing it or its packages; None if not installed."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]), spec.submodule_search_locations)
    return Path(spec.origin) if spec is not None and spec.origin else None


def _top_level_names(path: Path) -> set[str]:
    """The names a module binds at its top level (definitions, assignments, imports; ``if`` and ``try`` blocks
    included)."""
    names: set[str] = set()

    def visit(body) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
            for field in ("body", "orelse", "finalbody"):
                if isinstance(node, (ast.If, ast.Try)):
                    visit(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


@pytest.mark.parametrize("module", sorted(deferred.DEFERRED))
def test_each_listed_name_is_bound_by_the_installed_module(module):
    """A stand-in answers for a name the real module has: an importer's ``try: from m import X`` must not succeed
    where the real one fails. Read from the sources (nothing imported); a package not installed is skipped."""
    path = _source(module)
    if path is None:
        pytest.skip(f"{module} is not installed")
    missing = deferred.DEFERRED[module] - _top_level_names(path)
    assert not missing, f"{module} ({path}) binds none of {sorted(missing)}"
    assert deferred._root(module) is not None and all(deferred._root(r) == r for r in deferred.ROOTS)


def test_transformers_scans_its_models_folder_once_in_the_block():
    """Importing transformers scans ``transformers/models`` twice (the package's structure and that of
    ``transformers.models``): the second is a copy of the first, equal to a scan of its own, sharing no set."""
    import types
    iu = pytest.importorskip("transformers.utils.import_utils")
    scans = []
    module = types.SimpleNamespace(create_import_structure_from_path=lambda p: scans.append(p) or
                                   iu.create_import_structure_from_path(p))
    original = module.create_import_structure_from_path
    models = Path(iu.__file__).parent.parent / "models"
    with deferred.unused_by_plans():
        deferred._scan_once(module)
        first = module.create_import_structure_from_path(models)
        second = module.create_import_structure_from_path(str(models / "__init__.py"))
    assert len(scans) == 1 and module.create_import_structure_from_path is original  # restored after the block
    assert second == first == iu.create_import_structure_from_path(str(models / "__init__.py"))
    llama = [v for k, v in first["llama"].items() if isinstance(k, frozenset) and "modeling_llama" in v][0]
    twin = [v for k, v in second["llama"].items() if isinstance(k, frozenset) and "modeling_llama" in v][0]
    assert "LlamaForCausalLM" in llama["modeling_llama"] and llama["modeling_llama"] is not twin["modeling_llama"]
