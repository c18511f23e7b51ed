"""What a fresh-clone trial with the real model found: run on a config transformers refuses, serve's CPU default."""

import json

from conftest import run_cli, save_tiny_llama


def test_run_refuses_a_config_transformers_rejects_with_its_reason(tmp_path):
    """A hidden size that is not a multiple of the heads: transformers' config validation (a huggingface_hub
    StrictDataclassError, read first by the tokenizer loader) is said as the config's error, exit 3, never 70."""
    folder = save_tiny_llama(tmp_path / "m", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = 66  # 66 / 4 heads
    (folder / "config.json").write_text(json.dumps(cfg))
    r = run_cli("run", str(folder), "--prompt", "w1 w2", "--raw", "--max-new-tokens", "2")
    assert r.returncode == 3, r.stderr
    assert "config.json" in r.stderr and "transformers rejected it" in r.stderr and "internal error" not in r.stderr
    assert "hidden size (66) is not a multiple of the number of attention heads (4)" in " ".join(r.stderr.split())


def test_serve_without_cuda_defaults_to_float32_weights_as_run_does(monkeypatch):
    """No --quant on a machine without CUDA: serve loads float32 weights (run's default there), and says why."""
    from vramguard.cli import serve as serve_cmd
    from vramguard.serve import server
    from vramguard.serve.config import ServeConfig

    seen = {}

    class Stop(Exception):
        pass

    def fake_build(model, config):
        seen.update(quant=config.quant)
        raise Stop

    monkeypatch.setattr(server, "build", fake_build)
    notes = []
    monkeypatch.setattr(serve_cmd, "say", notes.append)
    try:
        serve_cmd.serve_one("m", "127.0.0.1", 0, None, ServeConfig(quant=None))
    except Stop:
        pass
    assert seen["quant"] == "fp32"
    assert notes and notes[0].startswith("note: weights fp32: no CUDA device")
    seen.clear()
    try:
        serve_cmd.serve_one("m", "127.0.0.1", 0, None, ServeConfig(quant="nf4"))  # an explicit choice is kept
    except Stop:
        pass
    assert seen["quant"] == "nf4"
