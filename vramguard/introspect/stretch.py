"""Replays at many lengths from replays at a few: every number a replay records (each tensor's bytes, each cache
tensor's dimensions) as an exact polynomial in the length, fitted through replays at a few lengths and checked at
others. Knows nothing about what the numbers are (:mod:`vramguard.introspect.replay_trim`'s forward,
:mod:`vramguard.introspect.alloc_replay`'s tape).

A tensor's bytes are a product of its dimensions, and in a decoder's forward each dimension is a constant, the
tokens x, or the tokens padded to a whole number of a mixer's chunks: Mamba-2's chunked scan (transformers'
``torch_forward``, and mamba_ssm's ``mamba_chunk_scan_combined`` as :mod:`vramguard.introspect.mixers` models it)
pads the sequence to ``x + d`` with ``d = (-x) mod chunk`` and holds ``(x + d) / chunk`` chunks. No tensor
multiplies more than two such dimensions (attention scores: tokens x tokens; the scan's decay between chunks:
chunks x chunks), so between two breakpoints of the config (:func:`breakpoints`) every number is exactly

    a + b x + c d + e x^2 + f x d + g d^2,

a polynomial of degree 2 in x and d: periodic in the chunk, not quadratic in x alone, which is why a search over
the prompt of such a model replayed every prompt it tried. Here the lengths a search asks for are replayed until the
polynomial through them is known: first in x alone through three (a decode step does not pad), then in x and d
through six whose terms are independent, the coefficients exact rationals; the replays asked for beyond those it
passes through (:data:`TESTS`) must match it to the byte, and from then on it answers alone. A replay whose
structure (what is allocated and freed, in what order, with what labels) differs from the others, a test that
disagrees, a number the polynomial does not give as an integer, or no polynomial after :data:`MAX_KEPT` replays, and
every length is replayed, as without it (:class:`Stretch`). With the lengths fixed, every number is a polynomial in
the batch the same way (a tensor holds the batch once: at most a quadratic).
"""

from __future__ import annotations

from fractions import Fraction
from functools import lru_cache

# the config fields that name a chunked scan's chunk (Falcon-H1, GraniteMoeHybrid, Bamba, Zamba2...: mamba_chunk_size;
# Mamba-2: chunk_size)
PERIOD_FIELDS = ("mamba_chunk_size", "chunk_size")
MARGIN = 8  # tokens kept clear of a breakpoint (a window's edge: the decode steps cross it a step or two later)
TESTS = 2  # replays beyond those a polynomial passes through that must match it before it answers
MAX_KEPT = 12  # replays kept before a stretch gives up (a polynomial of 6 terms and its tests take 8)


def chunk_period(cfg) -> int | None:
    """The chunk a mixer of ``cfg`` (a text config) pads its sequence to: a config field's (:data:`PERIOD_FIELDS`),
    else the ``chunk_size`` default of a reference scan of its modeling module (:func:`loop_chunk`), or None."""
    return _field_period(cfg) or loop_chunk(cfg)


def _field_period(cfg) -> int | None:
    for k in PERIOD_FIELDS:
        v = getattr(cfg, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v >= 4:
            return v
    return None


# transformers' reference scans that loop in Python over chunks of their ``chunk_size`` argument, whose default is
# the chunk the model runs (``torch_chunk_gated_delta_rule`` of Qwen3-Next, Qwen3.5, Olmo-Hybrid...: 64)
LOOP_SCANS = ("torch_chunk_gated_delta_rule",)
# the chunks a loop's replay holds in full before :mod:`vramguard.introspect.loop_trim` may cut it (its FIRST +
# ALIKE + 1: tests/test_loop_trim.py checks): below them the tapes of two lengths differ in structure
LOOP_FULL_CHUNKS = 5


def loop_chunk(cfg) -> int | None:
    """The ``chunk_size`` default of a :data:`LOOP_SCANS` function in the modeling module of ``cfg``'s model type
    (``transformers.models.<type>.modeling_<type>``), or None (no such function, or transformers cannot import
    that module)."""
    model_type = getattr(cfg, "model_type", None)
    return _loop_chunk(model_type) if isinstance(model_type, str) and model_type.isidentifier() else None


@lru_cache(maxsize=64)
def _loop_chunk(model_type: str) -> int | None:
    """:func:`loop_chunk` of a model type, looked up once per process."""
    import importlib
    import inspect

    try:  # a plan that replays a generic model has imported transformers already
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except Exception:  # noqa: BLE001 -- any import failure: no period known, the lengths are replayed one by one
        return None
    for name in LOOP_SCANS:
        fn = getattr(module, name, None)
        try:
            default = inspect.signature(fn).parameters["chunk_size"].default if callable(fn) else None
        except (KeyError, TypeError, ValueError):
            continue
        if isinstance(default, int) and not isinstance(default, bool) and default >= 4:
            return default
    return None


def first_periodic(cfg, period: int) -> int:
    """The shortest length from which the replays of ``cfg``'s model are one polynomial in the length and its
    padding to ``period``: past two chunks (a scan without a Python loop), or past :data:`LOOP_FULL_CHUNKS` chunks
    where the period is a loop's (:func:`loop_chunk`; below them the loop is replayed whole)."""
    return (2 if _field_period(cfg) else LOOP_FULL_CHUNKS) * period + 1


def breakpoints(cfg) -> tuple[int, ...]:
    """Lengths where a tensor's size stops following one polynomial: the sliding window, the attention chunk and
    the original context of a long-RoPE model, as the text config ``cfg`` gives them."""
    found = {getattr(cfg, k, None) for k in ("sliding_window", "attention_chunk_size",
                                              "original_max_position_embeddings")}
    return tuple(sorted(v for v in found if isinstance(v, int) and not isinstance(v, bool) and v > 0))


def context(cfg) -> int:
    """The tokens the text config ``cfg``'s model runs at (``max_position_embeddings``; 2**20 where it names none)."""
    ctx = getattr(cfg, "max_position_embeddings", None)
    return ctx if isinstance(ctx, int) and not isinstance(ctx, bool) and ctx > 0 else 1 << 20


def _basis(x: int, period: int | None) -> list[int]:
    """The polynomial's terms at ``x``: in x and its padding d to ``period``, or (None) in x alone."""
    if period is None:
        return [1, x, x * x]
    d = (-x) % period
    return [1, x, d, x * x, x * d, d * d]


class Fit:
    """The polynomial of every number of a vector through the vectors ``rows`` replayed at the lengths ``xs``
    (:func:`_basis`: in x and its padding to ``period``, or with ``period`` None in x alone); :meth:`at` gives the
    vector at any length, None where a number is no integer there. Raises ValueError where the lengths do not
    determine it (a singular design)."""

    def __init__(self, xs: tuple[int, ...], rows: list[tuple[int, ...]], period: int | None):
        import numpy as np

        self.period = period
        inv = _inverse([[Fraction(v) for v in _basis(x, period)] for x in xs])
        den = 1
        for row in inv:
            for v in row:
                den = den * v.denominator // _gcd(den, v.denominator)
        adj = np.array([[int(v * den) for v in row] for row in inv], dtype=object)  # inverse = adj / den
        coef = adj.dot(np.array(rows, dtype=object))  # basis coefficients x den, one column per number
        g = _gcd_all(coef, den)
        self.den = den // g
        coef = coef // g
        self.bound = [max((abs(int(v)) for v in row), default=0) for row in coef]  # per basis function
        self.coef = coef.astype(np.int64) if max(self.bound, default=0) < 2**62 else coef

    def at(self, x: int) -> tuple[int, ...] | None:
        import numpy as np

        b = _basis(x, self.period)
        if self.coef.dtype == np.int64 and sum(c * abs(v) for c, v in zip(self.bound, b)) < 2**62:
            vals = np.array(b, dtype=np.int64).dot(self.coef)  # no partial sum can overflow
        else:
            vals = np.array(b, dtype=object).dot(self.coef.astype(object))
        q = vals // self.den
        if np.any(vals - q * self.den != 0):
            return None
        return tuple(q.tolist())


def _gcd(a: int, b: int) -> int:
    from math import gcd
    return gcd(a, b)


def _gcd_all(coef, den: int) -> int:
    """The greatest common divisor of ``den`` and every entry of ``coef``."""
    from math import gcd
    g = den
    for v in coef.flat:
        g = gcd(g, int(v))
        if g == 1:
            break
    return g


def _inverse(a: list[list[Fraction]]) -> list[list[Fraction]]:
    """The inverse of the square matrix ``a`` (Gauss-Jordan on fractions). Raises ValueError where it is singular."""
    n = len(a)
    m = [row[:] + [Fraction(int(i == j)) for j in range(n)] for i, row in enumerate(a)]
    for c in range(n):
        pivot = next((r for r in range(c, n) if m[r][c] != 0), None)
        if pivot is None:
            raise ValueError("the lengths do not determine the polynomial")
        m[c], m[pivot] = m[pivot], m[c]
        p = m[c][c]
        m[c] = [v / p for v in m[c]]
        for r in range(n):
            if r != c and m[r][c] != 0:
                f = m[r][c]
                m[r] = [v - f * w for v, w in zip(m[r], m[c])]
    return [row[n:] for row in m]


Sample = tuple[object, tuple[int, ...]]  # (the structure, equal at every length; the numbers)


class Stretch:
    """The replays of one length (or the batch), all else the same, at the values from ``lo`` up to ``end``
    (exclusive), from replays at a few (see the module docstring); ``period``: the chunk the length is padded to
    (None: a polynomial in x alone).

    The caller asks :meth:`at` first; where it answers None, the caller replays the value and, where :meth:`wants`
    it, hands the replay to :meth:`keep`. ``state``: ``"new"`` (replays are kept), ``"ready"`` (:meth:`at` answers)
    or ``"failed"``."""

    def __init__(self, lo: int, end: int, period: int | None):
        self.lo, self.end, self.period = lo, end, period
        self.state = "new" if lo < end else "failed"
        self.samples: dict[int, Sample] = {}  # the replays kept, in the order asked
        self.fit: Fit | None = None
        self.structure: object = None
        self.memo: dict = {}  # what the caller derives from the structure once, kept with it
        self.trials = [_Trial(None)] + ([_Trial(period)] if period is not None else [])

    def covers(self, x: int) -> bool:
        return self.lo <= x < self.end

    def wants(self, x: int) -> bool:
        """Whether a replay of ``x`` the caller made is to be kept (:meth:`keep`)."""
        return self.state == "new" and self.covers(x) and x not in self.samples

    def keep(self, x: int, sample: Sample | None) -> None:
        """A replay of ``x`` the caller made (None: it could not be made, and nothing is fitted): the first
        polynomial (:class:`_Trial`) that :data:`TESTS` replays beyond its own points match is taken (``ready``);
        where none can be any more, or after :data:`MAX_KEPT` replays, ``failed``."""
        if not self.wants(x):
            return
        if sample is None or (self.samples and sample[0] != self.structure):
            self.state = "failed"
            return
        if not self.samples:
            self.structure = sample[0]
        self.samples[x] = (self.structure, sample[1])  # one structure kept for all
        for trial in self.trials:
            trial.add(x, self.samples)
            if trial.tests >= TESTS:
                self.fit, self.state = trial.fit, "ready"
                return
        if all(t.bad for t in self.trials) or len(self.samples) >= MAX_KEPT:
            self.state = "failed"

    def at(self, x: int) -> Sample | None:
        """The Sample of ``x``: a replay kept, or from the polynomial (what its replay gives); None where the caller
        is to replay it (not covered, no polynomial yet or any more)."""
        if not self.covers(x) or self.state == "failed":
            return None
        if self.state != "ready":
            return self.samples.get(x)
        numbers = self.fit.at(x)  # type: ignore[union-attr]
        if numbers is None:  # no integer: the polynomial does not hold there; later values are replayed too
            self.state = "failed"
            return None
        return self.structure, numbers


class _Trial:
    """One polynomial of a :class:`Stretch`, in x alone or in x and its padding to ``period``: the first values
    kept whose terms (:func:`_basis`) are independent, as many as it has terms, give it; every other value kept is a
    test (``tests``: how many it matched; ``bad`` from the first it does not match)."""

    def __init__(self, period: int | None):
        self.period = period
        self.rows: list[list[Fraction]] = []  # the terms of the values taken, reduced (each row's first nonzero
        self.xs: list[int] = []  # column is its pivot), and those values
        self.fit: Fit | None = None
        self.tests = 0
        self.bad = False

    def add(self, x: int, samples: dict) -> None:
        """Take or test the value ``x`` of ``samples`` (value -> Sample)."""
        if self.bad:
            return
        if self.fit is not None:
            self.bad = self.fit.at(x) != samples[x][1]
            self.tests += not self.bad
            return
        v = [Fraction(t) for t in _basis(x, self.period)]
        for r in self.rows:
            c = next(i for i, t in enumerate(r) if t)
            if v[c]:
                f = v[c] / r[c]
                v = [a - f * b for a, b in zip(v, r)]
        if not any(v):  # its terms depend on those taken: a test of the polynomial to come
            return
        self.rows.append(v)
        self.xs.append(x)
        if len(self.xs) == len(v):
            self.fit = Fit(tuple(self.xs), [samples[k][1] for k in self.xs], self.period)
            for k in samples:  # the values kept before that were not taken test it now
                if k not in self.xs:
                    self.add(k, samples)
