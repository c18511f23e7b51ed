"""A model of PyTorch's CUDA caching allocator: where each tensor of a tape lands, the reserved bytes it leaves,
and the first allocation that cannot be placed under a cap. Pure Python, no torch.

Rules, from ``c10/cuda/CUDACachingAllocator.cpp`` (``DeviceCachingAllocator``; read at the pytorch/pytorch commit
001074d25084fdb87a799823e395a50f5ec044d3, checked against the behaviour of torch 2.11 on an H200 and 2.13 on CPU,
whose constants and ``malloc`` path are the same):

* ``round_size``: every request is rounded up to a multiple of ``kMinBlockSize`` = 512 B (no
  ``roundup_power2_divisions`` by default).
* ``get_pool``: requests of at most ``kSmallSize`` = 1 MiB go to the small pool, larger ones to the large pool;
  the pools never share memory.
* ``get_allocation_size``: a new segment (``cudaMalloc``) is ``kSmallBuffer`` = 2 MiB for a small request,
  ``kLargeBuffer`` = 20 MiB for a request under ``kMinLargeAlloc`` = 10 MiB, else the request rounded up to
  ``kRoundLarge`` = 2 MiB.
* ``get_free_block``: best fit: the smallest free block of the pool at least as large as the request (ties: the
  lowest address, ``BlockComparatorSize``). cudaMalloc hands out addresses downwards (each new segment of the
  H200 traces in ``benchmarks/results/h200_edge/run2`` lies below the one before), so a tie goes to the newest
  segment; the model places its segments the same way. In a process that has given a model's memory back before
  (a model loaded, deleted, then ``empty_cache``), cudaMalloc reuses the freed address range from its low end
  upwards: in the H200 traces of such processes every new segment lies above the one before, so a tie goes to
  the oldest segment (``AllocatorConfig.freed_before``). This is the driver's behaviour as observed, not a
  documented rule: where a freed range has holes that fit, a new segment can land in one of them, and which it is
  depends on the freed model's own segments (benchmarks/README.md, "After a freed model").
  ``CachingAllocator.segment_addresses`` replays recorded placements. With
  ``max_split_size`` set, a request below it never takes a block of at least that size, and a request above it
  takes only a block less than ``kLargeBuffer`` larger.
* ``should_split``: the remainder of a found block becomes a free block if it is at least 512 B (small pool, or
  expandable segments), or more than ``kSmallSize`` = 1 MiB (large pool, request under ``max_split_size``);
  otherwise the whole block is handed out.
* ``free_block`` / ``try_merge_blocks``: a freed block merges with its free neighbours in the same segment.
* ``alloc_block``: under ``set_per_process_memory_fraction`` a new segment is refused when
  ``reserved + allocation size > allowed``; ``malloc`` then calls ``release_cached_blocks`` (every segment that
  is entirely free goes back to CUDA; ``release_available_cached_blocks`` does nothing unless ``max_split_size``
  is set) and tries once more before raising the out-of-memory error.
* ``emptyCache`` (``torch.cuda.empty_cache``) is ``release_cached_blocks``.
* Expandable segments (``expandable_segments:True``, Note [Expandable Segments]): one segment per pool that grows
  at its end in pages of 20 MiB (large pool) or 2 MiB (small pool); ``try_allocate_expandable_block`` maps the
  pages a request needs beyond the free block at the segment's end, at the lowest unmapped address that fits.
  ``should_split`` keeps any remainder of at least 512 B, ``release_cached_blocks`` unmaps the whole pages of
  free blocks, and the cap check of ``alloc_block`` still uses ``get_allocation_size`` of the request. Best fit
  counts a free block as the size it can grow to (``expandable_size``: its bytes plus the unmapped range right
  after it) and walks on in size order while the next block can grow to less; after a freed model, whose pages
  were unmapped in place, a free block before that range and the one before the segment's end differ there
  (checked address for address against the H200 trace in ``benchmarks/results/h200_freed_trace``).

Garbage collection (``garbage_collection_threshold``) and the per-stream split of pools are not modelled: the
tapes have one stream and the threshold is off by default.
"""

from __future__ import annotations

from collections.abc import Iterator

from bisect import bisect_left, insort
from dataclasses import dataclass, field

from vramguard.memory.alloc_values import check_value

K_MIN_BLOCK = 512
K_SMALL_SIZE = 1 << 20
K_SMALL_BUFFER = 2 << 20
K_MIN_LARGE_ALLOC = 10 << 20
K_ROUND_LARGE = 2 << 20
K_LARGE_BUFFER = 20 << 20
NO_LIMIT = 1 << 62


def round_size(nbytes: int) -> int:
    """``round_size``: ``nbytes`` up to a multiple of 512 (512 for 0): 1 -> 512, 1,000 -> 1,024."""
    return max(K_MIN_BLOCK, -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK)


def allocation_size(size: int) -> int:
    """``get_allocation_size``: the segment a rounded request of ``size`` bytes opens:
    512 -> 2 MiB; 1 MiB + 512 -> 20 MiB; 10 MiB -> 10 MiB; 10 MiB + 512 -> 12 MiB."""
    if size <= K_SMALL_SIZE:
        return K_SMALL_BUFFER
    if size < K_MIN_LARGE_ALLOC:
        return K_LARGE_BUFFER
    return -(-size // K_ROUND_LARGE) * K_ROUND_LARGE


# the options PYTORCH_CUDA_ALLOC_CONF accepts: c10/core/AllocatorConfig.h (the device-generic ones) and
# c10/cuda/CUDAAllocatorConfig.h ``getKeys`` (torch 2.13); PyTorch refuses any other key at start
ALLOC_CONF_KEYS = frozenset({
    "max_split_size_mb", "max_non_split_rounding_mb", "garbage_collection_threshold", "roundup_power2_divisions",
    "expandable_segments", "pinned_use_background_threads", "backend", "release_lock_on_cudamalloc",
    "pinned_use_cuda_host_register", "release_lock_on_hipmalloc", "pinned_use_hip_host_register",
    "graph_capture_record_stream_reuse", "pinned_reserve_segment_size_mb", "pinned_num_register_threads",
    "per_process_memory_fraction", "pinned_free_catch_all", "throw_on_cudamalloc_oom"})


def _options(conf: str) -> list[str]:
    """``key:value`` items of ``conf``, split at the commas outside ``[...]`` lists
    (``roundup_power2_divisions:[64:8,>:1],expandable_segments:True`` is two items)."""
    items, depth, cur = [], 0, ""
    for ch in conf.replace(";", ","):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth <= 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    return [i for i in items + [cur] if i.strip()]


@dataclass(frozen=True)
class AllocatorConfig:
    """The ``PYTORCH_CUDA_ALLOC_CONF`` settings the model follows; ``allowed_bytes``: the cap of
    ``set_per_process_memory_fraction`` (or the card's free memory), None for none; ``freed_before``: the process
    has given a model's memory back to CUDA before, so cudaMalloc places new segments upwards (module docstring)."""

    expandable_segments: bool = False
    max_split_size: int = NO_LIMIT
    allowed_bytes: int | None = None
    freed_before: bool = False

    @classmethod
    def parse(cls, conf: str | None, allowed_bytes: int | None = None) -> AllocatorConfig:
        """Read ``PYTORCH_CUDA_ALLOC_CONF`` text (``expandable_segments:True,max_split_size_mb:512``).

        Raises ValueError naming the option for a value PyTorch refuses at start (:func:`check_value`: not a
        boolean or a number, a ``max_split_size_mb`` under 20, a ``garbage_collection_threshold`` outside (0, 1),
        ``roundup_power2_divisions`` that are not powers of 2...), another ``backend`` than ``native``
        (``cudaMallocAsync`` is not this allocator), and an option PyTorch does not know (:data:`ALLOC_CONF_KEYS`;
        PyTorch refuses it at start); the known options the model does not follow (``garbage_collection_threshold``,
        ``roundup_power2_divisions``...) are ignored (:func:`ignored_options` names them)."""
        expandable, split = False, NO_LIMIT
        for part in _options(conf or ""):
            key, _, value = part.partition(":")
            key, value = key.strip(), value.strip()
            if key not in ALLOC_CONF_KEYS:
                raise ValueError(f"{key!r} is not an option of PyTorch's allocator (its options include "
                                 "expandable_segments and max_split_size_mb)")
            check_value(key, value)
            if key == "expandable_segments":
                expandable = value in ("True", "true", "1")
            elif key == "max_split_size_mb":
                split = int(value) << 20
            elif key == "backend" and value != "native":
                raise ValueError(f"backend:{value} is not the caching allocator this model follows (backend:native)")
        return cls(expandable, split, allowed_bytes)


def backend(conf: str | None) -> str:
    """The ``backend`` option of ``conf`` (``native``, the caching allocator, when not given)."""
    return next((v.strip() for k, _, v in (part.partition(":") for part in _options(conf or ""))
                 if k.strip() == "backend"), "native")


def ignored_options(conf: str | None) -> list[str]:
    """The options of ``conf`` that the model does not follow (it follows ``expandable_segments``,
    ``max_split_size_mb`` and ``backend:native``), e.g. ``["garbage_collection_threshold"]``."""
    keys = [part.partition(":")[0].strip() for part in _options(conf or "")]
    return [k for k in keys if k not in ("expandable_segments", "max_split_size_mb", "backend")]


class Block:
    """A range of one segment: ``addr`` and ``size`` in bytes; ``state``: "used", "free" or "unmapped"."""

    __slots__ = ("addr", "next", "prev", "seg", "size", "state")

    def __init__(self, seg: Segment, addr: int, size: int, state: str = "free"):
        self.seg, self.addr, self.size, self.state = seg, addr, size, state
        self.prev: Block | None = None
        self.next: Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.addr)


@dataclass(eq=False)
class Segment:
    """One ``cudaMalloc`` (or one expandable segment); ``small``: in the small pool."""

    addr: int
    small: bool
    expandable: bool = False
    head: Block | None = None

    def blocks(self):
        b = self.head
        while b is not None:
            yield b
            b = b.next


@dataclass(frozen=True)
class OutOfMemory:
    """The first request that could not be placed: ``request_bytes`` (rounded), ``allocation_bytes`` (the segment
    it asked for, as the error message prints it), and the allocated and reserved bytes at that moment."""

    index: int
    request_bytes: int
    allocation_bytes: int
    allocated_bytes: int
    reserved_bytes: int


def _growable_size(b: Block) -> int:
    """``expandable_size`` in ``get_free_block``: a free block's size plus the unmapped range right after it."""
    return b.size + (b.next.size if b.next is not None and b.next.state == "unmapped" else 0)


@dataclass
class CachingAllocator:
    """The allocator state. ``malloc(nbytes) -> handle``, ``free(handle)``, ``empty_cache()``; raises nothing:
    a request that cannot be placed returns None and is recorded in ``oom``."""

    config: AllocatorConfig = field(default_factory=AllocatorConfig)
    allocated_bytes: int = 0
    reserved_bytes: int = 0
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    segments: list[Segment] = field(default_factory=list)
    oom: OutOfMemory | None = None
    requests: int = 0
    _free: dict[bool, list] = field(default_factory=lambda: {True: [], False: []})
    _next_addr: int = 1 << 60  # segments are placed downwards from here (see _alloc_block)
    _top: int = 1 << 60  # or upwards from here, in a process that has freed memory before
    _expandable: dict[bool, Segment] = field(default_factory=dict)
    # where the driver put each new segment, in order (a recorded trace's segment_alloc addresses); None: each new
    # segment below the last, as cudaMalloc places them in a process that has freed no memory yet
    segment_addresses: Iterator[int] | None = None
    small_segments_opened: int = 0  # small-pool segments opened (or expandable pages mapped) so far

    # ---- public ------------------------------------------------------------------------------------------------
    def malloc(self, nbytes: int, release: bool = True) -> Block | None:
        """Place a request of ``nbytes`` (``DeviceCachingAllocator::malloc``); None when it cannot be placed.
        ``release=False``: None, with nothing changed or recorded, where it would need ``release_cached_blocks``."""
        size = -(-nbytes // K_MIN_BLOCK) * K_MIN_BLOCK if nbytes > K_MIN_BLOCK else K_MIN_BLOCK  # round_size
        small = size <= K_SMALL_SIZE
        config = self.config
        lst = self._free[small]
        i = bisect_left(lst, (size,))
        if i == len(lst):
            block = None
        elif config.max_split_size == NO_LIMIT and not lst[i][2].seg.expandable:  # best fit, taken as it is
            block = lst.pop(i)[2]
        else:
            block = self._get_free_block(size, small)
        if block is None:
            block = self._alloc_block(size, small)
            if block is None and not release:
                return None
        self.requests += 1
        if block is None:
            if self._release_cached_blocks():
                block = self._alloc_block(size, small)
            if block is None:
                if self.oom is None:
                    self.oom = OutOfMemory(self.requests - 1, size, allocation_size(size), self.allocated_bytes,
                                           self.reserved_bytes)
                return None
        remaining = block.size - size  # _take
        if (remaining >= K_MIN_BLOCK if small or config.expandable_segments else  # _should_split
                remaining > K_SMALL_SIZE and size < config.max_split_size):
            rest = Block(block.seg, block.addr + size, remaining)
            nxt = rest.next = block.next
            rest.prev = block
            if nxt is not None:
                nxt.prev = rest
            block.next = rest
            block.size = size
            insort(lst, (remaining, rest.addr, rest))
        block.state = "used"
        self.allocated_bytes += block.size
        if self.allocated_bytes > self.peak_allocated_bytes:
            self.peak_allocated_bytes = self.allocated_bytes
        return block

    def free(self, block: Block | None) -> None:
        """Return ``block`` to its pool, merged with its free neighbours (``free_block``; :meth:`_unlist` and
        :meth:`_merge` written out here, the hottest path of a replay)."""
        if block is None or block.state != "used":
            return
        self.allocated_bytes -= block.size
        block.state = "free"
        lst = self._free[block.seg.small]
        other = block.prev
        if other is not None and other.state == "free":
            i = bisect_left(lst, (other.size, other.addr))
            if i < len(lst) and lst[i][2] is other:
                del lst[i]
            block.addr, block.prev, block.size = other.addr, other.prev, block.size + other.size
            if block.prev is not None:
                block.prev.next = block
            else:
                block.seg.head = block
        other = block.next
        if other is not None and other.state == "free":
            i = bisect_left(lst, (other.size, other.addr))
            if i < len(lst) and lst[i][2] is other:
                del lst[i]
            block.next, block.size = other.next, block.size + other.size
            if block.next is not None:
                block.next.prev = block
        insort(lst, (block.size, block.addr, block))

    @classmethod
    def from_segments(cls, config: AllocatorConfig, segments: list[tuple[int, bool, list[tuple[int, bool]]]]):
        """The state ``torch.cuda.memory_snapshot()`` recorded: per segment its address, whether it is in the small
        pool, and its blocks in address order as (bytes, in use). New segments go below the lowest one."""
        a = cls(config)
        for addr, small, blocks in sorted(segments):
            seg, prev, at = Segment(addr, small), None, addr
            for size, used in blocks:
                b = Block(seg, at, size, "used" if used else "free")
                b.prev, at = prev, at + size
                if prev is None:
                    seg.head = b
                else:
                    prev.next = b
                prev = b
                if used:
                    a.allocated_bytes += size
                else:
                    a._list(b)
            a.segments.append(seg)
            a.reserved_bytes += at - addr
        a._next_addr = min((s.addr for s in a.segments), default=a._next_addr)
        a._top = max((s.addr + sum(b.size for b in s.blocks()) for s in a.segments), default=a._top)
        a.peak_reserved_bytes, a.peak_allocated_bytes = a.reserved_bytes, a.allocated_bytes
        return a

    def copy(self) -> CachingAllocator:
        """An independent copy of this state (segments, blocks, free lists, counters; ``segment_addresses`` is
        shared): a state replayed once, then continued in several ways, as each replay continues the load."""
        from dataclasses import replace
        new = replace(self, segments=[], _free={True: [], False: []}, _expandable={})
        blocks: dict[int, Block] = {}
        for seg in self.segments:
            new.segments.append(copy := Segment(seg.addr, seg.small, seg.expandable))
            prev = None
            for b in seg.blocks():
                blocks[id(b)] = c = Block(copy, b.addr, b.size, b.state)
                if prev is not None:
                    c.prev, prev.next = prev, c
                prev = c
            copy.head = blocks[id(seg.head)] if seg.head is not None else None
        new._free = {small: [(n, a, blocks[id(b)]) for n, a, b in lst] for small, lst in self._free.items()}
        new._expandable = {small: new.segments[self.segments.index(seg)] for small, seg in self._expandable.items()}
        return new

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: release every free segment (unmap free pages of expandable ones)."""
        self._release_cached_blocks()

    def split_free_blocks(self, max_bytes: int) -> int:
        """Cut every free block of the large pool's fixed segments above ``max_bytes`` into free pieces of at most
        ``max_bytes``, each followed by a :data:`K_MIN_BLOCK` block held for good (standing for the live tensor that
        separates two holes; counted in neither allocated nor free bytes' peaks, reserved unchanged), so that no
        request above ``max_bytes`` is placed there and freed neighbours merge no further. Returns the blocks held.
        A model of the holes a load leaves (:func:`vramguard.introspect.alloc_replay._load`)."""
        held = 0
        for seg in self.segments:
            if seg.small or seg.expandable:
                continue
            for b in list(seg.blocks()):
                if b.state != "free" or b.size <= max_bytes:
                    continue
                self._unlist(b)
                while b.size > max_bytes:
                    pin = Block(seg, b.addr + max_bytes, min(K_MIN_BLOCK, b.size - max_bytes), "used")
                    left = b.size - max_bytes - pin.size
                    after = b.next
                    if left:
                        after = Block(seg, pin.addr + pin.size, left)
                        after.next = b.next
                        if b.next is not None:
                            b.next.prev = after
                    elif b.next is not None:
                        b.next.prev = pin
                    pin.prev, pin.next = b, after
                    if left:
                        after.prev = pin
                    b.next, b.size = pin, max_bytes
                    self._list(b)
                    held += 1
                    if not left:
                        break
                    b = after
                else:
                    self._list(b)
        return held

    def free_bytes_in_segments(self) -> int:
        """Reserved bytes not handed out (``memory_reserved - memory_allocated``)."""
        return self.reserved_bytes - self.allocated_bytes

    def segment_sizes(self) -> list[int]:
        """The mapped size of every segment, in bytes (as ``torch.cuda.memory_snapshot()`` lists them)."""
        return [sum(b.size for b in s.blocks() if b.state != "unmapped") for s in self.segments]

    # ---- the free lists -----------------------------------------------------------------------------------------
    # a free list holds (size, addr, block), sorted: free blocks of one pool never share an address, so the
    # comparison never reaches the block
    def _list(self, b: Block) -> None:
        insort(self._free[b.seg.small], (b.size, b.addr, b))

    def _unlist(self, b: Block) -> None:
        lst = self._free[b.seg.small]
        i = bisect_left(lst, (b.size, b.addr))
        if i < len(lst) and lst[i][2] is b:
            lst.pop(i)

    @staticmethod
    def _merge(dst: Block, src: Block) -> None:
        if src is dst.prev:
            dst.addr, dst.prev = src.addr, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
            else:
                dst.seg.head = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _get_free_block(self, size: int, small: bool) -> Block | None:
        lst = self._free[small]
        i = bisect_left(lst, (size,))
        if i == len(lst):
            return None
        if lst[i][2].seg.expandable:  # get_free_block: a block counts as the size it can grow to
            while i + 1 < len(lst) and _growable_size(lst[i + 1][2]) < _growable_size(lst[i][2]):
                i += 1
        block = lst[i][2]
        split_limit = self.config.max_split_size
        if size < split_limit <= block.size:
            return None
        if size >= split_limit and block.size >= size + K_LARGE_BUFFER:
            return None
        lst.pop(i)
        return block

    # ---- new memory ---------------------------------------------------------------------------------------------
    def _alloc_block(self, size: int, small: bool) -> Block | None:
        alloc = allocation_size(size)
        allowed = self.config.allowed_bytes
        if allowed is not None and self.reserved_bytes + alloc > allowed:
            return None
        if self.config.expandable_segments:
            return self._expand(size, small)
        if self.config.freed_before:  # upwards: a newer segment is higher
            addr, self._top = self._top, self._top + alloc
        else:
            self._next_addr -= alloc  # cudaMalloc hands out addresses downwards: a newer segment is lower
            addr = self._next_addr
        addr = addr if self.segment_addresses is None else next(self.segment_addresses)
        seg = Segment(addr, small)
        seg.head = Block(seg, seg.addr, alloc)
        self.small_segments_opened += small
        self.segments.append(seg)
        self._grow(alloc)
        return seg.head

    def _grow(self, nbytes: int) -> None:
        self.reserved_bytes += nbytes
        self.peak_reserved_bytes = max(self.peak_reserved_bytes, self.reserved_bytes)

    def _expand(self, size: int, small: bool) -> Block | None:
        """``try_allocate_expandable_block``: map pages at the lowest unmapped range that, with the free block
        before it, holds ``size``; the segment's end is an unmapped range without limit."""
        page = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        seg = self._expandable.get(small)
        if seg is None:
            self._next_addr -= 1 << 50
            seg = Segment(self._next_addr, small, expandable=True)
            seg.head = Block(seg, seg.addr, 1 << 48, "unmapped")
            self._expandable[small] = seg
            self.segments.append(seg)
        for b in seg.blocks():
            if b.state != "unmapped":
                continue
            before = b.prev.size if b.prev is not None and b.prev.state == "free" else 0
            if before + b.size < size:
                continue
            need = -(-(size - before) // page) * page
            mapped = self._map(b, min(need, b.size))
            if before:
                prev = mapped.prev
                if prev is not None:  # ``before`` > 0: the free block before it
                    self._unlist(prev)
                    self._merge(mapped, prev)
            return mapped
        return None

    def _map(self, b: Block, nbytes: int) -> Block:
        """Map the first ``nbytes`` of unmapped block ``b``; returns the new free (unlisted) block."""
        if nbytes < b.size:
            rest = Block(b.seg, b.addr + nbytes, b.size - nbytes, "unmapped")
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = nbytes
        b.state = "free"
        self._grow(nbytes)
        self.small_segments_opened += b.seg.small
        nxt = b.next
        if nxt is not None and nxt.state == "free":
            self._unlist(nxt)
            self._merge(b, nxt)
        return b

    def _release_cached_blocks(self) -> bool:
        """``release_cached_blocks``: give back every entirely free segment (expandable: every whole free page)."""
        released = False
        for seg in list(self.segments):
            if seg.expandable:
                released |= self._unmap_free_pages(seg)
            elif seg.head is not None and seg.head.state == "free" and seg.head.next is None:
                self._unlist(seg.head)
                self.segments.remove(seg)
                self.reserved_bytes -= seg.head.size
                released = True
        return released

    def _unmap_free_pages(self, seg: Segment) -> bool:
        page = K_SMALL_BUFFER if seg.small else K_LARGE_BUFFER
        released = False
        for b in list(seg.blocks()):
            if b.state != "free":
                continue
            lo = -(-(b.addr - seg.addr) // page) * page + seg.addr
            hi = (b.addr + b.size - seg.addr) // page * page + seg.addr
            if hi <= lo:
                continue
            self._unlist(b)
            parts = [(b.addr, lo - b.addr, "free"), (lo, hi - lo, "unmapped"), (hi, b.addr + b.size - hi, "free")]
            prev, nxt = b.prev, b.next
            new = [Block(seg, a, n, st) for a, n, st in parts if n > 0]
            for x, y in zip(new, new[1:]):
                x.next, y.prev = y, x
            new[0].prev, new[-1].next = prev, nxt
            if prev is not None:
                prev.next = new[0]
            else:
                seg.head = new[0]
            if nxt is not None:
                nxt.prev = new[-1]
            for x in new:
                if x.state == "free":
                    self._list(x)
            self.reserved_bytes -= hi - lo
            for x in new:  # adjacent unmapped ranges become one
                if x.state == "unmapped":
                    for other in (x.prev, x.next):
                        if other is not None and other.state == "unmapped":
                            self._merge(x, other)
            released = True
        return released
