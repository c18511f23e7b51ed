"""Tensors that hold no values, only a shape, strides, a dtype and a storage whose allocation and release are
written to a tape: the bookkeeping of :class:`vramguard.introspect.tracker.StorageTracker` without torch.

A new storage is an allocation ``(key, bytes)`` (keys count up from 0, as the tracker numbers them); a storage is
freed ``(key, -1)`` when Python drops its last reference (CPython frees an object as its reference count reaches
zero), which is when PyTorch's caching allocator gets the block back. Views (``view``, ``transpose``, slicing,
``expand``...) share their input's storage; an operator that PyTorch computes into a new tensor allocates one; a
``reshape`` or ``contiguous`` copies exactly where PyTorch's ``computeStride`` (``aten/src/ATen/TensorUtils.cpp``)
finds no view. Code written over these tensors in the order of transformers' own modelling code, with the same
local variables, allocates and frees in the order the meta-device replay records.
"""

from __future__ import annotations

from vramguard.dtypes import BYTES


class Tape:
    """The events of the storages created under it: ``(key, bytes)`` per allocation, ``(key, -1)`` per free."""

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.next_key = 0

    def new(self, shape: tuple[int, ...], dtype: str) -> "T":
        """A new contiguous tensor (one allocation of ``numel x element size`` bytes)."""
        n = 1
        for d in shape:
            n *= d
        st = Storage(self, self.next_key)
        self.next_key += 1
        self.events.append((st.key, n * BYTES[dtype]))
        return T(self, tuple(shape), _contiguous(shape), dtype, st)


class Storage:
    """One allocation; its free is written when the last tensor viewing it is dropped."""

    __slots__ = ("tape", "key")

    def __init__(self, tape: Tape, key: int) -> None:
        self.tape, self.key = tape, key

    def __del__(self) -> None:
        self.tape.events.append((self.key, -1))


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    return tuple(x if y == 1 else y for x, y in zip(a, b))


def _dense(shape, strides) -> bool:
    """``is_non_overlapping_and_dense``: the elements fill a block of ``numel`` with no gap."""
    expected = 1
    for d, st in sorted(((d, st) for d, st in zip(shape, strides) if d != 1), key=lambda x: x[1]):
        if st != expected:
            return False
        expected *= d
    return True


def _layout(inputs: list["T"], shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides of an elementwise operator's output (``TensorIteratorBase``: ``fast_set_up`` where every input has
    the output's shape and one dense layout, else ``reorder_dimensions``' insertion sort of the dims by the inputs'
    strides, broadcast dims skipped, equal strides ordered by size), a dense tensor in that order."""
    n = len(shape)
    if all(t.shape == shape for t in inputs):
        first = inputs[0].strides
        if all(t.is_contiguous() for t in inputs):
            return _contiguous(shape)
        if all(t.strides == first for t in inputs) and _dense(shape, first):
            return first
    strides = []
    for t in inputs:  # broadcast to ``shape``: a dim of size 1 stretched has stride 0
        lead = n - len(t.shape)
        strides.append([0] * lead + [0 if d == 1 and shape[i + lead] != 1 else st
                                     for i, (d, st) in enumerate(zip(t.shape, t.strides))])

    def should_swap(d0: int, d1: int) -> int:
        for st in strides:
            s0, s1 = st[d0], st[d1]
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0
    perm = list(range(n - 1, -1, -1))  # perm[0]: the fastest-moving dim
    for i in range(1, n):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = should_swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    out, acc = [0] * n, 1
    for d in perm:
        out[d] = acc
        acc *= shape[d]
    return tuple(out)


def _view_strides(shape, strides, new_shape) -> tuple[int, ...] | None:
    """PyTorch's ``computeStride``: the strides of ``new_shape`` as a view of ``(shape, strides)``, or None where no
    view exists (``reshape`` then copies)."""
    numel = 1
    for d in shape:
        numel *= d
    if numel == 0:
        return _contiguous(new_shape)
    out = [0] * len(new_shape)
    view_d = len(new_shape) - 1
    chunk_base = strides[-1] if strides else 1
    tensor_numel = 1
    view_numel = 1
    for d in range(len(shape) - 1, -1, -1):
        tensor_numel *= shape[d]
        if d == 0 or (shape[d - 1] != 1 and strides[d - 1] != tensor_numel * chunk_base):
            while view_d >= 0 and (view_numel < tensor_numel or new_shape[view_d] == 1):
                out[view_d] = view_numel * chunk_base
                view_numel *= new_shape[view_d]
                view_d -= 1
            if view_numel != tensor_numel:
                return None
            if d > 0:
                chunk_base = strides[d - 1]
                tensor_numel = 1
                view_numel = 1
    if view_d != -1:
        return None
    return tuple(out)


class T:
    """A tensor without values (see the module docstring)."""

    __slots__ = ("tape", "shape", "strides", "dtype", "st")

    def __init__(self, tape: Tape, shape, strides, dtype: str, st: Storage | None) -> None:
        self.tape, self.shape, self.strides, self.dtype, self.st = tape, tuple(shape), tuple(strides), dtype, st

    # ---- views ---------------------------------------------------------------------------------------------
    def _as(self, shape, strides, dtype: str | None = None) -> "T":
        return T(self.tape, shape, strides, dtype or self.dtype, self.st)

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def is_contiguous(self) -> bool:
        expected = 1
        for d, s in zip(reversed(self.shape), reversed(self.strides)):
            if d != 1 and s != expected:
                return False
            expected *= d
        return True

    def _resolve(self, shape) -> tuple[int, ...]:
        shape = tuple(shape)
        if -1 in shape:
            known = 1
            for d in shape:
                if d != -1:
                    known *= d
            shape = tuple(self.numel() // known if d == -1 else d for d in shape)
        return shape

    def view(self, *shape) -> "T":
        shape = self._resolve(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)
        strides = _view_strides(self.shape, self.strides, shape)
        if strides is None:
            raise ValueError("view of a non-viewable layout")
        return self._as(shape, strides)

    def reshape(self, *shape) -> "T":
        shape = self._resolve(shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape)
        strides = _view_strides(self.shape, self.strides, shape)
        return self._as(shape, strides) if strides is not None else self.contiguous(force=True).view(shape)

    def transpose(self, a: int, b: int) -> "T":
        shape, strides = list(self.shape), list(self.strides)
        shape[a], shape[b] = shape[b], shape[a]
        strides[a], strides[b] = strides[b], strides[a]
        return self._as(shape, strides)

    def unsqueeze(self, dim: int) -> "T":
        dim = dim if dim >= 0 else len(self.shape) + dim + 1
        inner = self.strides[dim] * self.shape[dim] if dim < len(self.shape) else 1
        return self._as(self.shape[:dim] + (1,) + self.shape[dim:], self.strides[:dim] + (inner,) + self.strides[dim:])

    def expand(self, *shape) -> "T":
        shape = tuple(shape)
        lead = len(shape) - len(self.shape)
        strides = [0] * lead + list(self.strides)
        out = []
        for i, d in enumerate(shape):
            if d == -1:
                d = self.shape[i - lead]
            elif i >= lead and self.shape[i - lead] == 1 and d != 1:
                strides[i] = 0
            out.append(d)
        return self._as(out, strides)

    def narrow(self, dim: int, start: int, length: int) -> "T":
        """``x[..., start:start + length]`` on ``dim`` (a view)."""
        dim = dim if dim >= 0 else len(self.shape) + dim
        shape = list(self.shape)
        shape[dim] = length
        return self._as(shape, self.strides)

    def select_last(self, dim: int) -> "T":
        """``x[:, -1]`` on ``dim``: the dim dropped (a view)."""
        dim = dim if dim >= 0 else len(self.shape) + dim
        return self._as(self.shape[:dim] + self.shape[dim + 1:], self.strides[:dim] + self.strides[dim + 1:])

    # ---- new tensors ---------------------------------------------------------------------------------------
    def new(self, shape, dtype: str | None = None) -> "T":
        return self.tape.new(tuple(shape), dtype or self.dtype)

    def like(self, shape, strides, dtype: str | None = None) -> "T":
        """A new tensor of ``shape`` laid out with ``strides`` (dense)."""
        out = self.tape.new(tuple(shape), dtype or self.dtype)
        out.strides = tuple(strides)
        return out

    def contiguous(self, force: bool = False) -> "T":
        return self if self.is_contiguous() and not force else self.new(self.shape)

    def clone(self) -> "T":
        return self.like(self.shape, _layout([self], self.shape))

    def to(self, dtype: str, copy: bool = False) -> "T":
        """``Tensor.to`` (``memory_format=torch.preserve_format``): the input's layout kept."""
        return self if dtype == self.dtype and not copy else self.like(self.shape, _layout([self], self.shape), dtype)

    def unary(self) -> "T":
        """An elementwise operator with one tensor input (``neg``, ``cos``, ``rsqrt``, ``silu``, ``x * 2.0``...)."""
        return self.like(self.shape, _layout([self], self.shape))

    def binary(self, other: "T", dtype: str | None = None) -> "T":
        """An elementwise operator of two tensors, broadcast."""
        shape = _broadcast(self.shape, other.shape)
        return self.like(shape, _layout([self, other], shape), dtype)

    def reduce_last(self, dtype: str | None = None, keepdim: bool = True) -> "T":
        """``mean(-1, keepdim=True)``, ``argmax(-1)``..."""
        return self.new(self.shape[:-1] + ((1,) if keepdim else ()), dtype)

    def scalar(self, dtype: str) -> "T":
        """A 0-dim result (``sum()``, ``x == n``)."""
        return self.new((), dtype)


def cat(tensors: list[T], dim: int) -> T:
    """``torch.cat``: a new tensor, the inputs' sizes added on ``dim``."""
    first = tensors[0]
    dim = dim if dim >= 0 else len(first.shape) + dim
    size = sum(t.shape[dim] for t in tensors)
    return first.new(first.shape[:dim] + (size,) + first.shape[dim + 1:])


def linear(x: T, out_features: int) -> T:
    """``nn.Linear`` (``aten.linear``: the input folded to 2-D, copied where no view folds it, then one ``mm`` or
    ``addmm`` output)."""
    rows = x.numel() // x.shape[-1]
    folded = x.reshape(rows, x.shape[-1])
    out = folded.new((rows, out_features))
    del folded
    return out.view(*x.shape[:-1], out_features)


def matmul(a: T, b: T) -> T:
    """``torch.matmul`` of two 4-D tensors (batch dims equal): both folded to 3-D by ``reshape`` (a copy where no view
    does it, freed after the ``bmm``), then a ``bmm`` output viewed back."""
    batch = a.shape[:-2]
    n = 1
    for d in batch:
        n *= d
    fa = a.reshape(n, a.shape[-2], a.shape[-1])
    fb = b.reshape(n, b.shape[-2], b.shape[-1])
    out = fa.new((n, a.shape[-2], b.shape[-1]))
    del fa, fb
    return out.view(*batch, a.shape[-2], b.shape[-1])
