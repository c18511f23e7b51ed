"""load_model / unload on CPU with tiny random models (real transformers and bitsandbytes loading code)."""

import gc
import weakref

import pytest

from vramguard.errors import InvalidValue, UnknownModel
from vramguard.runtime.load import load_model, unload

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)


def test_nf4_load_reports_requested_and_active(tiny):
    folder, _ = tiny("LlamaConfig", **TINY)
    model, tok, report = load_model(str(folder))
    assert tok is None and any("no tokenizer" in n for n in report.notes)
    a = report.active
    assert a["quant"] == "nf4" and a["double_quant"] is True
    assert a["compute_dtype"] == "bfloat16" and a["dtype"] == "bfloat16"
    assert a["attn"] == "sdpa" and a["device"] == "cpu" and a["offloaded_modules"] == []
    assert report.kernel.kind == "sdpa_cpu_flash" and report.kernel.flash_class
    assert report.requested["quant"] == "nf4" and report.overrides == []
    assert any("flash_attn package is not installed" in n or "compute capability" in n for n in report.notes)
    out = model(input_ids=__import__("torch").tensor([[1, 2, 3]]))
    assert out.logits.shape == (1, 3, 1000)


def test_fa2_that_cannot_run_is_replaced_and_reported_or_refused(tiny):
    folder, _ = tiny("LlamaConfig", **TINY)
    with pytest.warns(UserWarning, match="attn: flash_attention_2 -> sdpa"):
        _, _, report = load_model(str(folder), attn="flash_attention_2", verify=False)
    assert report.active["attn"] == "sdpa"
    assert report.overrides and "flash_attn package is not installed" in report.overrides[0]
    with pytest.raises(InvalidValue) as e:
        load_model(str(folder), attn="flash_attention_2", strict=True)
    assert "attn" in str(e.value)


def test_eager_is_kept_when_asked_and_verified(tiny):
    folder, _ = tiny("LlamaConfig", **TINY)
    _, _, report = load_model(str(folder), quant="bf16", attn="eager")
    assert report.active["attn"] == "eager" and report.kernel.kind == "eager_softmax"
    assert report.active["quant"] == "none" and report.active["dtype"] == "bfloat16"


def test_safetensors_only_and_no_weights(tiny, tmp_path):
    import shutil

    import torch
    folder, model = tiny("LlamaConfig", **TINY)
    pkl = tmp_path / "pickle"
    pkl.mkdir()
    shutil.copy(folder / "config.json", pkl / "config.json")
    torch.save(model.state_dict(), pkl / "pytorch_model.bin")
    with pytest.raises(InvalidValue) as e:
        load_model(str(pkl))
    assert "allow_pickle" in str(e.value)
    with pytest.raises(UnknownModel):
        load_model("llama-2-7b")  # a catalog name has no weights


def test_c17_unload_frees_every_tensor(tiny):
    """C17: after unload, no parameter of the quantized model is alive (cycles broken by gc.collect())."""
    folder, _ = tiny("LlamaConfig", **TINY)
    loaded = load_model(str(folder), verify=False)
    refs = [weakref.ref(p) for p in loaded.model.parameters()]
    qstates = [weakref.ref(p.quant_state.absmax) for p in loaded.model.parameters()
               if getattr(p, "quant_state", None) is not None]
    assert qstates
    rep = unload(loaded)
    del loaded
    gc.collect()
    assert all(r() is None for r in refs + qstates)
    assert rep.residual_bytes is None  # no CUDA here: nothing to measure


def test_c17_the_unload_report_names_a_residual_and_its_holders():
    """C17: what check and profile print after unloading: memory back within 1% of the weights, or the residual
    with the tensors that still hold it."""
    from vramguard.runtime.load import UnloadReport
    weights = 5_707_474_944
    back = UnloadReport(weights, 33_555_456, ("(917504,) torch.uint8 917,504 B",))
    assert back.returned(weights) is True
    assert back.describe(weights) == ("33,555,456 B above the allocated memory before loading (0.59% of the "
                                      "5,707,474,944 B of weights)")
    held = UnloadReport(weights - 144_770_048, 144_770_048, ("(4096, 4096) torch.bfloat16 33,554,432 B",))
    assert held.returned(weights) is False
    assert held.describe(weights).endswith("(2.54% of the 5,707,474,944 B of weights); still held by: "
                                           "(4096, 4096) torch.bfloat16 33,554,432 B")
    assert UnloadReport(None, None, ()).returned(weights) is None
    below = UnloadReport(weights + 1_048_576, -1_048_576, ())  # a tensor from before the load freed meanwhile
    assert below.returned(weights) is True
    assert below.describe(weights) == "all returned: 1,048,576 B below the allocated memory before loading"


def test_compute_dtype_follows_an_explicit_dtype_c3():
    """Field case C3: a 4-bit model given only a dtype computes in that dtype, never a silent bf16 mismatch."""
    from vramguard.runtime.load import LoadReport, choose_dtypes
    r = LoadReport("m", {})
    assert choose_dtypes(None, "nf4", None, "fp16", r, False) == ("fp16", "fp16")
    assert choose_dtypes(None, "nf4", None, "fp32", r, False) == ("fp32", "fp32")
    assert choose_dtypes(None, "nf4", None, None, r, False) == ("bf16", "bf16")
    assert choose_dtypes(None, "nf4", "fp16", "fp32", r, False) == ("fp16", "fp32")  # both explicit: as asked
    assert r.overrides == []


def test_nf4_without_bitsandbytes_is_refused_before_loading(tiny, monkeypatch):
    """Without bitsandbytes, transformers' loader fails on an NF4 request with a bare ImportError (the CLI printed it
    as an internal error, exit 70): load_model refuses it first, naming quant and the install, and the CLI words it
    with its option."""
    import importlib.util

    from conftest import run_cli, save_word_tokenizer
    from vramguard.errors import ConfigError
    folder, _ = tiny("LlamaConfig", **TINY)
    save_word_tokenizer(folder, TINY["vocab_size"])
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a))
    with pytest.raises(ConfigError) as e:
        load_model(str(folder), quant="nf4", verify=False)
    assert e.value.field == "quant" and e.value.value == "nf4" and "vramguard[gpu]" in e.value.fix
    r = run_cli("run", str(folder), "--prompt", "hi", "--max-new-tokens", "2", "--quant", "nf4")
    assert r.returncode == 3, r.stdout + r.stderr
    assert "--quant: 'nf4' is not valid" in r.stdout + r.stderr and "internal error" not in r.stdout + r.stderr


def test_bitsandbytes_and_hqq_are_imported_without_dynamo_and_nf4_still_computes():
    """Once vramguard is imported, bitsandbytes and hqq (which transformers' ``cache_utils`` imports when it is
    installed) are imported with their import-time ``torch.compile`` calls deferred to the first call
    (``vramguard.extras.defer_import_time_compiles``): neither TorchDynamo nor Inductor is loaded by them and
    ``torch.compile`` is PyTorch's own again; bitsandbytes' CPU NF4 round trip (its compiled PyTorch kernels, now
    compiled at that call) rounds to the NF4 code: every element within its block's absmax x half the widest gap
    of the code table, between -1 and -0.6962: 0.1519."""
    import subprocess
    import sys
    probe = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "import vramguard\n"
        "from vramguard.extras import import_bitsandbytes\n"
        "import_bitsandbytes()\n"
        "import transformers.cache_utils\n"
        "print('hqq' if 'hqq.core.quantize' in sys.modules else 'no hqq',\n"
        "      'dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo',\n"
        "      'inductor' if 'torch._inductor.compile_fx' in sys.modules else 'no inductor',\n"
        "      'restored' if torch.compile is real else 'replaced')\n"
        "import bitsandbytes.functional as F\n"
        "torch.manual_seed(0)\n"
        "w = torch.randn(64, 128)\n"
        "q, st = F.quantize_4bit(w, blocksize=64, quant_type='nf4')\n"
        "err = (F.dequantize_4bit(q, st) - w).abs().reshape(-1, 64).amax(1) / st.absmax\n"
        "print(f'{err.max().item():.4f}')\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    head, err = out.stdout.strip().splitlines()[-2:]
    pytest.importorskip("hqq")  # the test extra installs it: transformers then imports it with its caches
    assert head == "hqq no dynamo no inductor restored"
    assert 0.1 < float(err) <= 0.152  # nearest of 16 NF4 values: (1 - 0.6962) / 2 = 0.1519


def test_a_deferred_module_calls_torch_compile_at_the_first_call_once_and_others_are_left_alone(
        tmp_path, monkeypatch):
    """:func:`vramguard.extras.defer_import_time_compiles`: a listed module's ``torch.compile(fn, **options)`` and
    ``@torch.compile(...)`` reach PyTorch at the first call of the function, once, with the same options; a module
    not listed calls it as it is imported."""
    import importlib
    import sys

    import torch

    from vramguard import extras
    calls = []

    def fake_compile(model=None, **options):
        if model is None:
            return lambda fn: fake_compile(fn, **options)
        calls.append((model.__name__, options))
        return model
    monkeypatch.setattr(torch, "compile", fake_compile)
    body = ("import torch\n"
            "def double(x):\n    return 2 * x\n"
            "compiled = torch.compile(double, dynamic=False)\n"
            "@torch.compile()\ndef triple(x):\n    return 3 * x\n")
    for name in ("vg_deferred_probe", "vg_plain_probe"):
        (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(extras, "DEFERRED_COMPILE_MODULES", extras.DEFERRED_COMPILE_MODULES | {"vg_deferred_probe"})
    extras.defer_import_time_compiles()
    try:
        deferred = importlib.import_module("vg_deferred_probe")
        assert calls == [] and torch.compile is fake_compile
        assert (deferred.compiled(4), deferred.compiled(5), deferred.triple(2)) == (8, 10, 6)
        assert calls == [("double", {"dynamic": False}), ("triple", {})]
        importlib.import_module("vg_plain_probe")
        assert calls[2:] == [("double", {"dynamic": False}), ("triple", {})]
    finally:
        sys.modules.pop("vg_deferred_probe", None)
        sys.modules.pop("vg_plain_probe", None)
