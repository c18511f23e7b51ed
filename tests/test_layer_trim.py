"""The tape traced on a few decoder layers and repeated equals the trace of every layer, event for event and key
for key, for Llama, Qwen2, Gemma-2 (sliding and global layers in turn), Mistral (sliding window), Phi-3, Mixtral
(MoE) and Falcon-H1 (attention and Mamba-2 in parallel), and with leading layers unlike the rest (DeepSeek-V2/V3
and GLM-4.5's dense layers before their MoE ones, Qwen2's full-attention layers before its sliding ones); models
whose layers differ otherwise are traced whole."""

from __future__ import annotations

import pytest

_BASE = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             max_position_embeddings=1024)
LAYERS = 9  # P = 1: 5 layers traced (3 x 1 + 2), 4 repeated; Gemma-2 (P = 2) traces 8 of 10

ARCHS = {
    "llama": dict(_BASE, num_hidden_layers=LAYERS),
    "qwen2": dict(_BASE, num_hidden_layers=LAYERS),
    "gemma2": dict(_BASE, num_hidden_layers=LAYERS + 1, sliding_window=16, head_dim=16),
    "mistral": dict(_BASE, num_hidden_layers=LAYERS, sliding_window=16),
    "phi3": dict(_BASE, num_hidden_layers=LAYERS, num_key_value_heads=4, pad_token_id=0),
    "mixtral": dict(_BASE, num_hidden_layers=LAYERS, num_local_experts=4, num_experts_per_tok=2),
    "falcon_h1": dict(_BASE, num_hidden_layers=LAYERS, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8,
                      mamba_d_state=16, mamba_chunk_size=16),  # attention and Mamba-2 side by side in every layer
}


def _spec(tmp_path, model_type: str, cfg: dict):
    from transformers import AutoConfig

    from vramguard.resolve import resolve_model
    AutoConfig.for_model(model_type, **cfg).save_pretrained(tmp_path)
    return resolve_model(str(tmp_path))


def _both(spec, s, prompt: int, new: int = 3):
    from vramguard.introspect.alloc_replay import _record_events, _trace
    return _record_events(spec.config_json, spec.name, s, prompt, new), _trace(spec.config_json, spec.name, s,
                                                                              prompt, new, 3)[0]


@pytest.mark.parametrize("model_type", sorted(ARCHS))
def test_trimmed_trace_is_the_full_trace(tmp_path, model_type):
    from vramguard.introspect.layer_trim import trim_plan
    from vramguard.settings import Settings
    spec = _spec(tmp_path, model_type, ARCHS[model_type])
    period = 2 if model_type == "gemma2" else 1
    for quant, attn, batch in (("bf16", "eager", 2), ("nf4", "sdpa", 1)):
        s = Settings(quant=quant, attn=attn, batch=batch, prompt_tokens=1, max_new_tokens=1)
        plan = trim_plan(spec.config_json, spec.name, s.act_dtype, s.quant, s.double_quant, s.resolved_compute_dtype)
        # 3P + 2 layers traced: 5 of 9 and 4 copies of one layer; Gemma-2: 8 of 10 and 1 copy of two layers
        assert plan is not None and plan[1:] == ((8, 2, 1, 0) if period == 2 else (5, 1, 4, 0))
        for prompt in (40, 7) if model_type in ("gemma2", "mistral") else (40,):  # past the 16-token window, under it
            trimmed, full = _both(spec, s, prompt)
            assert trimmed == full
            assert all(trimmed) and len(trimmed) == 3


def test_static_cache_and_one_new_token(tmp_path):
    from vramguard.settings import Settings
    spec = _spec(tmp_path, "llama", ARCHS["llama"])
    s = Settings(quant="bf16", attn="sdpa", cache="static", prompt_tokens=1, max_new_tokens=1)
    trimmed, full = _both(spec, s, 40, 8)
    assert trimmed == full
    trimmed, full = _both(spec, s.with_(cache="dynamic"), 40, 1)  # the prefill alone: traced whole
    assert trimmed == full and trimmed[2] == ()


@pytest.mark.parametrize("model_type,cfg", [
    ("qwen2", dict(_BASE, num_hidden_layers=LAYERS, use_sliding_window=True, sliding_window=16, max_window_layers=3)),
    ("llama", dict(_BASE, num_hidden_layers=6)),  # one layer left out: not worth it
])
def test_layers_that_differ_are_traced_whole(tmp_path, model_type, cfg):
    """Qwen2 with full attention below layer 3 and sliding above (3 leading layers, then 1 left out: not worth
    it), and a decoder too short to trim."""
    from vramguard.introspect.layer_trim import trim_plan
    from vramguard.settings import Settings
    spec = _spec(tmp_path, model_type, cfg)
    s = Settings(quant="bf16", attn="sdpa", prompt_tokens=1, max_new_tokens=1)
    assert trim_plan(spec.config_json, spec.name, s.act_dtype, s.quant, s.double_quant,
                     s.resolved_compute_dtype) is None
    trimmed, full = _both(spec, s, 40)
    assert trimmed == full


_MLA = dict(num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
            num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_group=1, topk_group=1)


@pytest.mark.parametrize("model_type,cfg,head", [
    ("deepseek_v2", dict(_BASE, num_hidden_layers=LAYERS, first_k_dense_replace=1, **_MLA), 1),
    ("deepseek_v3", dict(_BASE, num_hidden_layers=LAYERS + 3, first_k_dense_replace=3, **_MLA), 3),
    ("glm4_moe", dict(_BASE, num_hidden_layers=LAYERS, first_k_dense_replace=2, moe_intermediate_size=32,
                      n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                      head_dim=16), 2),
    ("qwen2", dict(_BASE, num_hidden_layers=LAYERS + 3, use_sliding_window=True, sliding_window=16,
                   max_window_layers=2), 2),
])
def test_leading_layers_that_differ_are_traced_and_the_rest_repeated(tmp_path, model_type, cfg, head):
    """DeepSeek-V2/V3 and GLM-4.5 with dense layers before their MoE ones (tensors differ by layer), Qwen2 with
    full attention below layer 2 and sliding above: the leading layers are traced as they are, then 3 x 1 + 2
    layers, and the tape of every layer equals the full trace's, event for event and key for key."""
    from vramguard.introspect.layer_trim import trim_plan
    from vramguard.settings import Settings
    spec = _spec(tmp_path, model_type, cfg)
    for quant, attn, batch in (("bf16", "eager", 2), ("nf4", "sdpa", 1)):
        s = Settings(quant=quant, attn=attn, batch=batch, prompt_tokens=1, max_new_tokens=1)
        plan = trim_plan(spec.config_json, spec.name, s.act_dtype, s.quant, s.double_quant, s.resolved_compute_dtype)
        n = cfg["num_hidden_layers"]
        assert plan is not None and plan[1:] == (head + 5, 1, n - head - 5, head)
        for prompt in (40, 7) if model_type == "qwen2" else (40,):  # past Qwen2's 16-token window and under it
            trimmed, full = _both(spec, s, prompt)
            assert trimmed == full and all(trimmed)
