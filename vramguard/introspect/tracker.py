"""A dispatch mode that keeps the live storages of meta tensors in allocation order, as the CUDA caching allocator
would hold them, and the peak with its components.

Every output whose storage none of the operator's inputs had is a new allocation (views and in-place results share
their input's storage, and parameters were never allocated under the tracker); it is
live until Python drops its last reference (a weak reference's callback), which is when the caching allocator
gets the block back. Sizes are rounded up to 512 B (``kMinBlockSize`` in ``c10/cuda/CUDACachingAllocator.cpp``).
This is the technique of PyTorch's own ``torch.distributed._tools.mem_tracker.MemTracker`` (weak references to
``UntypedStorage`` in a ``TorchDispatchMode``), applied to meta tensors so that no memory is touched.

Meta tensors hold no values, so the few data-dependent calls of a forward are answered by a small constant
propagation and a stated policy (:class:`DataPolicy`): a tensor known to hold one value everywhere (the all-ones
attention mask of an unpadded batch) keeps that value through casts, views, indexing, sums, comparisons and
``all``/``any``, so transformers' checks such as ``mask.sum() == mask.numel()`` get the answer the real run gets.
A truth test of an unknown value is false, and ``nonzero`` returns as many rows as the policy gives for its input
(every element by default).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from vramguard.errors import NotModelled
from vramguard.memory.weights import rounded

aten = torch.ops.aten




@dataclass
class DataPolicy:
    """Answers for data-dependent operators on meta tensors.

    ``nonzero_rows``: rows ``nonzero`` returns for an input of this shape (default: every element).
    """

    nonzero_rows: Callable[[tuple[int, ...]], int] | None = None

    def rows(self, shape: tuple[int, ...]) -> int:
        if self.nonzero_rows is not None:
            return self.nonzero_rows(shape)
        n = 1
        for d in shape:
            n *= d
        return n


@dataclass
class Peak:
    """The largest live total seen, with its bytes by label and the allocation that reached it."""

    bytes: int = 0
    by_label: dict[str, int] = field(default_factory=dict)
    at: str = ""
    live: dict[int, tuple[int, str]] = field(default_factory=dict)  # serial -> (bytes, label) at the peak


class StorageTracker(TorchDispatchMode):
    """Tracks live storages created under it (see the module docstring).

    ``label()`` gives the component of each new allocation; ``relabel`` moves storages to another label after the
    fact (the cache's tensors are known only when the forward returns). ``count=False``: no allocation is tracked,
    only the data policy and the values of :meth:`fill` are kept (a forward that only fills a cache).
    """

    def __init__(self, label: Callable[[], str] = lambda: "activations", policy: DataPolicy | None = None,
                 events: list | None = None, notes: dict | None = None, count: bool = True):
        super().__init__()
        self.count = count
        self.events = events  # when a list: (serial, raw bytes) per allocation and (serial, -1) per free, in order
        self.notes = notes  # when a dict: serial -> (label, where) of every allocation
        self.label = label
        self.policy = policy or DataPolicy()
        self.live: dict[int, tuple[int, str]] = {}  # serial -> (bytes, label)
        self._serial_of: dict[int, int] = {}  # id(storage) -> serial, while alive
        self._refs: dict[int, weakref.ref] = {}
        self._next = 0
        self.live_bytes = 0
        self.by_label: Counter[str] = Counter()
        self._log: list[tuple[int, int]] = []  # (serial, bytes) per allocation, (serial, -1) per free
        self._label_of: dict[int, str] = {}
        self._peak_bytes, self._peak_end, self._peak_at = 0, 0, ""  # the peak: its bytes, len(_log), allocation
        self._peak: Peak | None = None  # the Peak of _peak_end, made when asked for
        self.largest_alloc = 0
        from torch.utils.weak import WeakIdKeyDictionary
        self._fills = WeakIdKeyDictionary()  # tensor -> the one value all its elements hold

    # ---- bookkeeping -----------------------------------------------------------------------------------------
    def serial(self, t: torch.Tensor) -> int | None:
        """The serial of ``t``'s storage, or None when it was not allocated under this tracker."""
        return self._serial_of.get(id(t.untyped_storage()))

    def log_length(self) -> int:
        """How many allocations and frees were logged so far (a position for :meth:`log_since`)."""
        return len(self._log)

    def log_since(self, start: int) -> list[tuple[int, int]]:
        """The allocations ``(serial, bytes)`` and frees ``(serial, -1)`` logged from position ``start`` on."""
        return self._log[start:]

    def adopt(self, t: torch.Tensor, label: str) -> None:
        """Count a tensor created before tracking began (a filled cache) as live under ``label``."""
        self._add(t.untyped_storage(), label, "adopted")

    def _add(self, st: torch.UntypedStorage, label: str, at: str) -> None:
        key = id(st)
        if key in self._serial_of:
            return
        nbytes = rounded(st.nbytes()) if st.nbytes() else 0
        serial = self._next
        self._next += 1
        self._serial_of[key] = serial
        self.live[serial] = (nbytes, label)
        self._label_of[serial] = label
        self._refs[serial] = weakref.ref(st, lambda _r, s=serial, k=key: self._free(s, k))  # type: ignore[misc]
        self.live_bytes += nbytes
        self.by_label[label] += nbytes
        if self.events is not None:
            self.events.append((serial, st.nbytes()))
        if self.notes is not None:
            self.notes[serial] = (label, at)
        self.largest_alloc = max(self.largest_alloc, nbytes)
        self._log.append((serial, nbytes))
        if self.live_bytes > self._peak_bytes:
            self._peak_bytes, self._peak_end, self._peak_at, self._peak = self.live_bytes, len(self._log), at, None

    @property
    def peak(self) -> Peak:
        """The largest live total so far: its bytes by label and the live storages then, rebuilt from the log of
        allocations and frees up to it (a copy of the live set at each new peak cost a forward's time squared)."""
        if self._peak is None:
            live: dict[int, tuple[int, str]] = {}
            for serial, nbytes in self._log[:self._peak_end]:
                if nbytes < 0:
                    live.pop(serial, None)
                else:
                    live[serial] = (nbytes, self._label_of[serial])
            sums: Counter[str] = Counter()
            for nbytes, label in live.values():
                sums[label] += nbytes
            by_label = {k: sums[k] for k in self.by_label if sums[k]}  # in the order labels first came
            self._peak = Peak(self._peak_bytes, by_label, self._peak_at, live) if self._peak_bytes else Peak()
        return self._peak

    def _free(self, serial: int, key: int) -> None:
        if serial in self.live:
            self._log.append((serial, -1))
            if self.events is not None:
                self.events.append((serial, -1))
        nbytes, label = self.live.pop(serial, (0, ""))
        self.live_bytes -= nbytes
        if label:
            self.by_label[label] -= nbytes
        self._refs.pop(serial, None)
        if self._serial_of.get(key) == serial:
            del self._serial_of[key]

    def peak_by_label(self, relabel: dict[int, str]) -> dict[str, int]:
        """The peak's bytes by label, with the storages in ``relabel`` (serial -> label) moved to their label."""
        out: Counter[str] = Counter(self.peak.by_label)
        for serial, label in relabel.items():
            if serial in self.peak.live:
                nbytes, old = self.peak.live[serial]
                out[old] -= nbytes
                out[label] += nbytes
        return {k: v for k, v in out.items() if v}

    # ---- the dispatch mode -----------------------------------------------------------------------------------
    def fill(self, t: torch.Tensor, value) -> None:
        """Declare that every element of ``t`` equals ``value`` (e.g. an all-ones attention mask)."""
        self._fills[t] = value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._local_scalar_dense.default, aten.is_nonzero.default, aten.item.default):
            return self._scalar(func, args[0])
        if func is aten.nonzero.default:
            x = args[0]
            return torch.empty((self.policy.rows(tuple(x.shape)), x.dim()), dtype=torch.long, device=x.device)
        out = _grouped_mm(args, kwargs) if func is aten._grouped_mm.default else _meta_call(func, args, kwargs)
        if self.count:
            self._track(func, args, kwargs, out)
        if isinstance(out, torch.Tensor) and self._fills:
            value = _propagate(func, args, kwargs, out, self._fills)
            if value is not None:
                self._fills[out] = value
        return out

    def _track(self, func, args, kwargs, out) -> None:
        """Count every output storage that none of the inputs had as a new allocation."""
        inputs = {id(a.untyped_storage()) for a in _tensors((args, kwargs)) if a.device.type == "meta"}
        name = _name(func)
        for t in _tensors(out):
            if t.device.type == "meta":
                st = t.untyped_storage()
                if id(st) not in inputs:  # a view or an in-place result shares its input's storage
                    self._add(st, self.label(), name)

    def _scalar(self, func, x: torch.Tensor):
        if x.device.type != "meta":
            return func(x)
        if x in self._fills:
            v = self._fills[x]
            return bool(v) if x.dtype == torch.bool else v
        if x.dtype == torch.bool:
            return False
        raise NotModelled(f"{func} on a meta tensor of dtype {x.dtype} (a value the forward branches on)")


_NAMES: dict = {}  # operator -> str(operator), the name an allocation is reported at


def _name(func) -> str:
    name = _NAMES.get(func)
    if name is None:
        name = _NAMES[func] = str(func)
    return name


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors in ``tree`` (nested tuples, lists and dict values, as operators take and return them), in the
    order ``torch.utils._pytree.tree_flatten`` lists its leaves; a container of another type is flattened by
    ``tree_flatten`` itself."""
    out: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif type(x) in (tuple, list):
            stack.extend(reversed(x))
        elif type(x) is dict:
            stack.extend(reversed(list(x.values())))
        elif x is None or type(x) in (int, float, bool, str) or isinstance(x, (torch.dtype, torch.device,
                                                                              torch.layout, torch.memory_format)):
            continue
        else:
            stack.extend(reversed([t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]))
    return out


_FRESH: dict = {}  # operator -> whether it returns only new tensors (no alias, no mutation): its schema says so
_OUTPUTS: dict = {}  # (operator, the metadata of its arguments) -> its outputs' metadata (see _meta_call)
MAX_MEMO = 32_768  # entries of _OUTPUTS kept (about a kilobyte each), then it starts again


def _meta_call(func, args, kwargs):
    """``func(*args, **kwargs)`` on meta tensors, its outputs' metadata memoized. A meta kernel's output depends
    only on its arguments' shapes, strides, offsets, dtypes and devices and on the other arguments' values, and
    the same operators run on the same shapes in every repeated layer of a forward; so for an operator whose
    schema returns only new tensors (no alias, no mutation), outputs of the recorded shapes, strides, offsets,
    dtypes and storage sizes are made without running the kernel (a new storage each, as the kernel's).
    Anything else (a view, an in-place operator, a list, an argument of another type) runs the kernel."""
    fresh = _FRESH.get(func)
    if fresh is None:
        schema = func._schema
        fresh = _FRESH[func] = not schema.is_mutable and bool(schema.returns) and all(
            r.alias_info is None and str(r.type) == "Tensor" for r in schema.returns)
    key = (func, _meta_key(args), _meta_key(kwargs)) if fresh else None
    if key is None or key[1] is None or key[2] is None:
        return func(*args, **kwargs)
    found = _OUTPUTS.get(key)
    if found is not None:
        outs = tuple(_empty_meta(*m) for m in found)
        return outs[0] if len(outs) == 1 and not isinstance(found, list) else outs
    out = func(*args, **kwargs)
    outs = out if isinstance(out, tuple) else (out,)
    stores = {id(t.untyped_storage()) for t in outs if isinstance(t, torch.Tensor)}
    if all(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in outs) and len(stores) == len(outs) \
            and not stores & {id(a.untyped_storage()) for a in _tensors((args, kwargs))}:
        if len(_OUTPUTS) >= MAX_MEMO:
            _OUTPUTS.clear()
        meta = [(tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes())
                for t in outs]
        _OUTPUTS[key] = meta if isinstance(out, tuple) else tuple(meta)
    return out


def _empty_meta(shape, stride, offset, dtype, nbytes) -> torch.Tensor:
    """A meta tensor of this metadata on a new storage of ``nbytes``."""
    st = torch.UntypedStorage(nbytes, device="meta")
    return torch.empty(0, dtype=dtype, device="meta").set_(st, offset, shape, stride)


_PLAIN = (int, float, bool, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _meta_key(x):
    """A hashable description of an operator's arguments ``x`` that fixes its meta outputs: each tensor's shape,
    strides, offset, dtype and device, other values as they are; None for a value of another type."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype, x.device.type)
    if x is None or type(x) in _PLAIN or isinstance(x, _PLAIN):
        return (type(x).__name__, x) if type(x) in (float, bool) else x  # 1.0, True and 1 hash alike
    if type(x) in (tuple, list):
        items = tuple(_meta_key(v) for v in x)
        return None if any(i is None and v is not None for i, v in zip(items, x)) else (type(x).__name__, items)
    if type(x) is dict:
        items = tuple((k, _meta_key(v)) for k, v in x.items())
        return None if any(i is None and x[k] is not None for k, i in items) else ("d", items)
    return None


def _grouped_mm(args, kwargs) -> torch.Tensor:
    """``torch._grouped_mm``'s output on meta tensors in any dtype (its meta kernel accepts bfloat16 only): ``(S, K)``
    by ``(E, K, N)`` with group offsets gives ``(S, N)``; batched ``(E, S, K)`` by ``(E, K, N)`` gives ``(E, S, N)``."""
    a, b = args[0], args[1]
    dtype = kwargs.get("out_dtype") or a.dtype
    shape = (a.shape[0], b.shape[-1]) if a.dim() == 2 else (*a.shape[:-1], b.shape[-1])
    return torch.empty(shape, dtype=dtype, device=a.device)


_SAME = {aten._to_copy.default, aten.clone.default, aten.slice.Tensor, aten.select.int, aten.index.Tensor,
         aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.default, aten.alias.default, aten.t.default, aten.transpose.int,
         aten.permute.default, aten.reshape.default, aten.repeat.default, aten.contiguous.default}
_CMP = {aten.eq.Scalar: lambda a, b: a == b, aten.eq.Tensor: lambda a, b: a == b, aten.ne.Scalar: lambda a, b: a != b,
        aten.ne.Tensor: lambda a, b: a != b, aten.gt.Scalar: lambda a, b: a > b, aten.lt.Scalar: lambda a, b: a < b,
        aten.ge.Scalar: lambda a, b: a >= b, aten.le.Scalar: lambda a, b: a <= b,
        aten.mul.Tensor: lambda a, b: a * b, aten.mul.Scalar: lambda a, b: a * b,
        aten.add.Tensor: lambda a, b: a + b, aten.sub.Tensor: lambda a, b: a - b,
        aten.bitwise_and.Tensor: lambda a, b: bool(a) and bool(b),
        aten.logical_and.default: lambda a, b: bool(a) and bool(b)}


def _value(x, fills):
    if isinstance(x, torch.Tensor):
        return fills.get(x) if x in fills else None
    if isinstance(x, (bool, int, float)):
        return x
    return None


def _propagate(func, args, kwargs, out, fills):
    """The single value every element of ``out`` holds, when the inputs' values decide it; else None."""
    a = _value(args[0], fills) if args else None
    if func in _SAME:
        return None if a is None else (bool(a) if out.dtype == torch.bool else a)
    if func in (aten.all.default, aten.all.dim, aten.all.dims, aten.any.default, aten.any.dim, aten.any.dims):
        return None if a is None else bool(a)
    if func in (aten.logical_not.default, aten.bitwise_not.default):
        return None if a is None else (not a)
    if func in (aten.sum.default, aten.sum.dim_IntList):
        if a is None:
            return None
        return a * (args[0].numel() // max(out.numel(), 1))
    if func in _CMP and len(args) > 1:
        b = _value(args[1], fills)
        if a is None or b is None:
            return None
        return _CMP[func](a, b)
    return None
