"""Rules that both ``plan``'s findings and ``check``'s findings apply, each written once: what eager attention
maps hold and what a 4-bit compute dtype other than the activations' costs (what a card can run is the catalog's:
:attr:`~vramguard.catalog.gpus.GpuSpec.supports_bf16`, :attr:`~vramguard.catalog.gpus.GpuSpec.supports_flash_attn2`).
Pure arithmetic over the spec and settings; each caller words its own finding."""

from __future__ import annotations

from vramguard.memory.weights import LinearGroup
from vramguard.memory.model import MemoryModel
from vramguard.settings import DTYPE_BYTES, Settings
from vramguard.spec import ModelSpec

def attention_map_bytes(spec: ModelSpec, s: Settings, act_dtype: str) -> int:
    """Bytes of one layer's attention maps over the prompt, as ``output_attentions=True`` keeps them:
    ``sequences x heads x prompt_tokens^2 x element bytes`` (its float32 softmax buffer is ``4 / element bytes``
    times this while it runs)."""
    return s.sequences * spec.num_heads * s.prompt_tokens * s.prompt_tokens * DTYPE_BYTES[act_dtype]


def dequantized_weight_bytes(model: MemoryModel, compute_dtype: str, act_dtype: str) -> tuple[LinearGroup, int, int]:
    """The largest quantizable linear and its dequantized weight in ``compute_dtype`` and in ``act_dtype``
    (bytes): what a 4-bit layer holds when its compute dtype is not the activations' (bitsandbytes dequantizes the
    weight to the compute dtype and casts the input to it)."""
    big = max((g for g in model.linear_groups() if g.quantizable), key=lambda g: g.numel)
    return big, big.numel * DTYPE_BYTES[compute_dtype], big.numel * DTYPE_BYTES[act_dtype]
