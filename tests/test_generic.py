"""The generic planner: any architecture transformers builds, with weights, KV cache and peaks taken from
transformers itself, checked against real tiny models loaded, quantized and run on the CPU."""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from archs import ARCHS, CB_REFUSED, CB_REFUSED_524, save_arch  # noqa: E402

from vramguard.memory.weights import rounded  # noqa: E402
from vramguard.plan.choice import choose  # noqa: E402
from vramguard.resolve import resolve_model  # noqa: E402
from vramguard.settings import Settings  # noqa: E402

TYPES = sorted(ARCHS)


@pytest.fixture(scope="module")
def arch_dir(tmp_path_factory):
    made = {}

    def get(model_type):
        if model_type not in made:
            folder = tmp_path_factory.mktemp(model_type)
            save_arch(folder, model_type)
            made[model_type] = folder
        return made[model_type]
    return get


def _param_bytes(model) -> int:
    """Bytes of every parameter the loaded model holds (tied ones once), each rounded to 512 B, with the
    bitsandbytes quantization state of 4-bit layers."""
    total = 0
    for p in model.parameters():
        total += rounded(p.numel() * p.element_size())
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            ts = [qs.absmax, qs.code] + ([qs.offset, qs.state2.absmax, qs.state2.code] if qs.nested else [])
            total += sum(rounded(t.numel() * t.element_size()) for t in ts)
        scb = getattr(p, "SCB", None)
        if scb is not None:
            total += rounded(scb.numel() * scb.element_size())
    return total


def test_twelve_or_more_architectures_outside_the_families():
    from vramguard.spec import SUPPORTED_MODEL_TYPES
    assert len(set(TYPES) - set(SUPPORTED_MODEL_TYPES)) >= 12


def test_moe_fields_a_config_names_its_own_way_are_read_through_transformers(tmp_path):
    """ERNIE-4.5 names top-k ``moe_k`` (its config class maps ``num_experts_per_tok`` to it) and its shared experts
    ``moe_num_shared_experts``: the plan's model fields say 6 experts a token and 2 x 1,536 shared, not 0."""
    cfg = {"model_type": "ernie4_5_moe", "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 4,
           "num_attention_heads": 20, "num_key_value_heads": 4, "vocab_size": 103424, "moe_num_experts": 64,
           "moe_k": 6, "moe_intermediate_size": 1536, "moe_num_shared_experts": 2, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert spec.generic and (spec.num_experts, spec.num_experts_per_tok) == (64, 6)
    assert (spec.moe_intermediate_size, spec.shared_expert_intermediate_size) == (1536, 2 * 1536)


@pytest.mark.parametrize("model_type", TYPES)
def test_bf16_weights_equal_the_loaded_parameters(arch_dir, model_type):
    from transformers import AutoModelForCausalLM
    folder = arch_dir(model_type)
    spec = resolve_model(str(folder))
    assert spec.generic and spec.model_type == model_type
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    w = choose(spec).model.weight_bytes(Settings(quant="bf16"))
    assert w.total_bytes - w.buffer_bytes == _param_bytes(model)
    assert w.parameter_count == model.num_parameters()


@pytest.mark.parametrize("model_type", TYPES)
def test_nf4_weights_equal_what_bitsandbytes_keeps(arch_dir, model_type):
    """Loaded through transformers' bitsandbytes quantizer on the CPU: every packed weight, its quantization state
    and every tensor left in 16-bit (fused MoE experts among them)."""
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    folder = arch_dir(model_type)
    q = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.bfloat16, device_map="cpu",
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))
    w = choose(resolve_model(str(folder))).model.weight_bytes(Settings(quant="nf4"))
    assert w.total_bytes - w.buffer_bytes == _param_bytes(q)


@pytest.mark.parametrize("model_type", TYPES)
def test_kv_equals_the_cache_after_a_real_generate(arch_dir, model_type):
    """Planned KV after prompt + new - 1 tokens (the last sampled token is never fed back) equals every tensor of
    the cache ``generate`` returns: full, sliding, chunked, MLA latent, linear-attention and Mamba states."""
    from transformers import AutoModelForCausalLM
    from vramguard.introspect.replay import cache_tensors
    folder = arch_dir(model_type)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    prompt, new = 40, 6
    ids = torch.randint(3, 200, (1, prompt))
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         return_dict_in_generate=True)
    real = sum(rounded(t.numel() * t.element_size()) for _, _, t in cache_tensors(out.past_key_values))
    spec = resolve_model(str(folder))
    s = Settings(quant="bf16", prompt_tokens=prompt, max_new_tokens=new)
    assert choose(spec).model.kv_cache_bytes(s, prompt + new - 1).gpu_bytes == real


def test_generic_replay_agrees_with_the_hand_model_on_llama():
    """The hand-written Llama model and the replay of transformers' own forward (the source of truth) agree within
    1% on the prefill and decode peaks, for eager, SDPA and FlashAttention-2."""
    from dataclasses import replace

    hand = choose(resolve_model("llama-3.1-8b")).model
    gen = choose(replace(hand.spec, generic=True)).model
    assert (hand.needs_transformers, gen.needs_transformers) == (False, True)
    for attn in ("eager", "sdpa", "flash_attention_2"):
        s = Settings(quant="bf16", attn=attn, prompt_tokens=4096, max_new_tokens=64)
        for fn in ("prefill_peak", "decode_peak"):
            h, g = getattr(hand, fn)(s).peak_bytes, getattr(gen, fn)(s).peak_bytes
            assert abs(g - h) / g < 0.01, (attn, fn, h, g)


def test_mixtral_nf4_keeps_the_fused_experts_in_bf16():
    """transformers 5 + bitsandbytes keep Mixtral-8x7B's fused experts in bf16: 91,413,880,832 B measured on an
    H200 (transformers 5.17, bitsandbytes 0.50.2); both the hand model and transformers' quantizer say so."""
    from dataclasses import replace
    hand = resolve_model("mixtral-8x7b")
    assert choose(hand).model.weight_bytes(Settings(quant="nf4")).total_bytes == 91_413_880_832
    gen = choose(replace(hand, generic=True)).model.weight_bytes(Settings(quant="nf4"))
    assert gen.total_bytes - gen.buffer_bytes == 91_413_880_832


def test_gemma2_without_tie_word_embeddings_is_tied_by_the_class_default(tmp_path):
    cfg = {"model_type": "gemma2", "hidden_size": 3584, "intermediate_size": 14336, "num_hidden_layers": 42,
           "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "vocab_size": 256000,
           "max_position_embeddings": 8192, "sliding_window": 4096, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = resolve_model(str(tmp_path))
    assert spec.tie_word_embeddings
    assert choose(spec).model.weight_bytes(Settings(quant="bf16")).lm_head_bytes == 0


@pytest.mark.parametrize("model_type", TYPES)
def test_run_generates_on_architectures_outside_the_families(tmp_path, model_type):
    """``generate`` (the library side of ``vramguard run``) loads and runs every architecture, its preflight
    planned by the generic path."""
    from conftest import save_word_tokenizer

    from vramguard import load_model
    from vramguard.run.generate import generate
    save_arch(tmp_path, model_type)
    save_word_tokenizer(tmp_path, 256)
    r = generate(load_model(str(tmp_path), quant="bf16"), None, "w1 w2 w3 w4", max_new_tokens=5)
    assert len(r.token_ids) == 5 and r.planned_need_bytes and r.planned_need_bytes > 0


@pytest.mark.parametrize("model_type", ["gpt2", "olmoe", "starcoder2", "gpt_oss"])
def test_serve_answers_on_architectures_outside_the_families(tmp_path, model_type):
    """``vramguard serve``'s engine (transformers' continuous batching) on a classic model, a fused-expert MoE, a
    sliding-window model and gpt-oss (whose class refuses SDPA: eager is loaded and reported)."""
    import httpx
    from conftest import save_word_tokenizer

    from vramguard.serve.server import build
    save_arch(tmp_path, model_type)
    save_word_tokenizer(tmp_path, 256)
    s = build(str(tmp_path), quant="fp32", page_size=16, max_batch_tokens=64, max_running=4, max_queue=4,
              max_kv_blocks=20, verify=False, served_name="tiny")
    try:
        url = s.start_background()
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 5},
                       timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    finally:
        s.stop()
    if model_type == "gpt_oss":
        assert any("attention: eager" in n for n in s.report.notes)


SERVE_REFUSED = {"qwen3_next": "linear_attention", "deepseek_v2": "first request"}


@pytest.mark.parametrize("model_type,why", sorted(SERVE_REFUSED.items()))
def test_the_continuous_engine_refuses_what_it_cannot_run(tmp_path, model_type, why):
    """transformers' continuous batching has no linear-attention layer and no MLA cache: chosen explicitly, the
    continuous engine says so at start, naming the model type and the generate engine, instead of failing every
    request (the default engine, auto, serves such a model with generate: tests/test_serve_generic.py)."""
    from conftest import save_word_tokenizer

    from vramguard.serve.server import ContinuousBatchingRefused, build
    save_arch(tmp_path, model_type)
    save_word_tokenizer(tmp_path, 256)
    with pytest.raises(ContinuousBatchingRefused) as e:
        build(str(tmp_path), quant="fp32", page_size=16, max_batch_tokens=64, max_running=4, max_queue=4,
              max_kv_blocks=20, verify=False, served_name="tiny", engine_choice="continuous")
    assert model_type in str(e.value) and why in str(e.value) and "'generate'" in str(e.value)


def test_the_load_plan_counts_the_fused_expert_conversion(arch_dir):
    """A checkpoint that stores MoE experts one per tensor is fused at load (MergeModulelist + Concatenate): the
    sources and both outputs of the largest fused parameter are held beside the weights (measured on the H200 for
    OLMoE-1B-7B: reserved peak 15,453,913,088 B against 15,448,937,472 planned)."""
    from vramguard.introspect.generic import load_plan
    from vramguard.memory.runtime import RESERVE_SEGMENT_BYTES
    spec = resolve_model(str(arch_dir("olmoe")))
    lp = load_plan(spec, Settings(quant="bf16"))
    # 2 layers x (gate_up, down); gate_up: 4 experts x 256 x 64 x 2 B = 131,072 B, with 2 operations -> 3 x
    assert len(lp.converted) == 4
    assert lp.largest_transient_bytes == 3 * 4 * 2 * 128 * 64 * 2
    assert lp.peak_reserved_bytes == lp.weights_bytes + lp.largest_transient_bytes + RESERVE_SEGMENT_BYTES
    dense = load_plan(resolve_model(str(arch_dir("olmo2"))), Settings(quant="bf16"))
    assert dense.converted == () and dense.largest_transient_bytes == 0


def test_serve_refuses_a_hard_cap_the_load_cannot_fit_under(arch_dir):
    from vramguard.errors import Infeasible
    from vramguard.introspect.generic import load_plan
    from vramguard.serve.server import _check_load_fits
    folder = str(arch_dir("olmoe"))
    lp = load_plan(resolve_model(folder), Settings(quant="bf16"))
    with pytest.raises(Infeasible) as e:
        _check_load_fits(folder, "bf16", None, lp.peak_reserved_bytes - 1)
    assert "vram_budget" in str(e.value) and "loading holds the weights" in str(e.value)
    _check_load_fits(folder, "bf16", None, lp.peak_reserved_bytes)


def test_check_fails_an_attention_the_model_class_refuses(arch_dir):
    """gpt-oss's class accepts no SDPA in transformers 5: check says so before any load, with a fix that runs."""
    from vramguard.check import check
    from vramguard.cli.flags import as_flags
    from vramguard.settings import Settings as S
    r = check(str(arch_dir("gpt_oss")), settings=S(attn="sdpa"))
    f = next(f for f in r.findings if f.code == "attn_supported")
    assert f.level == "fail" and "gpt_oss" in f.message and as_flags(f.fix).startswith("pass --attn eager")
    ok = check(str(arch_dir("gpt_oss")), settings=S(attn="eager"))
    assert not any(f.code == "attn_supported" for f in ok.findings)


def test_bad_values_in_a_generic_config_and_settings_are_named(tmp_path, arch_dir):
    from vramguard.errors import ConfigError, InvalidValue
    from vramguard.plan import plan
    for bad, field in (({"n_layer": -2}, "n_layer"), ({"n_head": 0}, "n_head"),
                       ({"n_layer": 99_999_999}, "num_hidden_layers")):
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **bad}))
        with pytest.raises(ConfigError) as e:
            resolve_model(str(tmp_path))
        assert field in str(e.value)
    gpt2 = str(arch_dir("gpt2"))
    with pytest.raises(InvalidValue) as e:
        plan(gpt2, Settings(batch=10**20), vram="24GiB")
    assert "batch" in str(e.value)
    with pytest.raises(InvalidValue) as e:  # learned positions: no --context can extend them
        plan(gpt2, Settings(prompt_tokens=600, max_new_tokens=8), vram="24GiB", context=4096)
    assert "512 learned position embeddings" in str(e.value)


@pytest.mark.parametrize("model_type,quant", [("olmoe", "fp16"), ("deepseek_v2", "fp32"), ("falcon", "bf16")])
def test_generic_plans_in_every_dtype_and_attention(arch_dir, model_type, quant):
    """grouped_mm's meta kernel takes bfloat16 only (fp16/fp32 MoE replays are sized by the tracker), and Falcon
    picks attention classes from its own table (FlashAttention-2 is replayed as SDPA's flash kernel)."""
    from vramguard.plan import plan
    p = plan(str(arch_dir(model_type)), Settings(quant=quant, attn="flash_attention_2" if quant == "bf16" else "sdpa"),
             vram="24GiB")
    assert p.estimate.peak_allocated_bytes > p.estimate.weights.total_bytes
    if model_type == "falcon":
        assert any(f.code == "attn_replayed" for f in p.findings)


def test_kv_growth_per_layer_kind_matches_a_real_cache(arch_dir):
    """Qwen3-Next (4 layers, every second one full attention): one more token grows only the full layers' K and V,
    the same as in a real ``generate``'s cache."""
    from transformers import AutoModelForCausalLM

    from vramguard.introspect.replay import cache_tensors
    folder = arch_dir("qwen3_next")
    spec = resolve_model(str(folder))
    assert spec.layer_types.count("full_attention") == 2
    g = choose(spec).model.kv_growth_per_token(Settings(quant="bf16"), 100)
    # 2 full layers x K and V x 2 KV heads x head_dim 16 x 2 B = 256 B; linear attention adds nothing
    assert g == {"linear_attention": 0, "full_attention": 2 * 2 * 2 * 16 * 2}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    ids = torch.randint(3, 200, (1, 99))

    def cached(new):
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, return_dict_in_generate=True)
        return sum(t.numel() * t.element_size() for _, _, t in cache_tensors(out.past_key_values))
    assert cached(3) - cached(2) == sum(g.values())


def _matrix_cases():
    import glob
    import os
    rows = {}
    here = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results", "h200_matrix")
    for f in sorted(glob.glob(os.path.join(here, "*", "*.jsonl"))):
        for line in open(f):
            r = json.loads(line)
            if r.get("kind") == "gen" and r.get("ok") and (r["quant"], r["attn"]) in (("nf4", "eager"),
                                                                                     ("bf16", "sdpa")):
                rows.setdefault((r["model"], r["quant"], r["attn"]), r)  # the first shape of each family and path
    # one path per model, in turn (NF4 eager, bf16 SDPA): every model and both paths, half the replays (each case
    # is in benchmarks/compare_generic_hand.py)
    models = sorted({m for m, _, _ in rows})
    paths = (("nf4", "eager"), ("bf16", "sdpa"))
    return [r for (m, q, a), r in sorted(rows.items()) if (q, a) == paths[models.index(m) % 2]]


@pytest.mark.parametrize("case", _matrix_cases(), ids=lambda r: f"{r['model']}-{r['quant']}-{r['attn']}")
def test_generic_replay_agrees_with_the_hand_models_on_the_measured_matrix(case):
    """On the H200 matrix's families and shapes, the replay of transformers' forward and the hand model agree
    within 1%, and the replay is within 1% of the measurement (every case: benchmarks/compare_generic_hand.py)."""
    from dataclasses import replace

    from vramguard.plan import estimate
    hand = resolve_model(case["model"])
    s = Settings(quant=case["quant"], attn=case["attn"], prompt_tokens=case["prompt"], max_new_tokens=case["new"],
                 batch=case["batch"])
    h = estimate(choose(hand).model, s).peak_allocated_bytes
    g = estimate(choose(replace(hand, generic=True)).model, s).peak_allocated_bytes
    assert abs(g - h) / h < 0.01
    assert abs(g - case["peak_total"]) / case["peak_total"] < 0.01


@pytest.mark.parametrize("model_type", [t for t in TYPES if t not in CB_REFUSED + CB_REFUSED_524])
def test_serve_answers_with_continuous_batching(tmp_path, model_type):
    """Every architecture continuous batching runs is served by it (the others by the generate engine:
    tests/test_serve_generic.py); never a server whose requests all fail."""
    import httpx
    from conftest import save_word_tokenizer

    from vramguard.serve.server import build
    save_arch(tmp_path, model_type)
    save_word_tokenizer(tmp_path, 256)
    s = build(str(tmp_path), quant="fp32", page_size=16, max_batch_tokens=64, max_running=4, max_queue=4,
              max_kv_blocks=20, verify=False, served_name="tiny")
    assert s.engine.name == "continuous"
    try:
        url = s.start_background()
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "w1 w2", "max_tokens": 3},
                       timeout=60)
        assert r.status_code == 200
    finally:
        s.stop()
