"""One forward replayed on a few decoder layers and expanded (:mod:`vramguard.introspect.replay_trim`) is the replay
of every layer: the same peak, components, place of the peak, largest allocation and cache tensors by layer, for
Llama, Gemma-2 (sliding and global layers in turn), Mixtral (MoE), DeepSeek-V2 (MLA, a dense first layer before
MoE ones), Qwen2 (full-attention layers before sliding ones) and Falcon-H1 (attention and Mamba-2 in parallel),
prefill and decode, 16-bit and NF4."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

_BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=1024)
ARCHS = {
    "llama": dict(_BASE, num_hidden_layers=9),
    "gemma2": dict(_BASE, num_hidden_layers=10, sliding_window=16, head_dim=16),
    "mixtral": dict(_BASE, num_hidden_layers=9, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(_BASE, num_hidden_layers=9, num_key_value_heads=4, moe_intermediate_size=32,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, kv_lora_rank=32,
                        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                        first_k_dense_replace=1, n_group=1, topk_group=1),
    "qwen2": dict(_BASE, num_hidden_layers=12, use_sliding_window=True, sliding_window=16, max_window_layers=2),
    # attention and Mamba-2 side by side in every layer; its 5 ssm_multipliers are no per-layer list
    "falcon_h1": dict(_BASE, num_hidden_layers=9, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                      mamba_d_state=16, mamba_chunk_size=16),
}


def _config_json(tmp_path, model_type: str) -> str:
    from transformers import AutoConfig

    from vramguard.resolve import resolve_model
    AutoConfig.for_model(model_type, **ARCHS[model_type]).save_pretrained(tmp_path)
    return resolve_model(str(tmp_path)).config_json


def _full(config_json: str, s, past: int, chunk: int):
    from vramguard.introspect.build import cached_config, cached_structure, text_config
    from vramguard.introspect.replay import cached_replay_model, replay
    model, _ = cached_replay_model(config_json, "m", s.act_dtype, s.effective_attn, s.sdpa_kernel)
    quantized = set(cached_structure(config_json, "m", s.act_dtype, s.quant, s.double_quant,
                                     s.resolved_compute_dtype).quantized_modules) if s.is_bnb else set()
    return replay(model, text_config(cached_config(config_json, "m")), s, past, chunk, quantized)


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_the_trimmed_replay_is_the_full_replay(tmp_path, model_type):
    from vramguard.introspect.replay_trim import trimmed_replay
    from vramguard.settings import Settings
    config_json = _config_json(tmp_path, model_type)
    cases = [(Settings(quant="bf16", attn="eager", batch=2, prompt_tokens=1, max_new_tokens=0), 0, 40),
             (Settings(quant="nf4", attn="sdpa", prompt_tokens=1, max_new_tokens=0), 39, 1)]
    if model_type in ("gemma2", "qwen2"):  # a decode step under the 16-token window
        cases.append((Settings(quant="bf16", attn="sdpa", prompt_tokens=1, max_new_tokens=0), 7, 1))
    for s, past, chunk in cases:
        got = trimmed_replay(config_json, "m", s, past, chunk)
        want = _full(config_json, s, past, chunk)
        assert got is not None and len(want.cache_bytes) == ARCHS[model_type]["num_hidden_layers"]
        assert got == want, (s, past, chunk)


def test_a_decoder_whose_layers_do_not_repeat_is_replayed_whole(tmp_path):
    from vramguard.introspect.replay_trim import trimmed_replay
    from vramguard.settings import Settings
    from transformers import AutoConfig
    AutoConfig.for_model("llama", **dict(_BASE, num_hidden_layers=6)).save_pretrained(tmp_path)  # 1 layer saved
    from vramguard.resolve import resolve_model
    spec = resolve_model(str(tmp_path))
    assert trimmed_replay(spec.config_json, "m", Settings(prompt_tokens=1, max_new_tokens=0), 0, 8) is None


def test_a_replaced_cache_tensor_is_freed_at_its_update_whatever_ran_before(tmp_path):
    # the replay once kept every old K/V tensor of a decode step alive until Python's garbage collector happened to
    # run (a reference cycle held the list of the cache's tensors), so a decode peak depended on what the process
    # had done before; with the collector off, the peak's cache is the cache after the step, not twice it
    import gc

    from vramguard.settings import Settings
    from transformers import AutoConfig
    from vramguard.resolve import resolve_model
    AutoConfig.for_model("llama", **dict(_BASE, num_hidden_layers=2)).save_pretrained(tmp_path)
    config_json = resolve_model(str(tmp_path)).config_json
    s = Settings(quant="bf16", attn="sdpa", prompt_tokens=1, max_new_tokens=0)
    gc.disable()
    try:
        r = _full(config_json, s, 39, 1)
    finally:
        gc.enable()
    # the cache after the step: 2 layers x K, V x 40 tokens x 2 heads x 16 x 2 B = 10,240 B; the peak is at the
    # last layer's concatenation, with the one old tensor it replaces (39 x 2 x 16 x 2 = 2,496 B, 2,560 rounded)
    assert sum(r.cache_bytes) == 10_240 and r.at == "in_kv_cache"
    assert r.components["kv_cache"] == 10_240 + 2_560  # every old tensor kept: 20,480 B
