"""Tiny configs of architectures outside the hand-written families (each a real transformers model_type), for the
generic planner's tests: small enough to build, load, quantize and generate on a CPU in well under a second."""

_BASE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)

ARCHS: dict[str, dict] = {
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=512),
    "bloom": dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=256),
    "falcon": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=256,
                   new_decoder_architecture=True, num_kv_heads=2),
    "gpt_neox": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     vocab_size=256, max_position_embeddings=512),
    "olmo2": _BASE,
    "olmoe": dict(_BASE, num_experts=4, num_experts_per_tok=2),
    "phimoe": dict(_BASE, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(_BASE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    "deepseek_v3": dict(_BASE, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                        num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16,
                        qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    "qwen3_next": dict(_BASE, num_hidden_layers=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32, head_dim=16, linear_num_value_heads=4,
                       linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                       full_attention_interval=2),
    "granitemoehybrid": dict(_BASE, num_local_experts=4, num_experts_per_tok=2, layer_types=["mamba", "attention"],
                             mamba_n_heads=4, mamba_d_head=32, mamba_d_state=16, mamba_n_groups=1,
                             shared_intermediate_size=64),
    "llama4_text": dict(_BASE, num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=1,
                        intermediate_size_mlp=128, head_dim=16, attention_chunk_size=16, interleave_moe_layer_step=1),
    "gpt_oss": dict(_BASE, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=16),
    "cohere2": dict(_BASE, sliding_window=16, sliding_window_pattern=2),
    "starcoder2": dict(_BASE, sliding_window=16),
    "glm4_moe": dict(_BASE, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, head_dim=16, n_group=1, topk_group=1),
}

# what transformers' continuous batching cannot run, where serve's default engine (auto) takes the generate engine:
# MLA, linear attention, Mamba and chunked attention on 5.17 and 5.24; on 5.24 also the models whose attention calls
# the cache's own methods (Bloom, Falcon and GPT-NeoX: get_seq_length, update's kwargs), which 5.17 runs
CB_REFUSED = ("deepseek_v2", "deepseek_v3", "granitemoehybrid", "llama4_text", "qwen3_next")
CB_REFUSED_524 = ("bloom", "falcon", "gpt_neox")

def save_arch(folder, model_type: str, dtype: str = "bfloat16"):
    """Build the tiny random model of ``model_type`` (seed 0), save it in ``folder`` and return the model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    cfg = AutoConfig.for_model(model_type, **ARCHS[model_type])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.save_pretrained(folder)
    return model
