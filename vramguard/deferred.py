"""Packages that transformers' modules import as they are imported, and that a plan never runs, imported at their
first use instead (inside :func:`unused_by_plans`).

Importing a transformers modeling module imports, through ``modeling_utils``, ``masking_utils`` and
``core_model_loading``: TorchDynamo (a context manager of the vmap mask path, and the ``torch.compiler.disable``
marks of a few functions), FSDP and distributed checkpoints, accelerate (device maps and offloading), SciPy's
optimizers (object-detection losses) and, through bitsandbytes, Triton: about 2 s of CPU on the 2-core machine
(benchmarks/README.md). A plan builds the model on the meta device and replays its forward; none of them runs.

Inside :func:`unused_by_plans`, importing a module of :data:`DEFERRED` that is not imported yet gives a stand-in
module: the names the importers take from it (listed there) are stand-ins too, which import the real module where
they are used (called, read an attribute of, subclassed) and answer as the real object would. ``isinstance(x, D)``
with a stand-in ``D`` is False without importing anything while the real module was never imported (no object of
its classes can exist then), else the real ``isinstance``. Any other use of a stand-in module (a name not listed, a
submodule not listed) imports the real package on the spot, as a plain import would have. TorchDynamo's marking
decorators are :class:`_DeferredDecorator`. When the block ends, the stand-in modules leave ``sys.modules`` (a later
import is a plain one); stand-ins already handed out keep working. A package imported before the block is left
alone; ``VRAMGUARD_DEFER_IMPORTS=0`` turns the deferral off.

One more cost of importing transformers is changed inside the block (:data:`AFTER_IMPORT`): it reads every file
of ``transformers/models`` twice, for its own lazy module and for ``transformers.models``'s; the second read is
a copy of the first (:func:`_scan_once`).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import types
import typing

# module -> the names transformers 5.x's modules import from it at their top (checked against the installed sources
# by tests/test_deferred.py); each group is deferred from its first module (a package) down
DEFERRED: dict[str, frozenset[str]] = {
    "torch._dynamo": frozenset({"allow_in_graph", "assume_constant_result", "disable"}),
    "torch._dynamo._trace_wrapped_higher_order_op": frozenset({"TransformGetItemToIndex"}),
    "torch.distributed.fsdp": frozenset({"CPUOffloadPolicy", "MixedPrecisionPolicy"}),
    "torch.distributed._composable.fsdp": frozenset({"fully_shard"}),
    "torch.distributed.checkpoint": frozenset(),
    "torch.distributed.checkpoint.hf_storage": frozenset({"HuggingFaceStorageReader", "HuggingFaceStorageWriter"}),
    "accelerate": frozenset({"PartialState", "dispatch_model"}),
    "accelerate.hooks": frozenset({"AlignDevicesHook", "add_hook_to_module", "remove_hook_from_module"}),
    "accelerate.utils": frozenset({"extract_model_from_parallel", "get_balanced_memory", "get_max_memory",
                                   "infer_auto_device_map", "reduce"}),
    "accelerate.utils.deepspeed": frozenset({"HfDeepSpeedConfig"}),
    "accelerate.utils.modeling": frozenset({"clean_device_map", "get_max_layer_size"}),
    "scipy.optimize": frozenset({"linear_sum_assignment"}),
    "triton": frozenset(),  # bitsandbytes' backends: "import triton" to see whether it is installed
    "triton.language": frozenset(),
}
DECORATORS = frozenset({("torch._dynamo", "disable"), ("torch._dynamo", "assume_constant_result"),
                        ("torch._dynamo", "allow_in_graph")})  # names given as _DeferredDecorator
ROOTS = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed._composable.fsdp",
         "torch.distributed.checkpoint", "accelerate", "scipy.optimize", "triton")

_lock = threading.RLock()
_patched: list = []  # (module, attribute, original) restored when the block ends
_depth = 0  # nested unused_by_plans blocks
_released: set[str] = set()  # roots whose real package was imported (or whose stand-ins left sys.modules)


def _root(name: str) -> str | None:
    return next((r for r in ROOTS if name == r or name.startswith(r + ".")), None)


def _real(name: str):
    """The real module ``name``: its group's stand-ins released first (:func:`_release`), then a plain import.

    Such an import can run in the middle of a forward a plan traces (transformers' cache calls
    ``torch._dynamo.mark_static_address`` in its first update), and importing makes reference cycles of frames:
    ``torch.fx.wrap``, run at the top of modules TorchDynamo imports, keeps its own frame in a local, and that frame's
    callers are the import's, then the forward's. Where the cyclic collector is paused (``vramguard plan``), that
    cycle would keep the forward's frames, and the tensors their variables hold, alive to the end of the replay (a
    Falcon-H1 prefill of 8,192 tokens: 2.10 GB of activations for 1.68 GB). So a first import here collects once."""
    found = _loaded(name)
    if found is not None:
        return found
    root = _root(name)
    if root is not None:
        _release(root)
    module = importlib.import_module(name)
    if not gc.isenabled():
        gc.collect()  # the import's frame cycles, while no frame of the forward is done yet
    return module


def _release(root: str) -> None:
    """Take the stand-in modules of group ``root`` out of ``sys.modules`` and off their parents, so that the next
    import of any of them is a plain one."""
    with _lock:
        if root in _released:
            return
        _released.add(root)
        for name in [n for n, m in sys.modules.items() if isinstance(m, _StandInModule) and _root(n) == root]:
            stub = sys.modules.pop(name)
            parent, _, child = name.rpartition(".")
            if parent in sys.modules and getattr(sys.modules[parent], child, None) is stub:
                with contextlib.suppress(AttributeError):
                    delattr(sys.modules[parent], child)


def _loaded(name: str):
    """The real module ``name`` where it was imported, else None."""
    found = sys.modules.get(name)
    return None if found is None or isinstance(found, _StandInModule) else found


class _StandInModule(types.ModuleType):
    """A module of :data:`DEFERRED` not imported yet: its listed names are stand-ins (:class:`StandIn`); any other
    name imports the real module and is read from it."""

    def __getattr__(self, attr: str):
        name = self.__name__
        if attr.startswith("__") and attr not in ("__all__", "__version__"):  # probed by the import system and
            raise AttributeError(attr)                                       # inspect: imports nothing
        if attr in DEFERRED.get(name, ()) and _root(name) not in _released:
            standin = (_DeferredDecorator if (name, attr) in DECORATORS else StandIn)(name, attr)
            setattr(self, attr, standin)
            return standin
        return getattr(_real(name), attr)


_FORWARDED = frozenset({"__name__", "__qualname__"})  # the special names a stand-in reads from the real object


class StandIn:
    """Name ``attr`` of module ``module``, imported where it is used (see the module docstring)."""

    def __init__(self, module: str, attr: str):
        self._where = (module, attr)

    def _target(self):
        module, attr = self._where
        return getattr(_real(module), attr)

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)

    def __getattr__(self, attr: str):
        if attr == "_where" or attr.startswith("__") and attr not in _FORWARDED:  # probes (typing, inspect, copy):
            raise AttributeError(attr)                                              # answered without importing
        return getattr(self._target(), attr)

    def __instancecheck__(self, obj) -> bool:
        real = _loaded(self._where[0])
        return isinstance(obj, getattr(real, self._where[1])) if real is not None else False

    def __subclasscheck__(self, cls) -> bool:
        real = _loaded(self._where[0])
        return issubclass(cls, getattr(real, self._where[1])) if real is not None else False

    def __mro_entries__(self, bases):
        return (self._target(),)

    def __getitem__(self, item):
        return self._target()[item]

    def __or__(self, other):
        return typing.Union[self, other]

    def __ror__(self, other):
        return typing.Union[other, self]

    def __repr__(self) -> str:
        return f"<deferred {self._where[0]}.{self._where[1]}>"


class _DeferredDecorator(StandIn):
    """A decorator that only marks a function for TorchDynamo's traces (``disable``, which ``torch.compiler.disable``
    and PyTorch's own ``_disable_dynamo`` call; ``assume_constant_result``, ``allow_in_graph``), applied by
    transformers as its modules are defined: the function runs as it is while TorchDynamo was never imported
    (nothing can be tracing it), and through the real decorator, applied once, from the first call after it was."""

    def __call__(self, fn=None, *args, **kwargs):
        if fn is None:  # @disable(recursive=False)
            return lambda f: self(f, *args, **kwargs)
        if _loaded(self._where[0]) is not None:
            return self._target()(fn, *args, **kwargs)
        applied = None

        @functools.wraps(fn)
        def call(*a, **k):
            nonlocal applied
            if applied is None:
                if _loaded(self._where[0]) is None:  # no TorchDynamo, nothing traced: the mark changes nothing
                    return fn(*a, **k)
                applied = self._target()(fn, *args, **kwargs)
            return applied(*a, **k)
        return call


class _StandInLoader(importlib.abc.Loader):
    """Creates the stand-in module of a :data:`DEFERRED` module; runs none of its code."""

    def create_module(self, spec):
        return _StandInModule(spec.name)

    def exec_module(self, module) -> None:
        return None


class _RealLoader(importlib.abc.Loader):
    """Gives a module of a deferred package that :data:`DEFERRED` does not list: the real one, imported (its
    package's stand-ins released first) as a plain import would."""

    def create_module(self, spec):
        module = _real(spec.name)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        module.__spec__ = self.real_spec  # module_from_spec set this loader's


def _scan_once(module) -> None:
    """transformers' ``import_utils``: its scan of a folder of model modules (``create_import_structure_from_path``,
    which opens every file of ``transformers/models``) made once per folder while the block runs. Importing
    transformers scans that folder twice, for the package and for ``transformers.models``: the second is a copy of
    the first."""
    scan = module.create_import_structure_from_path
    found: dict[str, dict] = {}

    def once(module_path):
        folder = os.path.dirname(module_path) if os.path.isfile(module_path) else os.fspath(module_path)
        if folder not in found:
            found[folder] = scan(module_path)
        return _copy(found[folder])
    _patched.append((module, "create_import_structure_from_path", scan))
    module.create_import_structure_from_path = once


def _copy(tree):
    """A nested structure of dicts and sets, copied down to its strings and frozensets."""
    if isinstance(tree, dict):
        return {k: _copy(v) for k, v in tree.items()}
    return set(tree) if isinstance(tree, set) else tree


AFTER_IMPORT = {"transformers.utils.import_utils": _scan_once}  # module -> what is changed in it once run


class _AfterLoader(importlib.abc.Loader):
    """Runs a module of :data:`AFTER_IMPORT` with its own loader, then its change."""

    def __init__(self, inner, change):
        self.inner, self.change = inner, change

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module) -> None:
        self.inner.exec_module(module)
        self.change(module)

    def __getattr__(self, name: str):  # get_source, get_filename...: the module's own loader's
        return getattr(self.inner, name)


class _Finder(importlib.abc.MetaPathFinder):
    """While a :func:`unused_by_plans` block runs: a stand-in for each module of :data:`DEFERRED` whose group was not
    released, the real module (after releasing its group) for any other module under a deferred package, and the
    modules of :data:`AFTER_IMPORT` with their change."""

    def find_spec(self, name, path, target=None):
        if name in AFTER_IMPORT and _depth:
            spec = importlib.machinery.PathFinder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AfterLoader(spec.loader, AFTER_IMPORT[name])
            return spec
        root = _root(name)
        if root is None or root in _released or _depth == 0:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path, target)
        if real is None:  # not installed: the import fails as it would
            return None
        if name not in DEFERRED:
            return importlib.machinery.ModuleSpec(name, _RealLoader(), origin=real.origin)
        spec = importlib.machinery.ModuleSpec(name, _StandInLoader(), origin=real.origin,
                                              is_package=real.submodule_search_locations is not None)
        spec.has_location = real.has_location  # __file__ as the real module's (inspect reads it of every module)
        if real.submodule_search_locations is not None:
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


_FINDER = _Finder()


@contextlib.contextmanager
def unused_by_plans():
    """Inside the block, the modules of :data:`DEFERRED` that are not imported yet are imported at their first use
    (the module docstring); blocks nest. ``VRAMGUARD_DEFER_IMPORTS=0`` turns it off."""
    global _depth
    if os.environ.get("VRAMGUARD_DEFER_IMPORTS", "1").strip().lower() in ("0", "false", "no", "off"):
        yield
        return
    with _lock:
        _depth += 1
        if _depth == 1:
            _released.clear()
            _released.update(r for r in ROOTS if r in sys.modules)
            sys.meta_path.insert(0, _FINDER)
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                sys.meta_path.remove(_FINDER)
                for root in ROOTS:
                    _release(root)
                for module, attr, original in _patched:
                    setattr(module, attr, original)
                _patched.clear()
