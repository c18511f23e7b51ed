"""The :class:`~vramguard.memory.model.MemoryModel` of any architecture, answered by transformers itself
(:mod:`vramguard.introspect.generic`): the module tree on the meta device and the quantizer's rules for the weights
and the load, a replay of the real forward and cache for the peaks and the KV cache. Needs torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from vramguard.finding import Finding
from vramguard.introspect import generic
from vramguard.memory.forward import ForwardPeak
from vramguard.memory.kv import KvBytes
from vramguard.memory.weights import LinearGroup, WeightBytes
from vramguard.memory.model import ForwardParts, LoadPlan, MemoryModel, logit_parts
from vramguard.settings import Settings
from vramguard.spec import ModelSpec
from vramguard.introspect.mixers import takes_kernel

META = "transformers on the meta device"


@dataclass(frozen=True)
class TransformersModel(MemoryModel):
    """Every figure of :attr:`spec` (which must carry its config.json) from transformers."""

    spec: ModelSpec
    needs_transformers: ClassVar[bool] = True

    @property
    def sources(self) -> dict[str, str]:
        return {"weights": f"{META} (the module tree and the quantizer's rules)",
                "kv_cache": f"{META} (the cache a replayed forward creates)",
                "forward": f"{META} (a replay of the forward)", "load": f"{META} (the module tree)"}

    def with_spec(self, spec: ModelSpec) -> TransformersModel:
        return TransformersModel(spec)

    def weight_bytes(self, s: Settings) -> WeightBytes:
        return generic.weight_bytes(self.spec, s)

    def linear_groups(self, s: Settings | None = None) -> list[LinearGroup]:
        return generic.linear_groups(self.spec, s)

    def kv_cache_bytes(self, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> KvBytes:
        return generic.kv_cache_bytes(self.spec, s, n_tokens, in_prefill_chunk)

    def kv_per_layer(self, s: Settings, n_tokens: int, in_prefill_chunk: int = 0) -> tuple[int, ...]:
        """The replayed cache layer by layer; a quantized cache's bytes shared out by the 16-bit layer sizes."""
        spec = self.spec
        r = generic.replayed(spec, s, max(n_tokens - 1, 0), 1) if n_tokens > 1 else generic.replayed(spec, s, 0, 1)
        per = list(r.cache_bytes)
        total = generic.kv_cache_bytes(spec, s, n_tokens, in_prefill_chunk).gpu_bytes
        if per and sum(per) != total:
            scaled = [b * total // sum(per) for b in per]
            scaled[-1] += total - sum(scaled)
            per = scaled
        return tuple(per)

    def kv_bytes_per_token(self, s: Settings) -> int:
        return generic.kv_bytes_per_token(self.spec, s)

    def kv_growth_per_token(self, s: Settings, n_tokens: int) -> dict[str, int]:
        return generic.kv_growth_per_token(self.spec, s, n_tokens)

    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(generic.layer_kinds(self.spec))

    def forward_peak(self, s: Settings, past: int, chunk: int, phase: str = "prefill") -> ForwardPeak:
        return generic.forward_peak(self.spec, s, past, chunk, phase)

    def forward_parts(self, s: Settings, past: int, chunk: int) -> ForwardParts:
        """The whole replayed peak above the KV cache as one layer's program (an upper bound on every card that
        runs a layer); no concatenation or inputs apart."""
        fp = generic.forward_peak(self.spec, s, past, chunk)
        native, fp32, softcap, hidden = logit_parts(self.spec, s, chunk)
        return ForwardParts(fp.peak_bytes - fp.components.get("kv_cache", 0), fp.largest_alloc, hidden, native,
                            fp32, softcap, 0, 0)

    def tp_rank(self, shards) -> tuple[MemoryModel, int]:
        """The whole model (its activations kept whole on every rank: an upper bound); its KV cache divided by
        ``tp`` where the heads are sharded (the cache tensors keep heads on one dim)."""
        return self, shards.tp if shards.heads_sharded else 1

    def load_plan(self, s: Settings) -> LoadPlan | None:
        return generic.load_plan(self.spec, s)

    def learned_positions(self) -> int | None:
        return generic.learned_positions(self.spec)

    def findings(self, s: Settings) -> list[Finding]:
        """``attn_replayed`` where the replay substituted an attention implementation, and ``experts_path`` for MoE
        experts that dispatch on transformers' experts implementation (:func:`_experts_finding`); the path of
        kernel-backed mixers is the plan's ``mixer_path`` finding: :func:`vramguard.plan.kernels.kernel_finding`."""
        out = []
        note = generic.replay_note(self.spec, s)
        if note:
            refused = note.startswith("transformers refuses")
            out.append(Finding("attn_replayed", "warn" if refused else "info", note,
                               "pass attn=eager (what this model loads with)" if refused else None))
        impl = generic.experts_path(self.spec, s) if self.spec.config_json else None
        if impl is not None:
            out.append(_experts_finding(impl))
        return out  # mixer_path: vramguard.plan.kernels.kernel_finding, with the path chosen for the plan

    def forward_parts_measured(self, s: Settings) -> tuple[str, ...]:
        """Its layer kinds (from the config transformers builds; ``full_attention`` where it names none) and the
        path of each kernel package."""
        if not self.spec.config_json:
            return ()
        kinds = getattr(generic._text(self.spec), "layer_types", None) or ["full_attention"]
        found = [f"layer:{k}" for k in dict.fromkeys(kinds)]
        for p in generic.kernel_paths(self.spec, s):
            found.append(f"path:{p.package}:{'kernel' if takes_kernel(p, s.kernels) else 'reference'}")
        return tuple(dict.fromkeys(found))


def _experts_finding(impl: str) -> Finding:
    """The ``info`` finding ``experts_path``: the experts implementation ``impl`` the replay took
    (:func:`vramguard.introspect.generic.experts_path`), and why the other path of that implementation on some cards
    holds the same tensors."""
    if impl == "grouped_mm":
        how = ("one grouped matrix product per projection over the routed tokens sorted by expert; on a card below "
               "compute capability 8.0 (where torch's grouped_mm does not run) transformers' _grouped_mm_fallback "
               "multiplies expert by expert into an output of the same shape, so the plan holds there too")
    elif impl == "eager":
        how = "the experts class's own loop, expert by expert"
    else:
        how = "as transformers' ExpertsInterface binds it"
    return Finding("experts_path", "info", f"MoE experts: replayed transformers' experts_implementation='{impl}' "
                   f"(as transformers resolved it for this model; integrations/moe.py): {how}")
