"""Planning one process over several GPUs, against the libraries that decide it: the device map and per-card bytes
of ``device_map="auto"`` against accelerate's own ``infer_auto_device_map`` and both libraries'
``compute_module_sizes`` on meta models; the tensor-parallel shards against the DTensors transformers' own
tensor-parallel code builds on meta tensors under a process group of 2 (and 4) ranks; the verdict per card."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

from archs import ARCHS

from vramguard.errors import InvalidValue
from vramguard.hardware import gpu_from_vram
from vramguard.settings import Settings
from vramguard.spec import spec_from_config
from vramguard.plan.choice import choose

SMALL = dict(hidden_size=64, intermediate_size=100, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=301, max_position_embeddings=512)
HAND = {
    "llama": dict(model_type="llama", **SMALL),
    "qwen3": dict(model_type="qwen3", head_dim=16, **SMALL),
    "qwen2": dict(model_type="qwen2", **SMALL),
    "gemma2": dict(model_type="gemma2", head_dim=16, sliding_window=32, **SMALL),  # tied embeddings
    "mixtral": dict(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, **SMALL),
    "phi3": dict(model_type="phi3", pad_token_id=0, **SMALL),
}
MORE_HAND = {  # the other hand-written families, for the torch-free split
    "mistral": dict(model_type="mistral", sliding_window=None, **SMALL),
    "gemma": dict(model_type="gemma", head_dim=16, **SMALL),
    "gemma3_text": dict(model_type="gemma3_text", head_dim=16, sliding_window=32,
                        **{**SMALL, "num_hidden_layers": 6}),  # 5 sliding layers, then a full one
    "qwen2_moe": dict(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, **SMALL),
    "qwen3_moe": dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      head_dim=16, **SMALL),
}
GENERIC = ("gpt2", "olmoe", "falcon", "deepseek_v2")


def _spec(name: str):
    if name in HAND or name in MORE_HAND:
        return spec_from_config({**HAND, **MORE_HAND}[name], name=name)
    return spec_from_config({"model_type": name, **ARCHS[name]}, name=name)


def _meta(spec, dtype="bf16"):
    from vramguard.introspect.build import cached_config, meta_model
    return meta_model(cached_config(spec.config_json, spec.name), dtype)


def _split_memory(spec) -> tuple[int, int]:
    """Two unequal cards that each hold well over half the model: transformers balances the split between them."""
    from transformers.integrations.accelerate import compute_module_sizes
    total = compute_module_sizes(_meta(spec))[0][""]
    return int(total * 0.9), int(total * 0.8)


# --------------------------------------------------------------------------------- device_map across cards
@pytest.mark.parametrize("name", [*HAND, *GENERIC, "llama-3.1-8b", "qwen2.5-14b"])
def test_split_and_per_card_bytes_agree_with_accelerate(name):
    """The split is accelerate's ``infer_auto_device_map`` over the ``max_memory`` that transformers balances:
    ``from_pretrained`` balances with its own ``get_balanced_memory``, whose buffer is 1.25 x the largest leaf or
    no-split layer (for Llama-3.1-8B the 1,050,673,152 B embeddings), where accelerate's takes the first no-split
    layer or the mean leaf (436,224,000 B); the bytes per card are both libraries' ``compute_module_sizes`` of the
    modules placed there."""
    from accelerate.utils import compute_module_sizes as acc_sizes
    from accelerate.utils import infer_auto_device_map
    from transformers.integrations.accelerate import compute_module_sizes as hf_sizes
    from transformers.integrations.accelerate import get_balanced_memory

    from vramguard.plan.multigpu.devicemap import split_weights
    from vramguard.resolve import resolve_model
    spec = _spec(name) if name in HAND or name in GENERIC else resolve_model(name)  # catalog: real sizes, on meta
    mm = _split_memory(spec)
    split = split_weights(choose(spec).model, Settings(quant="bf16"), mm)
    model = _meta(spec)
    no_split = model._no_split_modules
    limits = {0: mm[0], 1: mm[1], "cpu": 2**60}
    balanced = get_balanced_memory(model, max_memory=dict(limits), no_split_module_classes=no_split)
    expected = infer_auto_device_map(model, max_memory=balanced, no_split_module_classes=no_split)
    assert split.device_map == dict(expected)
    assert split.max_memory == mm
    if name not in HAND and name not in GENERIC:  # real sizes: both cards hold decoder layers, nothing offloaded
        assert all(split.layers) and split.input_card == 0 and split.output_card == 1 and not split.offloaded
    for sizes in (hf_sizes(model)[0], acc_sizes(model)):
        per_card = [sum(sizes[k] for k, d in expected.items() if d == c) for c in (0, 1)]
        assert list(split.raw_bytes) == per_card, sizes.__class__
    # every tensor on exactly one card, each rounded up to 512 B as the allocator holds it
    assert sum(split.raw_bytes) + sum(split.offloaded.values()) == hf_sizes(model)[0][""]
    assert all(w >= r and w - r < 512 * 4000 for w, r in zip(split.weight_bytes, split.raw_bytes))


@pytest.mark.parametrize("name", ["llama", "llama-3.1-8b"])
def test_nf4_split_counts_what_the_quantizer_counts(name):
    """4-bit: the split is taken with transformers' bitsandbytes quantizer; its element size (half a byte for a
    converted weight) gives the same per-card bytes as vramguard's tensors."""
    pytest.importorskip("bitsandbytes")
    from transformers.integrations.accelerate import compute_module_sizes

    from vramguard.plan.multigpu.devicemap import meta_model_as_loaded, split_weights
    from vramguard.resolve import resolve_model
    spec = _spec(name) if name in HAND else resolve_model(name)
    s = Settings(quant="nf4")
    model, quantizer = meta_model_as_loaded(spec, s)
    sizes = compute_module_sizes(model, quantizer)[0]
    mm = (int(sizes[""] * 0.75), int(sizes[""] * 0.65))
    split = split_weights(choose(spec).model, s, mm)
    per_card = [sum(sizes[k] for k, d in split.device_map.items() if d == c) for c in (0, 1)]
    assert list(split.raw_bytes) == [int(x) for x in per_card]
    # the packed weights plus their state (absmax, codes) are what the card really holds: more than the raw half-byte
    assert all(w > r for w, r in zip(split.weight_bytes, split.raw_bytes))


def test_per_card_need_is_its_layers_kv_and_the_logits_on_the_last_card():
    """Llama-3.1-8B, bf16, 8,192-token prompt, 256 new, two 24 GiB cards: 16 layers on each; each card's KV is its
    16 layers x 2 (K and V) x 8 KV heads x 8,192 tokens x 128 x 2 B = 16 x 33,554,432 = 536,870,912 B at the
    prefill peak; with every position's logits (--logits all), the lm_head card holds 8,192 x 128,256 x 2 B =
    2,101,346,304 B of logits, and the input's card the copy returned to it plus its float32 copy (x 3)."""
    from vramguard.memory.runtime import CUBLAS_WORKSPACE_BYTES, CUDA_CONTEXT_BYTES
    from vramguard.plan.multigpu import plan_gpus
    s = Settings(quant="bf16", prompt_tokens=8192, max_new_tokens=256, logits="all")
    p = plan_gpus("llama-3.1-8b", s, gpus=[gpu_from_vram("24GiB")] * 2, solve=False)
    c0, c1 = p.cards
    assert (c0.layers, c1.layers) == (tuple(range(16)), tuple(range(16, 32)))
    assert (c0.holds, c1.holds) == (("input embeddings",), ("lm_head",))
    assert c0.kv_cache_bytes == c1.kv_cache_bytes == 536_870_912
    logits = 8192 * 128256 * 2
    assert c1.activation_bytes >= logits and c0.activation_bytes >= 3 * logits
    for c in p.cards:
        assert c.need_bytes == (c.weights_bytes + CUBLAS_WORKSPACE_BYTES + c.kv_cache_bytes + c.activation_bytes
                                + c.reserve_bytes + CUDA_CONTEXT_BYTES)
        assert c.headroom_bytes == c.usable_bytes - c.need_bytes
    assert sum(p.split.weight_bytes) == sum(c.weights_bytes for c in p.cards)


def test_verdict_is_each_card_against_itself_and_names_the_limit():
    """40 GiB + 12 GiB for Llama-3.1-8B bf16 with a 16,384-token prompt: together they have room (the needs sum to
    less than the 52 GiB), but the 12 GiB card cannot hold its half of the layers with their KV: it is the limit,
    and the largest prompt is the one that card allows."""
    from vramguard.plan.multigpu import plan_gpus
    s = Settings(quant="bf16", prompt_tokens=16384, max_new_tokens=256)
    cards = [gpu_from_vram("40GiB"), gpu_from_vram("12GiB")]
    p = plan_gpus("llama-3.1-8b", s, gpus=cards)
    assert not p.fits and p.limit_card == 1
    assert p.cards[0].fits and not p.cards[1].fits
    assert sum(c.need_bytes for c in p.cards) < sum(c.usable_bytes for c in p.cards)
    best = p.max_prompt_tokens
    assert best is not None and best < 16384
    assert plan_gpus("llama-3.1-8b", s.with_(prompt_tokens=best), gpus=cards, solve=False).fits
    assert not plan_gpus("llama-3.1-8b", s.with_(prompt_tokens=best + 1), gpus=cards, solve=False).fits


def test_weights_that_fit_no_card_go_to_the_cpu_and_do_not_fit():
    from vramguard.plan.multigpu import plan_gpus
    p = plan_gpus("llama-3.1-8b", Settings(quant="bf16"), gpus=[gpu_from_vram("6GiB")] * 2, solve=False)
    assert p.split.offloaded and not p.fits and "CPU RAM" in p.notes[0]


# --------------------------------------------------------------------------------- tensor parallelism
def _transformers_shards(spec, tp: int) -> list[dict[str, tuple[int, ...]]]:
    """Local shapes of every parameter on each rank, from transformers' own ``apply_tensor_parallelism`` on a meta
    model under a fake process group of ``tp`` ranks (no communication: meta tensors, ``src_data_rank=None``)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")
    dist_mod = pytest.importorskip("transformers.distributed")
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism
    out = []
    for rank in range(tp):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=tp)
        try:
            mesh = init_device_mesh("cpu", (tp,))
            from transformers import AutoModelForCausalLM

            from vramguard.introspect.build import cached_config
            with torch.device("meta"):  # as from_pretrained distributes it: before the weights are tied
                model = AutoModelForCausalLM.from_config(cached_config(spec.config_json, spec.name),
                                                         dtype=torch.bfloat16)
            plan, _, _ = model._resolve_parallel_plans(dist_mod.DistributedConfig(tp_size=tp))
            apply_tensor_parallelism(model, mesh, plan)
            out.append({n: tuple(p.to_local().shape if isinstance(p, DTensor) else p.shape)
                        for n, p in model.named_parameters()})
        finally:
            dist.destroy_process_group()
    return out


@pytest.mark.parametrize("name,tp", [("llama", 2), ("qwen3", 2), ("qwen2", 2), ("gemma2", 2), ("mixtral", 2),
                                     ("phi3", 2), ("llama", 4), ("olmoe", 2)])
def test_tp_shards_equal_transformers_dtensors(name, tp):
    """Gemma-2 is planned untied here: transformers 5.24's ``apply_tensor_parallelism`` looks up ``lm_head.weight``
    among the deduplicated parameters of a tied model and raises KeyError (its own limit, not vramguard's)."""
    from vramguard.plan.multigpu.tensorparallel import tp_shards
    spec = _spec(name)
    if name == "gemma2":
        spec = spec_from_config({**HAND[name], "tie_word_embeddings": False}, name=name)
    if spec.num_kv_heads % tp:
        spec = spec_from_config({**HAND[name], "num_key_value_heads": 4}, name=name)
    mine = tp_shards(spec, Settings(quant="bf16"), tp)
    theirs = _transformers_shards(spec, tp)
    tied = {"lm_head.weight"} if spec.tie_word_embeddings else set()
    for rank in range(tp):
        assert set(theirs[rank]) - set(mine.shapes[rank]) == tied  # a tied lm_head is the embeddings' shard
        assert mine.shapes[rank] == {k: v for k, v in theirs[rank].items() if k not in tied}, rank
        if tied:
            assert theirs[rank]["lm_head.weight"] == mine.shapes[rank]["model.embed_tokens.weight"]
    # vocab 301 over 2 ranks: torch.chunk gives 151 and 150 rows of the embeddings
    if name in HAND and tp == 2:
        assert [mine.shapes[r]["model.embed_tokens.weight"][0] for r in (0, 1)] == [151, 150]


def test_tp_rank_holds_its_heads_and_the_replicated_rest():
    """Llama-3.1-8B over 2 ranks: 8 KV heads -> 4 per rank; each rank's KV at 8,192 + 256 tokens is half the
    single-card cache; norms are whole on every rank, projections and embeddings split."""
    from vramguard.memory.kv import kv_cache_bytes
    from vramguard.plan.multigpu import plan_gpus
    from vramguard.resolve import resolve_model
    s = Settings(quant="bf16", prompt_tokens=8192, max_new_tokens=256)
    p = plan_gpus("llama-3.1-8b", s, gpus=[gpu_from_vram("24GiB")] * 2, tp=2, solve=False)
    sh = p.split
    assert sh.kv_heads_per_rank == 4
    whole = kv_cache_bytes(resolve_model("llama-3.1-8b"), s, 8192).gpu_bytes  # 32 x 2 x 8 x 8,192 x 128 x 2 B
    assert whole == 1_073_741_824 and p.cards[0].kv_cache_bytes == whole // 2
    assert "model.norm.weight" in sh.replicated and "model.layers.0.input_layernorm.weight" in sh.replicated
    assert "model.embed_tokens.weight" not in sh.replicated and "lm_head.weight" not in sh.replicated
    assert sh.shapes[0]["model.layers.0.self_attn.k_proj.weight"] == (512, 4096)  # 4 heads x 128 of 1,024 rows


def test_tp_refusals_name_the_limit():
    from vramguard.plan.multigpu import plan_gpus
    cards3 = [gpu_from_vram("24GiB")] * 3
    with pytest.raises(InvalidValue, match="num_key_value_heads=8"):  # 8 KV heads over 3 ranks
        plan_gpus("llama-3.1-8b", Settings(quant="bf16"), gpus=cards3, tp=3, solve=False)
    with pytest.raises(InvalidValue, match="tensor parallelism") as e:  # two settings that do not go together
        plan_gpus("llama-3.1-8b", Settings(quant="nf4"), gpus=cards3[:2], tp=2, solve=False)
    assert (e.value.field, e.value.exit_code) == ("quant + tp", 2)
    with pytest.raises(InvalidValue, match="one tensor-parallel rank per card"):
        plan_gpus("llama-3.1-8b", Settings(quant="bf16"), gpus=cards3, tp=2, solve=False)
    with pytest.raises(InvalidValue, match="2 to 64 cards"):
        plan_gpus("llama-3.1-8b", Settings(quant="bf16"), gpus=cards3[:1], solve=False)
    with pytest.raises(InvalidValue, match="one positive size in bytes per card"):
        plan_gpus("llama-3.1-8b", Settings(quant="bf16"), gpus=cards3[:2], max_memory=[2**34], solve=False)


# --------------------------------------------------------------------------------- the command
def _cli(*args):
    """``vramguard plan ARGS`` in this process (typer's runner): (exit code, stdout and stderr together)."""
    from typer.testing import CliRunner

    from vramguard.cli import app
    r = CliRunner().invoke(app, ["plan", *args], env={"COLUMNS": "160"})
    return r.exit_code, r.output


def test_cli_plans_different_cards_and_tp():
    code, out = _cli("llama-3.1-8b", "--quant", "bf16", "--prompt-tokens", "16384", "--vram", "40GiB,12GiB",
                     "--attn", "sdpa", "--format", "json")  # the attention given: no note on the default's reason
    assert code == 0, out
    d = json.loads(out)
    assert d["layout"] == "device_map" and d["limit_card"] == 1 and d["fits"] is False
    assert d["reserved_from"] == "reserve formula"  # cards used together: the allocator model plans one card
    assert [c["gpu"]["total_bytes"] for c in d["cards"]] == [40 * 2**30, 12 * 2**30]
    assert all(isinstance(c["need_bytes"], int) for c in d["cards"]) and d["max_memory"][0] > 0
    code, out = _cli("llama-3.1-8b", "--quant", "bf16", "--prompt-tokens", "16384", "--tp", "2", "--gpu", "rtx-4090")
    assert code == 0, out
    assert "tp_plan='auto' over 2 ranks, 4 KV heads per rank" in out and "largest prompt" in out
    code, out = _cli("llama-3.1-8b", "--gpus", "3", "--vram", "24GiB,24GiB")
    assert code != 0 and "--vram" in out and "3 cards" in out


def test_a_card_given_nothing_needs_nothing():
    """Tiny OLMoE (2 layers, each larger than half the model): transformers' balanced cap for the first card (half
    the model + 1.25 x the largest layer) exceeds the whole model, so the second card is never touched and gets no
    CUDA context either."""
    from vramguard.plan.multigpu import plan_gpus
    p = plan_gpus(_spec("olmoe"), Settings(quant="bf16", prompt_tokens=64, max_new_tokens=8),
                  gpus=[gpu_from_vram("8GiB")] * 2, solve=False)
    c0, c1 = p.cards
    assert c0.layers == (0, 1) and c1.need_bytes == 0 and c1.phase == "unused" and p.fits


@pytest.mark.parametrize("name,quant", [(n, q) for n in (*HAND, *MORE_HAND) for q in ("bf16", "nf4")] + [
    ("llama-3.1-8b", "nf4"), ("gemma-2-9b", "bf16"), ("mixtral-8x7b", "bf16"), ("qwen2.5-7b", "nf4"),
    ("phi-3-mini-4k", "bf16"), ("llama", "int8"), ("llama-3.1-8b", "int8"), ("qwen2", "fp32"), ("mixtral", "int8")])
def test_torch_free_split_equals_transformers(name, quant):
    """The layer-wise split a hand family gets without torch (its module tree sized from the spec, transformers'
    placement rule ported) is transformers' own on the meta model: the device map, the bytes per card (raw and as
    held), the layers per card, for cards of 90%/80%, 60%/60% and 55%/30% of the model (splits, offloads)."""
    from vramguard.plan.multigpu.devicemap import _split
    from vramguard.plan.multigpu.layerwise import layerwise_split
    from vramguard.resolve import resolve_model
    spec = _spec(name) if name in HAND or name in MORE_HAND else resolve_model(name)
    s = Settings(quant=quant)
    whole = _split(spec, s, (2**60, 2**60))
    total = sum(whole.raw_bytes)
    for a, b in ((0.9, 0.8), (0.6, 0.6), (0.55, 0.3)):
        mm = (int(total * a), int(total * b))
        ref, mine = _split(spec, s, mm), layerwise_split(spec, s, mm)
        assert mine.device_map == ref.device_map, (a, b)
        assert (mine.raw_bytes, mine.weight_bytes, mine.layers) == (ref.raw_bytes, ref.weight_bytes, ref.layers)
        assert (mine.input_card, mine.output_card, mine.offloaded) == (ref.input_card, ref.output_card, ref.offloaded)
        assert mine.no_split == ref.no_split


def test_without_torch_a_hand_family_is_split_and_planned_the_same():
    """The same plan in a process where torch, transformers and accelerate cannot be imported."""
    import subprocess
    import sys
    from vramguard.plan.multigpu import plan_gpus
    code = ("import sys, json\n"
            "for m in ('torch', 'transformers', 'accelerate'): sys.modules[m] = None\n"
            "from vramguard.hardware import gpu_from_vram\n"
            "from vramguard.plan.multigpu import plan_gpus\n"
            "from vramguard.settings import Settings\n"
            "p = plan_gpus('llama-3.1-8b', Settings(quant='bf16', prompt_tokens=4096), "
            "gpus=[gpu_from_vram('40GiB'), gpu_from_vram('12GiB')])\n"
            "print(json.dumps([[c.weights_bytes, c.kv_cache_bytes, c.need_bytes] for c in p.cards] "
            "+ [p.limit_card, p.max_prompt_tokens]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    p = plan_gpus("llama-3.1-8b", Settings(quant="bf16", prompt_tokens=4096),
                  gpus=[gpu_from_vram("40GiB"), gpu_from_vram("12GiB")])
    assert json.loads(r.stdout) == [[c.weights_bytes, c.kv_cache_bytes, c.need_bytes] for c in p.cards] + [
        p.limit_card, p.max_prompt_tokens]


@pytest.mark.parametrize("args", [("--vram", "40GiB,12GiB"), ("--gpus", "2", "--gpu", "rtx-4090", "--tp", "2"),
                                  ("--gpu", "t4,a100-80gb")])
def test_the_card_table_fits_80_columns(args):
    from typer.testing import CliRunner

    from vramguard.cli import app
    r = CliRunner().invoke(app, ["plan", "llama-3.1-8b", "--quant", "bf16", *args], env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert all(len(line) <= 80 and line == line.rstrip() for line in lines), max(lines, key=len)
    rows = [line for line in lines if line.split()[:1] in (["0"], ["1"])]
    assert len(rows) == 2 and all(len(row.split()) >= 9 for row in rows), rows  # each card on one line


@pytest.mark.parametrize("name,s", [
    ("llama-3.1-8b", Settings(quant="bf16", prompt_tokens=8192)),
    ("llama-3.1-8b", Settings(quant="nf4", prompt_tokens=4096, logits="all")),
    ("gemma-2-9b", Settings(quant="bf16", prompt_tokens=4096, attn="sdpa")),
    ("qwen2.5-7b", Settings(quant="nf4", prompt_tokens=1000, max_new_tokens=500, batch=4))])
def test_every_layer_on_one_card_needs_what_the_single_card_plan_says(name, s):
    """``sequential`` with room on the first card only: it holds every layer, the second nothing, and its need is the
    single-card plan's ``generate`` need, up to the rotary (and Gemma's embed_scale) buffers that the split counts
    from transformers' own tensors (2 x 512 B rounded, 3 x for Gemma) and the hand weight model leaves out."""
    from vramguard.plan import estimate
    from vramguard.plan.multigpu import plan_gpus
    from vramguard.resolve import resolve_model
    spec = resolve_model(name)
    p = plan_gpus(spec, s, gpus=[gpu_from_vram("200GiB"), gpu_from_vram("10GiB")],
                  max_memory=(150 * 2**30, 2**30), device_map="sequential", solve=False)
    assert p.cards[0].layers == tuple(range(spec.num_layers)) and p.cards[1].need_bytes == 0
    assert 0 <= p.cards[0].need_bytes - estimate(choose(spec).model, s).generate_device_bytes <= 3 * 512


def test_when_a_card_is_short_and_another_has_room_the_fix_is_a_max_memory_that_fits():
    from vramguard.plan.multigpu import plan_gpus
    s = Settings(quant="nf4", prompt_tokens=8192)
    cards = [gpu_from_vram("48GiB"), gpu_from_vram("24GiB")]
    p = plan_gpus("llama-3.1-70b", s, gpus=cards)
    assert not p.fits and p.limit_card == 1 and p.fix is not None and p.fix.device_map == "sequential"
    again = plan_gpus("llama-3.1-70b", s, gpus=cards, max_memory=p.fix.max_memory_bytes, device_map="sequential",
                      solve=False)
    assert again.fits and [c.need_bytes for c in again.cards] == [c.need_bytes for c in p.fix.cards]
    assert all(b % 2**20 == 0 for b in p.fix.max_memory_bytes)  # whole MiB, as printed


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen2.5-7b"])
def test_sequential_fills_each_card_in_turn_as_accelerate_does(name):
    """``device_map="sequential"``: transformers hands max_memory to accelerate's ``infer_auto_device_map`` without
    balancing it (``_get_device_map``), so the first card takes layers up to its max_memory, the second the rest;
    a first card of 40% of the model and a second of all of it."""
    from accelerate.utils import infer_auto_device_map
    from transformers.integrations.accelerate import compute_module_sizes

    from vramguard.plan.multigpu.devicemap import split_weights
    from vramguard.resolve import resolve_model
    spec = resolve_model(name)  # catalog: real sizes, on meta
    model = _meta(spec)
    total = compute_module_sizes(model)[0][""]
    mm = (int(total * 0.4), total)
    split = split_weights(choose(spec).model, Settings(quant="bf16"), mm, "sequential")
    expected = infer_auto_device_map(model, max_memory={0: mm[0], 1: mm[1], "cpu": 2**60},
                                     no_split_module_classes=model._no_split_modules)
    assert split.device_map == dict(expected)
    assert split.layers[0] and split.layers[1] and split.layers[0][-1] + 1 == split.layers[1][0]
    assert split.weight_bytes[0] <= mm[0] and not split.offloaded


def test_the_printed_plan_names_the_device_map_it_used():
    """``--device-map sequential`` whose first card's max_memory holds all of Llama-3.1-8B in bf16 (14.96 GiB of
    weights in 36,045 MiB): every layer on card 0, card 1 unused, and the text says sequential, not auto."""
    from conftest import run_cli
    args = ["plan", "llama-3.1-8b", "--quant", "bf16", "--prompt-tokens", "16384", "--vram", "40GiB,12GiB",
            "--device-map", "sequential", "--max-memory", "36045MiB,7373MiB"]
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "device_map='sequential' over 2 cards" in r.stdout and "device_map='auto'" not in r.stdout
    assert "card 0: layers 0-31, input embeddings, lm_head" in r.stdout
    assert "card 1: nothing: device_map='sequential' leaves it unused" in r.stdout
    d = json.loads(run_cli(*args, "--format", "json").stdout)
    assert d["device_map_mode"] == "sequential" and set(d["device_map"].values()) == {0}
    auto = run_cli(*args[:-4], "--max-memory", "36045MiB,7373MiB")  # the same cards, balanced
    assert "device_map='auto' over 2 cards" in auto.stdout and "card 1: layers" in auto.stdout
    # its fix is the sequential map above, which uses card 0 alone: said so
    assert "card 1: no layer, unused, needs 0.00 GiB of 12.00 GiB" in " ".join(auto.stdout.split())


def test_a_plan_with_a_module_left_for_cpu_ram_says_it_does_not_fit():
    # Llama-3.1-70B NF4 on two 21 GiB cards: both cards hold their share (yes, yes), but the device map leaves
    # lm_head (128,256 x 8,192 x 2 B = 2,101,346,304 B = 1.96 GiB) for CPU RAM; the JSON said fits false, the
    # text did not, and the bitsandbytes note stopped mid-sentence
    from conftest import run_cli
    r = run_cli("plan", "llama-3.1-70b", "--vram", "21GiB,21GiB", columns="200")
    text = " ".join(r.stdout.split())
    assert r.returncode == 0
    assert "does not fit: 1 module(s), 1.96 GiB (lm_head), are left for CPU RAM by the device map" in text
    assert "llm_int8_enable_fp32_cpu_offload=True), and those modules then run unquantized" in text
    assert run_cli("plan", "llama-3.1-70b", "--vram", "21GiB,21GiB", "--exit-code").returncode == 1
