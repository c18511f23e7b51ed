"""Which parts of a generic plan a GPU measurement covers: the layer kinds and kernel paths of the measured
architectures in ``benchmarks/results``. A part no measurement covers is "unverified" (the replay follows
transformers' code, but nothing has checked that code's memory on a card), and a card it fits says so.

The table is the measurements' own: each entry names the results file and the architecture that measured it, and
``tests/test_hybrid.py`` checks each against its records (the plan within 1% of the measured peak allocated).
"""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.settings import Settings


@dataclass(frozen=True)
class Measured:
    """A part of the forward measured on a GPU: ``part`` (``layer:<kind>`` for a layer kind as transformers'
    ``layer_types`` names it, ``path:<package>:reference`` / ``path:<package>:kernel`` for the path transformers
    takes for a package's kernels), on ``transformers`` (None: any version), by ``model`` in ``results``."""

    part: str
    transformers: str | None
    model: str
    results: str


GENERIC_RUN1 = "benchmarks/results/h200_generic/generic_run1.jsonl"
GENERIC_RUN2 = "benchmarks/results/h200_generic/generic_run2.jsonl"
FALCON_H1 = "benchmarks/results/h200_session_1202/hybrid_falcon_h1.jsonl"  # benchmarks/gpu_hybrid.py
LFM2 = "benchmarks/results/h200_session_1202/hybrid_mamba2_lfm2.jsonl"
LLAMA4_QWEN3_NEXT = "benchmarks/results/h200_hybrid3/llama4_qwen3next.jsonl"

MEASURED: tuple[Measured, ...] = (
    Measured("layer:full_attention", None, "deepseek-v2-lite", GENERIC_RUN2),
    Measured("layer:sliding_attention", None, "starcoder2-7b", GENERIC_RUN1),
    Measured("layer:linear_attention", None, "granite-hybrid-3b", GENERIC_RUN1),  # Mamba-2 layers, serial
    Measured("path:mamba_ssm:reference", "5.17.0", "granite-hybrid-3b", GENERIC_RUN1),
    Measured("path:causal_conv1d:reference", "5.17.0", "granite-hybrid-3b", GENERIC_RUN1),
    # attention and Mamba-2 side by side in every layer; the reference scan's memory differs between versions
    Measured("layer:hybrid", "5.17.0", "falcon-h1-1.5b-deep", FALCON_H1),
    Measured("layer:conv", "5.17.0", "lfm2-1.2b", LFM2),  # short convolutions beside attention
    Measured("layer:chunked_attention", None, "llama4-scout-2l", LLAMA4_QWEN3_NEXT),  # 8,192-token chunks
    # gated DeltaNet linear attention: transformers' torch_chunk_gated_delta_rule where fla is missing
    Measured("path:fla:reference", "5.17.0", "qwen3-next-4l", LLAMA4_QWEN3_NEXT),
)


def unverified(model, s: Settings) -> tuple[str, ...]:
    """The parts of ``model``'s forward with ``s`` (:meth:`~vramguard.memory.model.MemoryModel.forward_parts_measured`:
    none for a hand-written family, measured as a whole in benchmarks/results/h200_matrix) that no entry of
    :data:`MEASURED` covers for the installed transformers."""
    wanted = model.forward_parts_measured(s)
    if not wanted:
        return ()
    import transformers
    version = transformers.__version__
    covered = {m.part for m in MEASURED if m.transformers in (None, version)}
    return tuple(p for p in wanted if p not in covered)


def describe(missing: tuple[str, ...]) -> str:
    """The plan's words for the unverified parts ``missing``."""
    import transformers
    words = []
    for part in missing:
        kind, _, rest = part.partition(":")
        if kind == "layer":
            words.append(f"{rest} layers")
        else:
            package, _, path = rest.partition(":")
            words.append(f"{package}'s {'CUDA kernels' if path == 'kernel' else 'reference PyTorch path'} on "
                         f"transformers {transformers.__version__}")
    return ("no GPU measurement in benchmarks/results covers " + ", ".join(words) +
            ": the plan replays transformers' code for them, but no card has confirmed its memory (unverified)")
