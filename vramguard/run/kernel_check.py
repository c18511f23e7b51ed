"""``kernel_check``: which of vramguard's Triton kernels a graph decoder's steps use, and why; checked once per
decoder on the model's own weights, the verdict kept on disk (:mod:`vramguard.run.kernels.verdict`).

The first time for a model on a device (or after any library or vramguard change) the whole check runs: each kernel
against the library it replaces (:mod:`vramguard.run.kernels.selftest`), then the fused step against the unfused
one (:func:`vramguard.run.fused_step.build`); a kernel that fails to compile or disagrees is turned off with the
reason. Its decision is written to disk. A later decoder (in this process or another) that finds that decision
runs one spot check instead: one 4-bit layer through the routed kernel against bitsandbytes, and the decode
attention on one layer's slots against a float32 softmax; if that disagrees the whole check runs again.
"""

from __future__ import annotations

import contextlib

from vramguard.run.kernels import selftest
from vramguard.run.kernels.verdict import KernelVerdict, read_verdict, verdict_key, write_verdict
from vramguard.runtime.device import is_oom

SPOT_SLOTS = 64  # cache slots the attention checks fill with random keys and values (the cache is reset after)


class KernelChoice:
    """The kernels of one decoder: ``nf4`` (bitsandbytes' ``gemm_4bit`` routed to the 4-bit GEMV), ``attn`` (the
    decode attention), ``fused`` (the :class:`~vramguard.run.fused_step.FusedDecodeStep`, or None), each with why
    (``why``, ``fused_why``); ``how`` says how they were checked (``"full"``, ``"kept"``: the verdict on disk and a
    spot check) and ``check_note`` what happened to a kept verdict that was not used.

    Args:
        model: the transformers model. nf4, attn, why: what :func:`vramguard.run.fastdecode.kernel_support` allows
            (and the decoder's options). fused_ok: whether the fused step may be built. dtype: the activations'.
    """

    def __init__(self, model, nf4: bool, attn: bool, why: str, fused_ok: bool, dtype):
        self.model, self.nf4, self.attn, self.why, self.dtype = model, nf4, attn, why, dtype
        self.fused = None
        self.fused_ok = fused_ok
        self.fused_why = "" if fused_ok else "fused step not used: fused=False was passed"
        self.route = None  # the 4-bit dispatch mode of the last kernel step (its counts go to the report)
        self.checked = False
        self.how: str | None = None
        self.check_note = ""

    @property
    def pending(self) -> bool:
        """Whether kernels are asked for and not yet checked."""
        return not self.checked and (self.nf4 or self.attn)

    @contextlib.contextmanager
    def kernels(self):
        """The decode step's kernels: bitsandbytes' ``gemm_4bit`` routed to :mod:`vramguard.run.kernels.nf4`, and
        the model switched to :mod:`vramguard.run.kernels.decode_attention` (``set_attn_implementation``, undone
        after). Only the Python of a step runs in here; a graph replay needs neither."""
        with contextlib.ExitStack() as stack:
            if self.attn:
                from vramguard.run.kernels.decode_attention import register
                before = self.model.config._attn_implementation
                self.model.set_attn_implementation(register())
                stack.callback(self.model.set_attn_implementation, before)
            if self.nf4:
                from vramguard.run.kernels.route import gemm_4bit_route
                self.route = stack.enter_context(gemm_4bit_route())
            yield

    # -- the check ------------------------------------------------------------------------------------------------
    def check(self, cache, max_cache_len: int, filled: int, ids, position, unfused_step) -> None:
        """Check the kernels before the first kernel step: the kept verdict and a spot check, else the whole check
        (its verdict then kept). ``cache`` is the decoder's static cache with ``filled`` slots written (the slots
        after them may be overwritten: the caller resets the cache afterwards); ``ids`` and ``position`` its
        static buffers; ``unfused_step()`` its ordinary step (see :func:`vramguard.run.fused_step.build`).

        Raises:
            torch.OutOfMemoryError: from any check (the caller's OOM handling decides).
        """
        if not self.pending:
            return
        from vramguard.run.kernels import nf4 as nf4_module
        self.checked = True
        device = next(self.model.parameters()).device
        key = verdict_key(self.model, device, self.dtype, (self.nf4, self.attn, self.fused_ok, nf4_module.LUT,
                                                                  nf4_module.LUT_TABLE))
        kept, unreadable = read_verdict(key)
        if unreadable:
            self.check_note = f"{unreadable}: checked again"
        if kept is not None:
            failed = self._spot_check(kept, cache, max_cache_len)
            if failed is None:
                self._apply(kept, cache, max_cache_len)
                return
            self.check_note = f"the kept kernel check did not hold ({failed[:300]}): checked again"
        self._full(cache, max_cache_len, filled, ids, position, unfused_step)
        write_verdict(key, KernelVerdict(self.nf4, self.attn, nf4_module.LUT, self.fused is not None, self.why,
                                         self.fused_why))

    def _attention_check(self, cache, max_cache_len: int) -> None:
        """:func:`~vramguard.run.kernels.selftest.check_decode_attention` on layer 0's first slots, filled with random
        keys and values from a generator of its own (the global RNG that seeded sampling uses is not moved)."""
        import torch

        keys, values = cache.layers[0].keys, cache.layers[0].values
        n = min(SPOT_SLOTS, max_cache_len)
        g = torch.Generator(device=keys.device).manual_seed(1)
        for t in (keys, values):
            t[:, :, :n].copy_(torch.randn(t[:, :, :n].shape, generator=g, device=keys.device).to(t.dtype))
        selftest.check_decode_attention(keys, values, self.model.config.num_attention_heads, n)

    def _spot_check(self, kept: KernelVerdict, cache, max_cache_len: int) -> str | None:
        """One 4-bit layer and one attention check for the kernels ``kept`` turns on; None when they agree, else
        what failed."""
        from vramguard.run.kernels import nf4 as nf4_module
        if (kept.nf4 and not self.nf4) or (kept.attn and not self.attn):
            return "it turns on a kernel this decoder may not use"
        was, self.nf4, self.attn = (self.nf4, self.attn), kept.nf4, kept.attn
        lut_was, nf4_module.LUT = nf4_module.LUT, kept.lut
        try:
            if kept.nf4:
                selftest.check_4bit_layers(self.model, self.kernels, self.dtype, limit=1)
            if kept.attn:
                self._attention_check(cache, max_cache_len)
            return None
        except Exception as e:  # noqa: BLE001 -- any failure: the whole check runs again
            if is_oom(e):
                raise
            (self.nf4, self.attn), nf4_module.LUT = was, lut_was
            return f"{type(e).__name__}: {str(e).strip()}"

    def _apply(self, kept: KernelVerdict, cache, max_cache_len: int) -> None:
        from vramguard.run.fused_step import FusedDecodeStep
        self.how, self.why, self.fused_why = "kept", kept.kernel_why, kept.fused_why
        if kept.fused:
            self.fused = FusedDecodeStep(self.model, cache, max_cache_len)

    def _full(self, cache, max_cache_len: int, filled: int, ids, position, unfused_step) -> None:
        """Each kernel once on this model's real weights against bitsandbytes' op / a float32 softmax (relative error
        under 2e-2: bfloat16 rounding is 4e-3), then the fused step. A kernel that fails to compile or disagrees is
        turned off, with the reason, before it touches the cache."""
        self.how = "full"
        try:
            if self.nf4:
                note = selftest.check_4bit_layers_or_gather(self.model, self.kernels, self.dtype)
                if note:
                    self.why = f"4-bit matmul: {note}"
        except Exception as e:  # noqa: BLE001 -- compile or launch failure: bitsandbytes' own kernels run instead
            if is_oom(e):
                raise
            self.nf4 = False
            self.why = f"4-bit matmul kernel off: {type(e).__name__}: {str(e).strip()[:300]}"
        try:
            if self.attn:
                self._attention_check(cache, max_cache_len)
        except Exception as e:  # noqa: BLE001 -- as above: transformers' attention runs instead
            if is_oom(e):
                raise
            self.attn = False
            self.why = f"decode attention kernel off: {type(e).__name__}: {str(e).strip()[:300]}"
        if self.nf4 and self.attn and self.fused_ok:
            from vramguard.run.fused_step import build
            position.fill_(filled)  # the check steps write slot `filled`; the cache is reset before the prefill
            self.fused, self.fused_why = build(self.model, cache, max_cache_len, filled, ids, position, unfused_step)

    # -- the report -----------------------------------------------------------------------------------------------
    def note(self) -> str | None:
        """What ran in the decode steps, for the decoder's report (None: no kernels were asked for)."""
        if not (self.nf4 or self.attn):
            return None if self.why.startswith("no CUDA graph") else f"none: {self.why}" + self._how()
        done = []
        if self.nf4:
            c = self.route.counts if self.route is not None else {}
            done.append(f"4-bit matmul (Triton) for {c.get('routed', 0)} bitsandbytes gemm_4bit call(s) per step"
                        + (f", {c['declined']} left to bitsandbytes ({c['declined_why']})" if c.get("declined")
                           else ""))
        if self.fused is not None:
            done = [("fused step: 4-bit matmul (Triton) for q/k/v in one launch, gate/up with SiLU times up in one, o "
                     "and down; RMSNorm with the residual add; rotary with the cache write; decode attention "
                     f"(split-K); {self.fused_why}")]
        elif self.attn:
            done.append("decode attention (Triton, split-K, GQA without copies, the filled length only)")
            if self.fused_why:
                done.append(self.fused_why)
        if " off" in self.why:
            done.append(self.why)
        return "; ".join(done) + self._how()

    def _how(self) -> str:
        how = {"kept": "; checked: the kept verdict and a spot check",
               "full": "; checked: every kernel on this model's weights"}.get(self.how or "", "")
        return how + (f" ({self.check_note})" if self.check_note else "")
