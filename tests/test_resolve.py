"""Model input: a local folder, a config.json, a catalog name, a model id in the local HF cache; and the errors."""

import json

import pytest

from vramguard.errors import ConfigError, UnknownModel
from vramguard.catalog.models import MODELS
from vramguard.resolve import is_gguf, resolve_model


def test_local_folder_and_config_json(tiny):
    folder, model = tiny("MistralConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=300,
                         max_position_embeddings=512, sliding_window=128)
    for arg in (str(folder), str(folder / "config.json")):
        spec = resolve_model(arg)
        assert (spec.model_type, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
            "mistral", 3, 4, 1, 32)
        assert spec.gqa_groups == 4 and spec.sliding_window == 128 and spec.num_sliding_layers == 3
        assert spec.max_position_embeddings == 512 and spec.checkpoint_dtype == "bf16"


def test_hf_cache_lookup_is_offline(tmp_path, monkeypatch):
    """A model id found in the local Hugging Face cache (the layout huggingface_hub writes)."""
    import huggingface_hub.constants as c
    repo = tmp_path / "models--someorg--tiny-llama"
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    cfg = {k: v for k, v in MODELS["llama-3.2-1b"].items() if k != "source"}
    (snap / "config.json").write_text(json.dumps(cfg))
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    spec = resolve_model("someorg/tiny-llama")
    assert spec.source.startswith("hf-cache:") and spec.num_layers == 16 and spec.head_dim == 64
    assert spec.tie_word_embeddings


def test_catalog_names_and_aliases():
    assert len(MODELS) >= 12
    assert resolve_model("Llama-2-7B").name == "llama-2-7b"
    assert resolve_model("llama2-7b").name == "llama-2-7b"


def test_unknown_model_names_forms():
    with pytest.raises(UnknownModel) as e:
        resolve_model("no-such-model-xyz")
    msg = str(e.value)
    assert "MODEL" in msg and "no-such-model-xyz" in msg and "catalog name" in msg


def test_bad_configs(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ConfigError):
        resolve_model(str(p))
    p.write_text(json.dumps({"model_type": "t5", "is_encoder_decoder": True}))
    with pytest.raises(ConfigError) as e:
        resolve_model(str(p))
    assert "decoder-only" in str(e.value)
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 0}))
    with pytest.raises(ConfigError) as e:
        resolve_model(str(p))
    assert "hidden_size" in str(e.value)
    cfg = {k: v for k, v in MODELS["llama-2-7b"].items() if k != "source"}
    cfg["num_key_value_heads"] = 5
    p.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        resolve_model(str(p))
    assert "divisor" in str(e.value)


def test_missing_fields_take_the_config_class_defaults(tmp_path):
    """transformers fills what config.json leaves out from the config class (LlamaConfig: 32 heads, 32 layers)."""
    pytest.importorskip("transformers")
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    spec = resolve_model(str(p))
    assert (spec.num_heads, spec.num_layers, spec.hidden_size) == (32, 32, 64)


def test_multimodal_text_config(tmp_path):
    cfg = {"model_type": "llava", "text_config": {k: v for k, v in MODELS["llama-2-7b"].items() if k != "source"}}
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    spec = resolve_model(str(p))
    assert spec.num_layers == 32 and any("vision" in n for n in spec.notes)


def test_an_unknown_model_id_is_pointed_at_the_closest_catalog_architecture():
    from vramguard.errors import UnknownModel
    from vramguard.resolve import closest_catalog_name, resolve_model
    assert closest_catalog_name("meta-llama/Llama-3.1-8B-Instruct") == "llama-3.1-8b"
    assert closest_catalog_name("Qwen/Qwen2-7B-Instruct") == "qwen2-7b"
    assert closest_catalog_name("google/gemma-2-9b-it") == "gemma-2-9b"
    assert closest_catalog_name("someone/zzzz") is None
    with pytest.raises(UnknownModel) as e:
        resolve_model("nobody-here/Llama-3.1-8B-Instruct")
    assert "llama-3.1-8b is this architecture" in e.value.fix and "config.json" in e.value.fix
    with pytest.raises(UnknownModel) as e:
        resolve_model("nobody-here/Llama-3.1-8B-Extended")
    assert "llama-3.1-8b is the closest (check that its shapes" in e.value.fix


def test_a_gguf_file_is_named_with_the_conversion(tmp_path):
    from conftest import run_cli
    tmp_path = tmp_path / ("a-long-folder-name-" * 4)  # the path is longer than the 80 columns it is printed in
    tmp_path.mkdir()
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff\xfe\x00not json")  # magic, version 3, binary
    runs = (("plan", str(gguf)), ("check", str(gguf)), ("run", str(gguf), "--prompt", "Hi"), ("plan", str(tmp_path)))
    import shlex
    for args in runs:
        r = run_cli(*args, columns="80")
        assert r.returncode == 3, (args, r.stderr)
        text = " ".join(r.stderr.split())
        assert "m.Q4_1.gguf is a GGUF file" in text and "a transformers model folder" in text, args
        assert "UnicodeDecodeError" not in r.stderr and "tokenizer files" not in r.stderr, args
        # a path longer than the terminal stays whole on its line (wrapped between words only), so it can be copied
        assert any(f"'{args[1]}'" in line for line in r.stderr.splitlines()), r.stderr
        # the conversion is the last line, whole at 80 columns (indented, never wrapped), and runs as a command
        code = r.stderr.splitlines()[-1]
        assert code.startswith("    python -c '") and len(code) > 80, r.stderr
        argv = shlex.split(code)
        assert argv[:2] == ["python", "-c"] and len(argv) == 3
        compile(argv[2], "<conversion>", "exec")
        assert f'from_pretrained("{tmp_path}", gguf_file="m.Q4_1.gguf")' in argv[2]
        assert 'c.save_pretrained("OUT")' in argv[2] and 'save_pretrained("OUT")' in argv[2].rsplit(";", 1)[1]
    (tmp_path / "notes.gguf").write_bytes(b"text, not GGUF")  # the magic decides, not the name
    assert not is_gguf(tmp_path / "notes.gguf") and is_gguf(gguf)


def test_a_generic_config_missing_a_dimension_says_the_class_default_filled_it():
    """An architecture outside the hand families whose config.json leaves out its layer count: transformers' config
    class supplies 16 (OLMoE's default), and the spec says so instead of planning that model silently."""
    pytest.importorskip("transformers")
    from vramguard.spec import spec_from_config
    cfg = {"model_type": "olmoe", "hidden_size": 64, "intermediate_size": 32, "num_attention_heads": 4,
           "num_key_value_heads": 4, "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256}
    spec = spec_from_config(cfg, "olmoe-no-layers")
    assert spec.num_layers == 16
    assert any(n.startswith("config.json names no num_hidden_layers") for n in spec.notes)
    full = spec_from_config({**cfg, "num_hidden_layers": 2}, "olmoe")
    assert not any("names no" in n for n in full.notes) and full.num_layers == 2
