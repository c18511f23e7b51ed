"""The token choice of the continuous-batching engine's steps, one row per request that gets a token: the argmax for
a greedy row, a draw for the others, from the request's own seeded stream where it has a seed; it knows rows, not
requests.

transformers' continuous batching chooses every row of a step the same way (``ModelRunner._sample``: one
``torch.multinomial`` over the batch when any request samples), so a temperature-0 request served beside sampling
ones was drawn from its top-1 filtered distribution. Where two logits tie at the top, which happens in 16-bit
weights (bfloat16 keeps 8 significant bits: two logits near 20 are equal when they are within 0.125), that draw
picks one of them at random, and identical greedy requests parted one after another. Here a greedy row takes
``argmax`` of the float32 logits, which returns the first of equal maxima, as transformers' ``generate`` does with
``do_sample=False``.

A draw uses the exponential race: ``argmax(p / q)`` with ``q`` independent ``Exp(1)`` per token picks token ``i``
with probability ``p_i`` (the Gumbel-max trick written with exponentials, as vLLM's sampler does). For a row without
a seed ``q`` comes from the engine's generator (seeded by the server's ``seed=``); for a seeded row ``q = -log(u)``
with ``u`` a hash of (seed, the position of the token in the sequence, the token id) (SplitMix64's finaliser, S.
Vigna, https://prng.di.unimi.it/splitmix64.c), so the draw depends on nothing another request does, continues
where it left off after a soft reset (the position counts prompt and generated tokens alike) and needs no host work
inside a CUDA graph. The per-row modes, seeds and positions live in one static device tensor filled before each
step (:meth:`RowSampler.fill`), so a captured step reads them at every replay.
"""

from __future__ import annotations

import contextlib

DRAW, GREEDY, SEEDED = 0, 1, 2  # a row's mode: the engine's generator, argmax, the request's own seed

# SplitMix64 constants as signed 64-bit integers (torch has no uint64 arithmetic); products wrap modulo 2**64
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64
_POSITION = 0xD1B54A32D192ED03 - 2**64  # an odd constant that spreads positions over the 64 bits


def _shift_right(x, bits: int):
    """The logical right shift of int64 ``x`` (torch's ``>>`` keeps the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x):
    """SplitMix64's finaliser of the int64 tensor ``x`` (a bijection of 64-bit words; every output bit depends on
    every input bit)."""
    x = x ^ _shift_right(x, 30)
    x = x * _MUL1
    x = x ^ _shift_right(x, 27)
    x = x * _MUL2
    return x ^ _shift_right(x, 31)


def seeded_uniform(seed, position, vocab_size: int):
    """Uniform numbers in (0, 1), shape ``[rows, vocab_size]`` float32: row ``r``'s depend only on ``seed[r]`` and
    ``position[r]`` (int64 tensors of shape ``[rows]``). 24 random bits each, the float32 significand."""
    import torch
    key = mix64(seed * _GOLDEN + position * _POSITION)
    ids = torch.arange(vocab_size, dtype=torch.int64, device=seed.device)
    bits = _shift_right(mix64(key.unsqueeze(-1) + ids * _GOLDEN), 40)  # the top 24 bits
    return (bits.to(torch.float32) + 0.5) * (1.0 / (1 << 24))


class RowSampler:
    """Replaces ``ModelRunner._sample(scores, output_ids)`` of transformers' continuous batching (5.17 and 5.24 have
    the same signature: ``scores`` ``[1, rows, vocab]`` float32 after the logits processors, ``output_ids[0, :rows]``
    receives the tokens).

    Args:
        rows: the most rows a step can have (its largest padded size, for the decode graphs).
        device: where the model's logits are.
    """

    def __init__(self, rows: int, device):
        import torch
        self.rows = rows
        self.args = torch.zeros((3, rows), dtype=torch.int64, device=device)  # mode, seed, position per row
        self._host = torch.zeros((3, rows), dtype=torch.int64)

    def fill(self, rows: list[tuple[int, int, int]], stream=None) -> None:
        """Set the step's rows, in the order of its logits: ``(mode, seed, position)`` each, ``position`` being the
        index in the sequence of the token the row chooses. Rows beyond ``len(rows)`` keep old values (padding rows,
        whose tokens are never read). ``stream``: the CUDA stream the step computes on (the copy is ordered there)."""
        import torch
        n = min(len(rows), self.rows)
        if n == 0:
            return
        self._host[:, :n] = torch.tensor(rows[:n], dtype=torch.int64).T
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            self.args[:, :n].copy_(self._host[:, :n])

    def __call__(self, scores, output_ids) -> None:
        """Choose each row's token (see the module docstring) and write them to ``output_ids[0, :rows]``."""
        import torch
        s = scores[0]
        n, vocab = s.shape
        mode, seed, position = self.args[0, :n], self.args[1, :n], self.args[2, :n]
        probs = torch.softmax(s, dim=-1)
        _refuse_nan(probs)
        drawn_q = torch.empty_like(probs).exponential_()  # the engine's generator
        seeded_q = -torch.log(seeded_uniform(seed, position, vocab))
        q = torch.where((mode == SEEDED).unsqueeze(-1), seeded_q, drawn_q).clamp_min_(1e-20)
        drawn = torch.argmax(probs / q, dim=-1)
        tokens = torch.where(mode == GREEDY, torch.argmax(s, dim=-1), drawn)
        output_ids[0, :n].copy_(tokens)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request with ``n`` choices and ``seed``: the seed itself for the first, a
    SplitMix64 mix of both for the others (so the choices differ and each is reproducible); a signed 64-bit int."""
    if index == 0:
        return seed
    x = (seed + index * (_GOLDEN + 2**64)) % 2**64
    x = ((x ^ (x >> 30)) * (_MUL1 + 2**64)) % 2**64
    x = ((x ^ (x >> 27)) * (_MUL2 + 2**64)) % 2**64
    x ^= x >> 31
    return x - 2**64 if x >= 2**63 else x


def _refuse_nan(probs) -> None:
    """Raise as ``torch.multinomial`` does when a row's probabilities are not finite (NaN logits, a temperature
    that overflows them), so that the engine fails that request alone (:mod:`vramguard.serve.engine`) instead of
    returning the argmax of NaN. Not while a CUDA graph is captured (no host read there): a replayed decode step
    is not checked, as ``torch.multinomial`` on CUDA is not either (its check is a device-side assert)."""
    import torch
    if probs.is_cuda and torch.cuda.is_current_stream_capturing():
        return
    if not bool(torch.isfinite(probs).all()):
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0 (the step's logits "
                           "gave probabilities that are not finite)")


def sampling_rows(requests_in_batch, mode_of) -> list[tuple[int, int, int]]:
    """The rows of one prepared step: for each request of ``requests_in_batch`` (transformers'
    ``FutureRequestState``, in the step's order) that gets a token, ``mode_of(request_id)`` -> ``(mode, seed)``
    and the position of its next token (``state.position_offset`` once the step is prepared: the tokens already in
    its cache and in this step)."""
    rows = []
    for fs in requests_in_batch:
        if getattr(fs, "has_new_token", True):
            mode, seed = mode_of(fs.state.request_id)
            rows.append((mode, seed, int(fs.state.position_offset)))
    return rows
