"""Per-rank weights of ``from_pretrained(tp_plan="auto")``: the model's tensor-parallel plan read from transformers,
and the shard each rank keeps, by the placement rules of transformers' tensor-parallel styles.

The plan is the meta model's own (``PreTrainedModel.tp_plan``: the config class's ``base_model_tp_plan`` with the
model prefix, the class's ``_tp_plan`` such as ``lm_head: colwise_gather_output``, and ``embed_tokens:
embedding_rowwise`` added by transformers), expanded to one style per parameter by transformers' own rule
(``_expand_parallel_plan``: a parameter takes its own entry, else its module's). Each style shards a parameter as
``transformers/distributed/tensor_parallel.py`` does (transformers 5.24, ``shard_param``), a DTensor ``Shard(dim)``:

* ``colwise``, ``colwise_rep``, ``colwise_gather_output``: weight and bias on dim ``ndim - 2`` (the output
  features of a 2-D weight, dim 1 of 3-D fused experts; a 1-D bias on dim 0);
* ``rowwise``, ``rowwise_rep``, ``rowwise_split_input``: weight on dim -1 (input features), bias replicated;
* ``embedding_rowwise``: dim 0 (the vocabulary); ``embedding_colwise``: dim 1;
* ``packed_colwise``: dim ``ndim - 2`` strided in 2 blocks (fused gate/up); ``packed_rowwise``: dim -1 strided,
  a 1-D parameter replicated;
* every other style (``replicate``, norms' ``replicated_with_grad_allreduce``, ``moe_tp_experts``, hooks on
  modules) and every parameter without a rule: replicated, the whole tensor on every rank.

A ``Shard`` of ``n`` over ``tp`` ranks follows ``torch.chunk``: ranks take ``ceil(n / tp)`` in order and the last
ones what is left (``torch.distributed.tensor.placement_types.Shard._split_tensor``); a strided shard takes that
rule in each of its blocks. The tests compare every shard with the DTensor transformers builds on meta tensors
under a process group of ``tp`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from vramguard.errors import InvalidValue, NotPlannable
from vramguard.introspect.build import _apply_dtype_plan, _torch_dtype, cached_config, meta_model
from vramguard.memory.weights import rounded
from vramguard.settings import Settings

COLWISE = ("colwise", "colwise_rep", "colwise_gather_output")
ROWWISE = ("rowwise", "rowwise_rep", "rowwise_split_input")
PACKED_SPLIT = 2  # PackedColwiseParallel / PackedRowwiseParallel default split_factor (gate and up)


def chunk_size(n: int, tp: int, rank: int) -> int:
    """Elements of a dim of ``n`` that ``rank`` of ``tp`` keeps under ``Shard`` (``torch.chunk``'s split):
    ``ceil(n / tp)`` each in rank order, the last ranks what is left (possibly 0).
    Example: n=301, tp=2 -> 151 and 150; n=10, tp=4 -> 3, 3, 3, 1."""
    full = -(-n // tp)
    return max(0, min(full, n - rank * full))


def shard_shape(shape: tuple[int, ...], style: str | None, param: str, tp: int, rank: int) -> tuple[int, ...]:
    """The local shape ``rank`` keeps of a parameter of ``shape`` under ``style`` (see the module docstring);
    ``param`` is the parameter's own name (``weight``, ``bias``...)."""
    nd = len(shape)
    if nd == 0 or style is None:
        return tuple(shape)
    dim: int | None = None
    strided = False
    if style in COLWISE:
        dim = nd - 2 if nd >= 2 else 0
    elif style in ROWWISE:
        dim = None if param == "bias" else nd - 1
    elif style == "embedding_rowwise":
        dim = 0
    elif style == "embedding_colwise":
        dim = 1 if nd > 1 else None
    elif style == "packed_colwise":
        dim, strided = (nd - 2, True) if nd >= 2 else (0, False)
    elif style == "packed_rowwise":
        dim, strided = (None, False) if nd == 1 else (nd - 1, True)
    if dim is None:
        return tuple(shape)
    n = shape[dim]
    if strided and n % PACKED_SPLIT == 0:
        local = PACKED_SPLIT * chunk_size(n // PACKED_SPLIT, tp, rank)
    else:
        local = chunk_size(n, tp, rank)
    return tuple(local if i == dim else d for i, d in enumerate(shape))


@dataclass(frozen=True)
class TpShards:
    """What each of ``tp`` ranks holds.

    Attributes:
        plan: the expanded plan, parameter or module name -> style (transformers' own).
        shapes: per rank, parameter name -> local shape.
        weight_bytes: per rank, bytes of its parameters and buffers, each rounded to 512 B.
        replicated: names of the parameters every rank holds whole (embeddings, norms, lm_head as the plan says).
        kv_heads_per_rank: KV heads of each attention layer on one rank (``num_key_value_heads / tp``).
        heads_sharded, mlp_sharded: whether the plan shards the attention heads / the MLP intermediate.
    """

    tp: int
    plan: dict[str, str]
    shapes: tuple[dict[str, tuple[int, ...]], ...]
    weight_bytes: tuple[int, ...]
    replicated: tuple[str, ...]
    kv_heads_per_rank: int
    heads_sharded: bool
    mlp_sharded: bool


def _style_of(name: str, plan: dict[str, str]) -> str | None:
    """transformers' ``_get_parameter_plan`` on an expanded plan: the parameter's own entry, else its module's."""
    if name in plan:
        return plan[name]
    return plan.get(name.rsplit(".", 1)[0]) if "." in name else None


def expanded_plan(model) -> dict[str, str]:
    """The meta model's tensor-parallel plan with the layer numbers filled in, one entry per module or parameter
    (transformers' ``_expand_parallel_plan`` of ``model.tp_plan``).

    Raises:
        NotPlannable: the model has no tensor-parallel plan.
    """
    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    if not plan:
        raise NotPlannable("tp", type(model).__name__, "a model whose config class has a base_model_tp_plan",
                           "transformers has no tensor-parallel plan for this architecture; plan a device_map split "
                           "over the cards instead")
    if hasattr(model, "_expand_parallel_plan"):
        return dict(model._expand_parallel_plan(plan))
    from transformers.distributed.parallel_utils import _get_parameter_plan  # older layout: same rule
    out: dict[str, str] = {}
    for mname, module in model.named_modules():
        for pname, _ in module.named_parameters(recurse=False):
            full = f"{mname}.{pname}" if mname else pname
            style = _get_parameter_plan(parameter_name=full, plan=plan, is_weight=True)
            if style is not None:
                out[full] = style
    return out


def _kv_heads_error(kv: int, tp: int) -> InvalidValue:
    ok = [str(d) for d in range(2, kv + 1) if kv % d == 0]
    fix = (f"pick tp={', '.join(ok[:-1]) + ' or ' if len(ok) > 1 else ''}{ok[-1]}: every rank keeps whole KV heads"
           if ok else "no tensor parallelism splits one KV head: split the layers over the cards (gpus=N) instead")
    return InvalidValue("tp", tp, f"a divisor of num_key_value_heads={kv}", fix)


def check_tp_heads(model, tp: int | None) -> None:
    """Raise InvalidValue when ``tp`` ranks cannot split the KV heads of ``model`` (a
    :class:`~vramguard.memory.model.MemoryModel`), before anything else is read: the check :func:`tp_shards` makes
    on the model's own plan, here for the hand families, whose plans all shard ``k_proj`` (or ``qkv_proj``) by
    heads. A model taken from transformers is checked by :func:`tp_shards`."""
    if tp is None or isinstance(tp, bool) or not isinstance(tp, int) or tp < 2 or model.needs_transformers:
        return
    if model.spec.num_kv_heads % tp:
        raise _kv_heads_error(int(model.spec.num_kv_heads), tp)


def tp_shards(spec, s: Settings, tp: int) -> TpShards:
    """The shard of every parameter on each of ``tp`` ranks and the bytes per rank (see the module docstring).

    Raises:
        InvalidValue: ``tp`` below 2, ``num_key_value_heads`` not divisible by it, or bitsandbytes weights
            (transformers' tensor parallelism is planned for 16/32-bit weights here: :func:`check_tp_quant`).
        NotPlannable: no plan for the architecture.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 2:
        raise InvalidValue("tp", tp, "a number of ranks >= 2", "pass tp=2 or more (one card is a single-GPU plan)")
    check_tp_quant(s, tp)
    return _tp_shards(spec, s.act_dtype, tp)


def check_tp_quant(s: Settings, tp: int | None) -> None:
    """Raise InvalidValue when ``tp`` ranks are asked for with bitsandbytes weights: a combination of two settings
    (transformers' tensor parallelism is planned here for 16/32-bit weights only), said before any card is read.

    Example: ``quant='nf4'`` with ``tp=2`` -> field ``quant + tp``, fix ``quant='bf16'`` or a layer split."""
    if tp is None or isinstance(tp, bool) or not isinstance(tp, int) or tp < 2 or not s.is_bnb:
        return
    raise InvalidValue("quant + tp", f"{s.quant} with tp={tp}",
                       "bf16, fp16 or fp32 weights with tensor parallelism (transformers' tp_plan='auto')",
                       f"pass quant='bf16' with tp={tp}, or split the {s.quant} model's layers over the cards instead "
                       f"(gpus={tp} in place of tp={tp})")


@lru_cache(maxsize=16)
def _tp_shards(spec, act_dtype: str, tp: int) -> TpShards:
    import torch

    model = meta_model(cached_config(spec.config_json, spec.name), act_dtype)
    plan = expanded_plan(model)
    fp32 = _apply_dtype_plan(model, _torch_dtype(act_dtype))
    kv = int(spec.num_kv_heads)
    heads_sharded = any(n.rsplit(".", 1)[-1] in ("k_proj", "qkv_proj", "query_key_value") and st in COLWISE
                        for n, st in plan.items())
    if heads_sharded and kv % tp:
        raise _kv_heads_error(kv, tp)
    shapes: list[dict[str, tuple[int, ...]]] = [{} for _ in range(tp)]
    sizes = [0] * tp
    replicated: list[str] = []
    for name, p in model.named_parameters():
        style = _style_of(name, plan)
        elem = torch.empty((), dtype=getattr(torch, fp32.get(name, str(p.dtype).removeprefix("torch.")))
                           ).element_size()
        whole = True
        for r in range(tp):
            shp = shard_shape(tuple(p.shape), style, name.rsplit(".", 1)[-1], tp, r)
            whole = whole and shp == tuple(p.shape)
            shapes[r][name] = shp
            numel = 1
            for d in shp:
                numel *= d
            sizes[r] += rounded(numel * elem)
        if whole:
            replicated.append(name)
    buffers = sum(rounded(b.numel() * b.element_size()) for _, b in model.named_buffers())
    mlp_sharded = any(".mlp." in n and st in COLWISE + ("packed_colwise",) for n, st in plan.items())
    return TpShards(tp, plan, tuple(shapes), tuple(x + buffers for x in sizes), tuple(replicated),
                    kv // tp if heads_sharded else kv, heads_sharded, mlp_sharded)
