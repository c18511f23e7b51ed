"""Pre-quantized checkpoints in local folders: the weights are what their safetensors headers store, and what
transformers' quantizer does with them at load (kept, or dequantized to bf16 with the cost)."""

from __future__ import annotations

import json

import pytest

from vramguard.hub import prequant
from vramguard.hub.headers import TensorHeader, read_local_checkpoint
from vramguard.hub.prequant import LoadRule, header_weight_bytes, load_rule, tensor_kind
from vramguard.memory.weights import rounded

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

E, H, I, L = 4, 64, 64, 2  # experts, hidden, expert intermediate, layers


def _gpt_oss_folder(tmp_path):
    """gpt-oss as it ships: MXFP4 experts as ``*_blocks`` (uint8, 16 B = 32 FP4 values per block) and
    ``*_scales`` (uint8 E8M0 per block), everything else bf16."""
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_hidden_layers=L,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                    max_position_embeddings=1024).to_dict()
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                     "model.layers.*.mlp.router",
                                                                                     "model.embed_tokens", "lm_head"]}
    bf = torch.bfloat16
    t = {"model.embed_tokens.weight": torch.zeros(512, H, dtype=bf), "lm_head.weight": torch.zeros(512, H, dtype=bf),
         "model.norm.weight": torch.ones(H, dtype=bf)}
    for i in range(L):
        p = f"model.layers.{i}"
        for n, (o, k) in {"q_proj": (64, H), "k_proj": (32, H), "v_proj": (32, H), "o_proj": (H, 64)}.items():
            t[f"{p}.self_attn.{n}.weight"] = torch.zeros(o, k, dtype=bf)
            t[f"{p}.self_attn.{n}.bias"] = torch.zeros(o, dtype=bf)
        t[f"{p}.self_attn.sinks"] = torch.zeros(4, dtype=bf)
        t[f"{p}.mlp.router.weight"] = torch.zeros(E, H, dtype=bf)
        t[f"{p}.mlp.router.bias"] = torch.zeros(E, dtype=bf)
        t[f"{p}.mlp.experts.gate_up_proj_blocks"] = torch.zeros(E, 2 * I, H // 32, 16, dtype=torch.uint8)
        t[f"{p}.mlp.experts.gate_up_proj_scales"] = torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8)
        t[f"{p}.mlp.experts.gate_up_proj_bias"] = torch.zeros(E, 2 * I, dtype=bf)
        t[f"{p}.mlp.experts.down_proj_blocks"] = torch.zeros(E, H, I // 32, 16, dtype=torch.uint8)
        t[f"{p}.mlp.experts.down_proj_scales"] = torch.zeros(E, H, I // 32, dtype=torch.uint8)
        t[f"{p}.mlp.experts.down_proj_bias"] = torch.zeros(E, H, dtype=bf)
        t[f"{p}.input_layernorm.weight"] = torch.ones(H, dtype=bf)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(H, dtype=bf)
    folder = tmp_path / "gpt-oss"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, t


def test_local_headers_match_the_safetensors_library(tmp_path):
    folder, tensors = _gpt_oss_folder(tmp_path)
    ck = read_local_checkpoint(folder)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        want = {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}  # noqa: SIM118
    assert {t.name: (t.dtype, t.shape) for t in ck.tensors} == want
    assert ck.total_bytes == sum(x.numel() * x.element_size() for x in tensors.values())
    size = (folder / "model.safetensors").stat().st_size
    assert ck.header_bytes + ck.total_bytes == size  # header (8 + N) and data make up the whole file


def test_mxfp4_kept_with_kernels_and_dequantized_to_bf16_without(tmp_path, monkeypatch):
    """Per layer: gate_up blocks 4 x 128 x 2 x 16 = 16,384 B (32,768 FP4 values), down blocks 4 x 64 x 2 x 16 =
    8,192 B (16,384 values); scales 1,024 B and 512 B. Dequantized to bf16: 65,536 + 32,768 B, scales freed:
    per layer (65,536 + 32,768) - (16,384 + 8,192 + 1,024 + 512) = 72,192 B more, 144,384 B for 2 layers."""
    from vramguard.plan import plan
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    folder, tensors = _gpt_oss_folder(tmp_path)
    spec = resolve_model(str(folder))
    assert spec.prequantized == "mxfp4" and spec.checkpoint.format == "safetensors"
    versions = {"triton": "3.6.0", "kernels": "0.12.1", "accelerate": "1.10.0"}
    monkeypatch.setattr(prequant, "INSTALLED_OVERRIDE", versions.get)
    s = Settings(quant="bf16", attn="eager")
    kept = plan(spec, s, gpu="h100-80gb", solve=False)
    assert kept.estimate.weights.total_bytes == sum(rounded(x.numel() * x.element_size()) for x in tensors.values())
    assert "prequantized_dequantize_cost" in {f.code for f in kept.findings}
    monkeypatch.setattr(prequant, "INSTALLED_OVERRIDE", {**versions, "kernels": None}.get)
    dq = plan(spec, s, gpu="h100-80gb", solve=False)
    assert dq.estimate.weights.total_bytes - kept.estimate.weights.total_bytes == 144_384
    f = {x.code: x for x in dq.findings}["prequantized_dequantized"]
    assert "kernels" in f.message and f.bytes == 144_384 and "pip install" in f.fix
    t4 = plan(spec, s, gpu="t4", solve=False)  # compute capability 7.5 keeps MXFP4 with the kernels
    monkeypatch.setattr(prequant, "INSTALLED_OVERRIDE", versions.get)
    assert plan(spec, s, gpu="t4", solve=False).estimate.weights.total_bytes == kept.estimate.weights.total_bytes
    assert t4.estimate.weights.total_bytes == dq.estimate.weights.total_bytes


def test_the_load_rules_of_transformers_quantizers():
    have = {"accelerate": "1", "triton": "3.4.0", "kernels": "0.12"}.get
    assert load_rule("fp8", {}, (8, 6), have).dequantize and not load_rule("fp8", {}, (8, 9), have).dequantize
    assert not load_rule("fp8", {}, None, have).dequantize  # unknown card: planned as one that keeps FP8
    assert load_rule("fp8", {"dequantize": True}, (9, 0), have).dequantize
    assert load_rule("mxfp4", {}, (7, 0), have).dequantize and not load_rule("mxfp4", {}, (7, 5), have).dequantize
    assert load_rule("mxfp4", {}, (9, 0), {"triton": "3.3.1", "kernels": "1"}.get).dequantize
    r = load_rule("gptq", {}, (8, 9), {"optimum": "2.0"}.get)
    assert r.missing == ("gptqmodel",) and not r.dequantize and "ImportError" in r.reason
    assert load_rule("awq", {}, None, {"gptqmodel": "5"}.get).missing == ()
    ct = load_rule("compressed-tensors", {"dequantize": True}, (9, 0), {"compressed-tensors": "0.15"}.get)
    assert ct.dequantize and ct.dequantized_dtype is None  # the model dtype


def test_tensor_kinds_of_each_layout():
    def kind(name, dtype="I32", shape=(8, 8)):
        return tensor_kind(TensorHeader(name, dtype, shape, 256, "f"))
    assert [kind(f"l.q_proj.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")] == [
        "qweight", "qstate", "qstate", "qstate"]  # GPTQ / AWQ
    assert kind("l.q_proj.weight", "F8_E4M3") == "qweight" and kind("l.q_proj.weight_scale_inv", "F32") == "qstate"
    assert kind("l.q_proj.weight_packed") == "qweight" and kind("l.q_proj.weight_shape", "I64", (2,)) == "qstate"
    assert kind("l.q_proj.weight", "U8", (2048, 1)) == "qweight"  # bitsandbytes 4-bit
    assert kind("l.q_proj.weight.absmax", "F32", (64,)) == "qstate"
    assert kind("l.q_proj.weight.quant_state.bitsandbytes__nf4", "U8", (80,)) == "qstate"
    assert kind("l.q_proj.SCB", "F32", (8,)) == "qstate"  # LLM.int8
    assert kind("model.embed_tokens.weight", "BF16") == "embedding" and kind("lm_head.weight", "BF16") == "lm_head"
    assert kind("l.input_layernorm.weight", "BF16", (8,)) == "norm" and kind("l.o_proj.bias", "BF16") == "bias"


def test_bitsandbytes_prequantized_weights_are_its_stored_bytes():
    """bitsandbytes NF4 of one 64 x 64 layer: weight uint8 (2048, 1) = 2,048 B, absmax 64 float32 = 256 B,
    quant_map 16 float32 = 64 B, quant_state 80 B; each rounded to 512 B: 2,048 + 3 x 512 = 3,584 B."""
    layer = [TensorHeader("l.q.weight", "U8", (2048, 1), 2048, "f"),
             TensorHeader("l.q.weight.absmax", "F32", (64,), 256, "f"),
             TensorHeader("l.q.weight.quant_map", "F32", (16,), 64, "f"),
             TensorHeader("l.q.weight.quant_state.bitsandbytes__nf4", "U8", (80,), 80, "f")]
    from vramguard.hub.headers import CheckpointHeaders
    ck = CheckpointHeaders("x", "safetensors", ("f",), tuple(layer))
    w = header_weight_bytes(ck, "bitsandbytes", {}, "bf16", LoadRule("bitsandbytes", False, None, "as stored"))
    assert (w.quantized_linear_bytes, w.quant_state_bytes, w.total_bytes) == (2048, 1536, 3584)


def test_an_unreadable_local_header_is_a_note_not_an_error(tmp_path):
    from vramguard.catalog.models import MODELS
    from vramguard.resolve import resolve_model
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in MODELS["llama-2-7b"].items()
                                                      if k != "source"}))
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 64)  # a header length of 0: no JSON
    spec = resolve_model(str(tmp_path))
    assert spec.checkpoint is None and any("headers could not be read" in n for n in spec.notes)


def test_compressed_tensors_packed_int4_kept_or_dequantized_to_the_model_dtype():
    """compressed-tensors pack-quantized, 4 bits, group 32, one 64 x 64 layer: weight_packed int32 (64, 8) =
    2,048 B standing for 2,048 x 8 / 4 = 4,096 values; weight_scale bf16 (64, 2) = 256 B; weight_shape int64 (2,)
    = 16 B. Kept: 2,048 + 512 + 512 = 3,072 B (each rounded to 512 B). With dequantize: true, 4,096 values in
    the model dtype (bf16: 8,192 B) and the state freed."""
    from vramguard.hub.headers import CheckpointHeaders
    qcfg = {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "group_size": 32}, "targets": ["Linear"]}}}
    layer = (TensorHeader("l.q.weight_packed", "I32", (64, 8), 2048, "f"),
             TensorHeader("l.q.weight_scale", "BF16", (64, 2), 256, "f"),
             TensorHeader("l.q.weight_shape", "I64", (2,), 16, "f"))
    ck = CheckpointHeaders("x", "safetensors", ("f",), layer)
    have = {"compressed-tensors": "0.15"}.get
    kept = header_weight_bytes(ck, "compressed-tensors", qcfg, "bf16", load_rule("compressed-tensors", qcfg, None,
                                                                                  have))
    assert (kept.quantized_linear_bytes, kept.quant_state_bytes, kept.total_bytes) == (2048, 1024, 3072)
    rule = load_rule("compressed-tensors", {**qcfg, "dequantize": True}, None, have)
    dq = header_weight_bytes(ck, "compressed-tensors", qcfg, "bf16", rule)
    assert (dq.dense_linear_bytes, dq.quant_state_bytes, dq.total_bytes) == (8192, 0, 8192)
