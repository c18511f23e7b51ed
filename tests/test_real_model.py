"""The real trained model that the suite's stop, greedy-identity and quality tests use loads through the real code."""

import json


def test_smollm2_is_a_trained_model_that_ends_its_turn(smollm2, smollm2_greedy):
    """SmolLM2-135M-Instruct: Llama, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied embeddings; its end of turn
    ``<|im_end|>`` (id 2) is the generation config's EOS, and greedy decoding of a short chat answer emits it."""
    from transformers import AutoTokenizer
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["vocab_size"]) == \
        ("llama", 30, 3, 49152)
    tok = AutoTokenizer.from_pretrained(smollm2)
    model = smollm2_greedy.model  # transformers' own load of the folder (float32), shared by the modules
    assert model.generation_config.eos_token_id == 2 and tok.convert_ids_to_tokens(2) == "<|im_end|>"
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)
    assert ids["attention_mask"].all()
    out = smollm2_greedy.new_ids(ids["input_ids"][0].tolist(), 64)  # generate(max_new_tokens=64, do_sample=False)
    assert out[-1] == 2 and len(out) < 64
    assert "Paris" in tok.decode(out)
