"""``fastdecode``: batch-1 decoding that replays one CUDA graph per generated token.

At batch 1 a quantized 8B model spends most of each decode step launching kernels from Python: transformers'
``generate`` ran at 26.8 ms/token on an H200 against a 1.19 ms/token bandwidth bound. :class:`GraphDecoder`
removes that overhead:

1. A transformers ``StaticCache`` of ``max_cache_len`` tokens (``prompt + max_new_tokens - 1`` for one request:
   the last token is never fed back, which is how ``generate`` sizes its own static cache).
2. One decode step (token ids ``[1, 1]``, position ids ``[1, 1]``, a ``[1, 1, 1, max_cache_len]`` causal mask built
   *inside* the step from the position buffer, ``logits_to_keep=1``) is run eagerly on a side stream for
   ``warmup_steps`` dummy tokens, then captured once with ``torch.cuda.graph`` (PyTorch's "CUDA Graphs" notes:
   https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs), and the cache is reset in place. This one-time
   work comes before the prefill, so the stream after the first token runs at the decode rate the result reports.
3. The prefill runs as ordinary forward calls (optionally in chunks), outside any graph; every later token replays
   the graph. Before each replay the next token and its position are copied into the static buffers in place; the
   next token is chosen on the device from the graph's float32 logits, outside the graph (greedy argmax, or
   transformers' temperature / top-k / top-p warpers and ``torch.multinomial``, as ``generate`` does).

What a replay would not update, and how it is handled:

* positions: ``position_ids`` is a static buffer; rotary embeddings are computed from it on the device. RoPE types
  that recompute their frequencies on the host (``dynamic``, ``longrope``) are refused (eager mode, with the reason).
* the attention mask: transformers builds static-cache masks from the cache's counter; here the step passes its own
  4D mask (bool for SDPA, additive ``finfo.min`` for eager attention, the values transformers' ``sdpa_mask`` /
  ``eager_mask`` produce), so mask creation returns early and does no host work.
* the cache's write position: ``StaticLayer.update`` writes at its on-device ``cumulative_length`` and increments it
  in place, which a replay repeats; it advances once per step like the position buffer, and the two are compared
  at the end of every call (a mismatch raises instead of returning wrong tokens).

Inside the captured step (``kernels=None``, the default) two of :mod:`vramguard.run.kernels`' Triton kernels replace
library calls where they apply: bitsandbytes' ``gemm_4bit`` for one to 8 rows (a ``TorchDispatchMode`` routes it,
the weights are read as bitsandbytes stores them) and transformers' attention for the decode step (registered in
transformers' ``AttentionInterface`` and switched on with ``set_attn_implementation`` for the step only: GQA without
``repeat_kv`` copies, no mask, the filled length read from the position buffer on the device). Before the first
kernel step each kernel is run once on the model's own weights and cache against the library it replaces and turned
off, with the reason, if it fails or disagrees (:mod:`vramguard.run.kernel_check`; that verdict is kept on disk and
a later process runs a spot check instead); :attr:`DecodeResult.kernels` says what ran. With both kernels on, a
Llama-style model whose projections are 4-bit runs the whole step as :mod:`vramguard.run.fused_step` instead (nine
kernels per layer, checked against the step above before use; ``fused=False`` keeps the step above).

Without CUDA, when the model cannot be captured, or when capture fails for any reason, the same static-input step
runs eagerly for every token; :attr:`DecodeResult.mode` and :attr:`DecodeResult.reason` say which ran and why.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from dataclasses import dataclass
from typing import Callable

from vramguard.errors import InvalidValue
from vramguard.run.kernel_check import KernelChoice
from vramguard.run.kernels import triton_status
from vramguard.run.sampling import Sampler, eos_list
from vramguard.run.timing import DecodeResult
from vramguard.runtime.handle import sdpa_unpinned
from vramguard.settings import require_count

# Tests: model -> (capturable, reason), replacing :func:`graph_support`'s checks.
GRAPH_OVERRIDE: Callable[[object], tuple[bool, str]] | None = None
# Tests: step -> (replay, output tensor, mode label), replacing ``torch.cuda.graph`` capture.
CAPTURE_OVERRIDE: Callable[[Callable], tuple[Callable[[], None], object, str]] | None = None

_UNCAPTURABLE_ROPE = ("dynamic", "longrope")  # their rotary update reads positions on the host at every step


def graph_support(model) -> tuple[bool, str]:
    """Whether ``model``'s decode step can be captured in a CUDA graph, and why (or why not).

    Checks the RoPE type (``dynamic`` and ``longrope`` read the positions on the host) and the device (one CUDA
    device). Capture itself may still fail; :class:`GraphDecoder` then reports that error. Tests force a branch
    through :data:`GRAPH_OVERRIDE`.
    """
    if GRAPH_OVERRIDE is not None:
        return GRAPH_OVERRIDE(model)
    import torch
    for m in model.modules():
        rope = getattr(m, "rope_type", None)
        kinds = rope.values() if isinstance(rope, dict) else [rope]
        bad = [k for k in kinds if isinstance(k, str) and any(u in k for u in _UNCAPTURABLE_ROPE)]
        if bad:
            return False, f"rope_type {bad[0]!r} recomputes its frequencies on the host at each step"
    device = next(model.parameters()).device
    if device.type != "cuda":
        return False, f"no CUDA device (the model is on {device})"
    if not torch.cuda.is_available():
        return False, "torch.cuda is not available"
    devices = sorted({str(p.device) for p in model.parameters()})
    if len(devices) > 1:
        return False, f"the model spans {', '.join(devices)}: one graph captures one device"
    return True, f"CUDA device {device}"


def kernel_support(model) -> tuple[bool, bool, str]:
    """Whether the decode steps can use vramguard's Triton kernels: (4-bit matmul, decode attention, reason).

    The 4-bit matmul (:mod:`vramguard.run.kernels.nf4`) needs bitsandbytes ``Linear4bit`` layers and bitsandbytes'
    ``gemm_4bit`` op; the decode attention (:mod:`vramguard.run.kernels.decode_attention`) a head_dim that is a power
    of two of at least 16. Both need Triton on the model's device (:func:`vramguard.run.kernels.triton_status`).
    """
    import torch

    ok, why = triton_status(next(model.parameters()).device)
    if not ok:
        return False, False, why
    nf4 = any(type(m).__name__ in ("Linear4bit", "LinearNF4", "LinearFP4") for m in model.modules())
    if nf4:
        try:
            import bitsandbytes  # noqa: F401 -- registers its ops
            torch.ops.bitsandbytes.gemm_4bit.default  # noqa: B018 -- present from bitsandbytes 0.50
        except (ImportError, AttributeError, RuntimeError):
            nf4 = False
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    attn = head_dim >= 16 and head_dim & (head_dim - 1) == 0
    parts = [("4-bit matmul" if nf4 else "no bitsandbytes 4-bit layers to route"),
             ("decode attention" if attn else f"head_dim {head_dim} is not a power of two >= 16")]
    return nf4, attn, "; ".join(parts)


def _cache_keyword(model) -> str:
    """The forward's name for the cache: ``cache`` (transformers >= 5.24) or ``past_key_values`` (5.17 to 5.23)."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise InvalidValue("model", type(model).__name__, "a transformers causal LM whose forward takes a cache",
                       "use fast_decode=False for this model")


def check_model(model) -> None:
    """Refuse, before any GPU work, a model the decoder cannot run exactly.

    Raises:
        InvalidValue: attention other than sdpa / eager (the decoder builds the static-cache masks for those two),
            a forward without a cache argument, or cache layers other than full attention (sliding-window and
            linear-attention layers update and mask differently).
    """
    from transformers import StaticCache
    from transformers.cache_utils import StaticLayer
    attn = getattr(model.config, "_attn_implementation", None)
    if attn not in ("sdpa", "eager"):
        raise InvalidValue("attn", attn, "sdpa or eager for the graph decoder (it builds the static-cache masks)",
                           "load the model with attn='sdpa', or use fast_decode=False")
    _cache_keyword(model)
    kinds = sorted({type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=1).layers
                    if type(layer) is not StaticLayer})
    if kinds:
        raise InvalidValue("model", getattr(model.config, "model_type", type(model).__name__),
                           f"full-attention layers only (this cache has {', '.join(kinds)})",
                           "use fast_decode=False for this model")


class GraphDecoder:
    """Batch-1 generation with a static cache of ``max_cache_len`` tokens and one captured decode step.

    The cache, the static buffers and the graph are kept between :meth:`generate` calls, so a second request that
    fits the same cache reuses the graph (no warm-up, no capture). See the module docstring for the method.

    Args:
        model: a transformers causal LM with full-attention layers (Llama-style), ``sdpa`` or ``eager`` attention.
        max_cache_len: cache length in tokens; a request needs ``prompt + max_new_tokens - 1`` of them.
        prefill_chunk_tokens: prefill in chunks of this many tokens (None: one forward, as ``generate`` does).
        use_graph: False runs every step eagerly (and says so).
        warmup_steps: eager decode steps on a side stream before the capture (PyTorch's CUDA-graph notes ask for a
            warm-up on a side stream; these are real tokens, nothing is recomputed).
        kernels: vramguard's Triton kernels in the decode steps (:func:`kernel_support`): None (default) uses them
            when the step is captured in a CUDA graph and they apply; True in every decode step, graph or not
            (the CPU tests, through Triton's interpreter); False never. The result's ``kernels`` says what ran.
        fused: with both kernels on, run the whole step as :mod:`vramguard.run.fused_step` (nine kernels per
            layer; Llama-style 4-bit models, checked before use) where it applies (True / None), or never (False).

    Raises:
        InvalidValue: a bad argument, an attention implementation other than sdpa/eager, or sliding-window /
            non-attention cache layers (their masks and cache updates differ from the full causal case).
    """

    def __init__(self, model, max_cache_len: int, *, prefill_chunk_tokens: int | None = None,
                 use_graph: bool = True, warmup_steps: int = 2, kernels: bool | None = None,
                 fused: bool | None = None):
        import torch
        from transformers import StaticCache
        for name, v, lo in (("max_cache_len", max_cache_len, 1), ("warmup_steps", warmup_steps, 0),
                            ("prefill_chunk_tokens", 1 if prefill_chunk_tokens is None else prefill_chunk_tokens, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidValue(name, v, f"an integer >= {lo}" + (" or None" if name.startswith("prefill") else ""))
        check_model(model)
        self.model, self.max_cache_len = model, max_cache_len
        self.prefill_chunk_tokens, self.warmup_steps = prefill_chunk_tokens, warmup_steps
        self.device = next(model.parameters()).device
        self._cache_kw = _cache_keyword(model)
        self.cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
        attn = model.config._attn_implementation
        self._bool_mask = attn == "sdpa"
        self._mask_dtype = model.get_input_embeddings().weight.dtype
        self._ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._pos = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        self._kv_idx = torch.arange(max_cache_len, device=self.device).view(1, 1, 1, max_cache_len)
        self._graph_ok, self._why = graph_support(model) if use_graph else (False, "use_graph=False was passed")
        nf4, attn, why = self._kernel_choice(kernels)
        self._k = KernelChoice(model, nf4, attn, why, fused is not False, self._mask_dtype)
        self._replay: Callable[[], None] | None = None
        self._logits = None
        self._label = "eager"
        self._warmed = 0

    def _kernel_choice(self, kernels: bool | None) -> tuple[bool, bool, str]:
        if kernels is False:
            return False, False, "kernels=False was passed"
        if kernels is None and not (self._graph_ok and self.device.type == "cuda"):
            return False, False, "no CUDA graph, so no kernels (they are used with the graph)"
        nf4, attn, why = kernel_support(self.model)
        if kernels and not (nf4 or attn):
            raise InvalidValue("kernels", True, f"kernels that apply to this model ({why})", "pass kernels=None")
        return nf4, attn, why

    # -- the forward calls ------------------------------------------------------------------------------------
    def _mask(self, positions):
        """Causal mask ``[1, 1, q, max_cache_len]`` for query ``positions`` (long, ``[1, 1, q, 1]``): key slot k is
        visible when k <= position; bool (True = attend) for SDPA, 0 / ``finfo(dtype).min`` for eager attention."""
        import torch
        allowed = self._kv_idx <= positions
        if self._bool_mask:
            return allowed
        zero = torch.zeros(allowed.shape, dtype=self._mask_dtype, device=self.device)
        return zero.masked_fill_(~allowed, torch.finfo(self._mask_dtype).min)

    def _forward(self, ids, positions, mask):
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, return_dict=True, **{self._cache_kw: self.cache})
        return out.logits[:, -1, :].float()

    def _step(self):
        """One decode step from the static buffers: float32 logits ``[1, vocab]``. Captured as the graph. With the
        decode-attention kernel no mask is built (the kernel reads the filled length from the position)."""
        k = self._k
        if k.fused is not None:
            return k.fused(self._ids, self._pos)
        if not (k.nf4 or k.attn):
            return self._forward(self._ids, self._pos, self._mask(self._pos.view(1, 1, 1, 1)))
        with k.kernels():
            mask = None if k.attn else self._mask(self._pos.view(1, 1, 1, 1))
            return self._forward(self._ids, self._pos, mask)

    def _prefill(self, ids):
        """Forward ``ids`` (``[1, P]``) into the empty cache; float32 logits ``[1, vocab]`` of the last position.
        Chunks after the first get an explicit causal mask, the first none (SDPA's causal path), as ``generate``."""
        import torch
        n = ids.shape[1]
        step = self.prefill_chunk_tokens or n
        for start in range(0, n, step):
            part = ids[:, start:start + step]
            pos = torch.arange(start, start + part.shape[1], device=self.device).unsqueeze(0)
            mask = None if start == 0 and self._bool_mask else self._mask(pos.view(1, 1, -1, 1))
            logits = self._forward(part, pos, mask)
        return logits

    # -- graph capture --------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _side_stream(self):
        """Run the body on a side stream that waits for the current one and is waited for after (the warm-up)."""
        import torch
        if self.device.type != "cuda" or CAPTURE_OVERRIDE is not None:
            yield
            return
        s = torch.cuda.Stream(device=self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            yield
        torch.cuda.current_stream(self.device).wait_stream(s)

    def _capture(self) -> float:
        """Capture :meth:`_step` (seconds taken). On failure the decoder stays eager and keeps the error as reason."""
        import torch
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        try:
            if CAPTURE_OVERRIDE is not None:
                self._replay, self._logits, self._label = CAPTURE_OVERRIDE(self._step)
            else:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    logits = self._step()
                self._replay, self._logits, self._label = graph.replay, logits, "cuda_graph"
                torch.cuda.synchronize(self.device)
            self._why = (f"one decode step captured after {self._warmed} warm-up step(s) on a side stream, before "
                         "the prefill; every decode step replays it")
        except Exception as e:  # noqa: BLE001 -- any capture failure: report it, continue eagerly with the same step
            first = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            ctx = e.__context__
            if ctx is not None:
                first += f" (after {type(ctx).__name__}: {str(ctx).strip().splitlines()[0][:300] if str(ctx) else ''})"
            self._replay, self._logits, self._graph_ok, self._label = None, None, False, "eager"
            self._why = f"graph capture failed, every step ran eagerly: {first[:600]}"
            if stream is not None:  # torch.cuda.graph leaves its capture stream current when capture_end raises
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize(self.device)  # raises if the failure left the device unusable
        return time.perf_counter() - t0

    def _sdpa_unpinned(self):
        """:func:`vramguard.runtime.handle.sdpa_unpinned` for this call: a static cache needs a mask at every decode
        step."""
        return sdpa_unpinned(self.model, "a static cache passes a mask at every step")

    # -- generation -------------------------------------------------------------------------------------------
    def _check_request(self, prompt_ids, max_new_tokens: int) -> list[int]:
        require_count("max_new_tokens", max_new_tokens, 1)
        ids = [int(x) for x in prompt_ids]
        if not ids:
            raise InvalidValue("prompt", "", "at least one token", "pass a non-empty prompt")
        room = self.max_cache_len - len(ids) + 1
        if max_new_tokens > room:
            raise InvalidValue("max_new_tokens", max_new_tokens,
                               f"at most {room} after a {len(ids)}-token prompt in this {self.max_cache_len}-token "
                               "cache (prompt + max_new_tokens - 1 slots)",
                               "use a larger max_cache_len, a shorter prompt or fewer new tokens")
        return ids

    def generate(self, prompt_ids, max_new_tokens: int, *, do_sample: bool = False,
                 temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 eos_token_id: int | list[int] | None | str = "model", min_new_tokens: int = 0,
                 on_token: Callable[[int], None] | None = None, on_logits: Callable[[int, object], None] | None = None,
                 sync_every: int = 1) -> DecodeResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids`` (a list of token ids; batch 1).

        Args:
            do_sample, temperature, top_k, top_p: as transformers' ``generate``; None leaves a warper off. Sampling
                uses the global torch RNG (``torch.manual_seed`` makes it reproducible).
            eos_token_id: stop after one of these tokens (it is kept, as ``generate`` keeps it); ``"model"``: the
                model's ``generation_config.eos_token_id``; None: never stop early.
            min_new_tokens: EOS cannot be chosen before this many new tokens (transformers' semantics).
            on_token: called with each new token id, in order.
            on_logits: called as ``(index, logits)`` with the float32 logits ``[1, vocab]`` that chose token
                ``index`` (a device tensor valid during the call only: clone it to keep it).
            sync_every: read the tokens back to the host (for ``on_token`` and the EOS check) every this many
                steps; above 1 the host queues steps ahead of the GPU, and up to ``sync_every - 1`` steps run past
                an EOS and are discarded.

        Returns:
            :class:`DecodeResult`.

        Raises:
            InvalidValue: an empty prompt, or ``prompt + max_new_tokens - 1`` above ``max_cache_len``.
            torch.OutOfMemoryError: from the prefill or a step (the caller may retry with a smaller strategy).
            RuntimeError: the cache's write position and the position buffer disagree at the end (a bug: wrong
                tokens are never returned silently).
        """
        import torch
        ids = self._check_request(prompt_ids, max_new_tokens)
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise InvalidValue("sync_every", sync_every, "an integer >= 1")
        eos = eos_list(self.model, eos_token_id)
        pick = Sampler(do_sample, temperature, top_k, top_p, eos, min_new_tokens, self.device)
        with torch.no_grad(), self._sdpa_unpinned() as note:
            result = self._run(ids, max_new_tokens, pick, set(eos), on_token, on_logits, sync_every)
        result.sdpa_note = note
        return result

    def _sync(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _prepare(self, max_new: int) -> _Times:
        """The one-time work, before the prefill, so that every step after the first token is decode: a plain step
        at position 0 (it creates the cache's tensors), the kernels' check (:class:`KernelChoice`), ``warmup_steps``
        eager steps on a side stream and the capture, all on a dummy token (the caller resets the cache). Nothing
        once done (a later request reuses the graph), for a one-token request, or, without kernels, for a request
        with no more decode steps than the warm-up (its steps run eagerly). Returns the seconds of each part."""
        t = _Times()
        capture = self._replay is None and self._graph_ok and max_new - 1 > self.warmup_steps
        if max_new < 2 or not (capture or self._k.pending):
            return t
        t0 = time.perf_counter()
        self._ids.fill_(0)
        self._pos.fill_(0)
        # on the current stream: the cache's tensors it creates live as long as the decoder and are used there
        self._forward(self._ids, self._pos, self._mask(self._pos.view(1, 1, 1, 1)))
        self._pos.fill_(1)
        self._k.check(self.cache, self.max_cache_len, 1, self._ids, self._pos, self._step)
        self._sync()
        t.selftest_s = time.perf_counter() - t0
        if capture:
            t0 = time.perf_counter()
            for i in range(self.warmup_steps):  # positions 1, 2, ...: slots the prefill writes again after the reset
                self._pos.fill_(1 + i)
                with self._side_stream():
                    self._step()
                self._warmed += 1
            self._sync()
            t.warmup_s, t.warmup_steps = time.perf_counter() - t0, self.warmup_steps
            t.capture_s = self._capture()
        return t

    def _run(self, ids: list[int], max_new: int, pick: Sampler, eos: set[int], on_token, on_logits,
             sync_every: int) -> DecodeResult:
        import torch
        t = self._prepare(max_new)
        self.cache.reset()  # in place: the graph keeps pointing at the same tensors
        t0 = time.perf_counter()
        logits = self._prefill(torch.tensor([ids], device=self.device))
        if on_logits is not None:
            on_logits(0, logits)
        tok = pick(logits, 0)
        out = [int(tok)]
        t_first = t_last = time.perf_counter()
        if on_token is not None:
            on_token(out[0])
        stop = "eos" if out[0] in eos else None
        pending: list = []
        steps = replays = 0
        while stop is None and len(out) + len(pending) < max_new:
            n = len(out) + len(pending)  # tokens so far; this step feeds the last one, at position len(ids) + n - 1
            self._ids.copy_(tok)
            self._pos.fill_(len(ids) + n - 1)
            if self._replay is not None:
                self._replay()
                logits, replays = self._logits, replays + 1
            else:
                logits = self._step()
            steps += 1
            if on_logits is not None:
                on_logits(n, logits)
            tok = pick(logits, n)
            pending.append(tok)
            if len(pending) >= sync_every or n + 1 >= max_new or self._replay is None:
                stop = self._drain(pending, out, eos, on_token)
                t_last = time.perf_counter()
        self._check_positions(len(ids) + steps)
        return self._result(out, stop or "max_new_tokens", len(ids), t0, t_first, t_last, steps - replays, replays,
                            t)

    def _drain(self, pending: list, out: list[int], eos: set[int], on_token) -> str | None:
        """Move the device tokens in ``pending`` to ``out`` (one host sync), stopping at the first EOS."""
        import torch
        values = torch.cat(pending, dim=-1).view(-1).tolist()
        pending.clear()
        for v in values:
            out.append(int(v))
            if on_token is not None:
                on_token(int(v))
            if v in eos:
                return "eos"
        return None

    def _check_positions(self, expected: int) -> None:
        seen = int(self.cache.get_seq_length())
        if seen != expected:
            raise RuntimeError(f"fast decode: the static cache holds {seen} tokens but {expected} were fed: the "
                               "cache's write position and the position buffer disagree; rerun with "
                               "use_graph=False and report this")

    def _result(self, out, stop, n_prompt, t0, t_first, t_last, eager, replays, t: _Times) -> DecodeResult:
        decode_steps = len(out) - 1
        decode_s = t_last - t_first if decode_steps > 0 else 0.0
        mode = self._label if replays else "eager"
        why = self._why
        if not replays and not self._graph_ok and not why.startswith("graph capture failed"):
            why += ": every step ran eagerly (the same static-input step, without a graph)"
        elif not replays and self._graph_ok:
            why = (f"the request ended after {eager} decode step(s), before the capture (it follows "
                   f"{self.warmup_steps} warm-up steps): every step ran eagerly")
        elif replays and t.capture_s is None:
            why = "the graph captured by an earlier call was replayed"
        per_token = decode_s * 1000 / decode_steps if decode_steps > 0 else None
        return DecodeResult(out, mode, why, stop, n_prompt, self.max_cache_len, t_first - t0, decode_s, per_token,
                            eager, replays, per_token if replays == decode_steps and replays else None, t.capture_s,
                            kernels=self._k.note() if eager or replays else None, decode_steps=decode_steps,
                            warmup_s=t.warmup_s, warmup_steps=t.warmup_steps, selftest_s=t.selftest_s,
                            kernel_check=self._k.how)

    def close(self) -> None:
        """Drop the graph and the cache (their memory returns to PyTorch's allocator)."""
        self._replay = self._logits = None
        self.cache = None


@dataclass
class _Times:
    """One call's one-time work before its prefill, in seconds (see :class:`DecodeResult`)."""

    selftest_s: float = 0.0
    warmup_s: float = 0.0
    warmup_steps: int = 0
    capture_s: float | None = None

    def one_time_s(self) -> float:
        return self.selftest_s + self.warmup_s + (self.capture_s or 0.0)


def graph_decode(model, prompt_ids, max_new_tokens: int, *, prefill_chunk_tokens: int | None = None,
                 use_graph: bool = True, warmup_steps: int = 2, kernels: bool | None = None,
                 fused: bool | None = None, **kwargs) -> DecodeResult:
    """One request through a :class:`GraphDecoder` whose cache is sized ``len(prompt_ids) + max_new_tokens - 1``
    (what transformers' ``generate`` allocates), freed afterwards. ``kwargs`` go to :meth:`GraphDecoder.generate`.

    Raises:
        InvalidValue: see :class:`GraphDecoder` and :meth:`GraphDecoder.generate`.
    """
    n = len(prompt_ids)
    require_count("max_new_tokens", max_new_tokens, 1)
    dec = GraphDecoder(model, max(n + max_new_tokens - 1, 1), prefill_chunk_tokens=prefill_chunk_tokens,
                       use_graph=use_graph, warmup_steps=warmup_steps, kernels=kernels, fused=fused)
    try:
        return dec.generate(prompt_ids, max_new_tokens, **kwargs)
    finally:
        dec.close()
