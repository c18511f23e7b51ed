"""check: every detector's branches through hand-built environments, and field cases C1, C2, C3, C11, C13."""

import pytest

from vramguard.catalog.gpus import GPUS, GpuSpec
from vramguard.check import check
from vramguard.cli.flags import as_flags
from vramguard.probe.checkpoint import read_checkpoint, resolve_param_dtype
from vramguard.probe.env import Env, probe_env
from vramguard.settings import Settings
from vramguard.units import GiB

GPU_ENV = dict(torch_version="2.11.0", cuda_available=True, cuda_runtime="13.0", cuda_reason="CUDA device",
               driver_version="580.1", transformers_version="5.17.0", accelerate_version="1.15.0",
               bnb_version="0.50.2", bnb_backend="CUDA", bnb_native_ok=True, bnb_reason="native library: Cuda",
               flash_attn_version=None, flash_attn_reason="ModuleNotFoundError: No module named 'flash_attn'",
               sdpa_backends={"flash": True, "efficient": True, "math": True, "cudnn": True},
               ram_available_bytes=64 * 10**9, ram_total_bytes=128 * 10**9)


def env(**kw) -> Env:
    return Env(**{**GPU_ENV, **kw})


def by_name(report, name):
    return [f for f in report.findings if f.code == name]


def test_c1_fa2_and_bf16_on_turing():
    """C1: Mistral-7B, NF4 + double quant, compute bf16, FA2, 1024 new tokens, a 16 GB Turing card (7.5)."""
    s = Settings(quant="nf4", attn="flash_attention_2", max_new_tokens=1024)
    r = check("mistral-7b-v0.3", s, compute_dtype="bf16", dtype="bf16", gpu="t4",
              env=env(flash_attn_version="2.6.3", gpus=()), verify=False)
    fa2 = by_name(r, "flash_attention_2")
    assert [f.level for f in fa2] == ["fail"]
    assert "needs compute capability >= 8.0" in fa2[0].message and "7.5" in fa2[0].message
    assert "sdpa" in fa2[0].fix
    bf16 = by_name(r, "bf16")[0]
    assert bf16.level == "warn" and "float16" in bf16.fix
    cd = by_name(r, "compute_dtype")[0]  # never "ok" beside the bf16 warning
    assert cd.level == "warn" and "bnb_4bit_compute_dtype=torch.float16" in cd.fix
    assert r.failed
    # the second report: bf16 model (no quantization) with FA2 on a T4
    r2 = check("mistral-7b-v0.3", Settings(attn="flash_attention_2"), dtype="bf16", gpu="t4",
               env=env(flash_attn_version="2.6.3"), verify=False, unquantized=True)
    assert by_name(r2, "flash_attention_2")[0].level == "fail" and by_name(r2, "bf16")[0].level == "warn"


def test_c1_loader_never_picks_fa2_or_bf16_on_turing():
    from vramguard.runtime.load import LoadReport, choose_attn, choose_dtypes
    t4 = GPUS["t4"]
    rep = LoadReport("m", {})
    assert choose_dtypes(t4, "nf4", None, None, rep, False) == ("fp16", "fp16")
    assert choose_attn("auto", env(flash_attn_version="2.6.3"), t4, "fp16", 128, rep, False) == "sdpa"
    # an explicit bf16 request on the T4 is replaced, and the replacement reported, never silent
    with pytest.warns(UserWarning):
        assert choose_dtypes(t4, "nf4", "bf16", None, rep, False)[0] == "fp16"
    assert any("compute_dtype: bf16 -> fp16" in o for o in rep.overrides)
    with pytest.raises(Exception) as e:
        choose_dtypes(t4, "nf4", "bf16", None, LoadReport("m", {}), True)
    assert "compute_dtype" in str(e.value)
    # the second report: bf16 weights (quant="bf16") on the T4 load as fp16, reported; the dtype load_model
    # passes to from_pretrained follows (resolve_param_dtype takes a 16/32-bit quant as the parameters' dtype)
    from vramguard.probe.checkpoint import resolve_param_dtype
    from vramguard.runtime.load import older_card_quant
    rep2 = LoadReport("m", {})
    with pytest.warns(UserWarning, match="compute capability 7.5"):
        q = older_card_quant(t4, "bf16", rep2, False)
    assert q == "fp16" and resolve_param_dtype("bf16", None, "5.24.0", q)[0] == "fp16"
    assert rep2.overrides == ["quant: bf16 -> fp16 (bfloat16 is not native on compute capability 7.5 (t4); "
                              "float16 is)"]
    assert older_card_quant(t4, "nf4", rep2, False) == "nf4"
    assert older_card_quant(GPUS["a100-80gb"], "bf16", rep2, False) == "bf16"
    with pytest.raises(Exception) as e:
        older_card_quant(t4, "bf16", LoadReport("m", {}), True)
    assert "quant" in str(e.value) and "7.5" in str(e.value)
    # on an Ampere card with flash_attn installed, auto picks FA2 and bf16
    assert choose_attn("auto", env(flash_attn_version="2.6.3"), GPUS["a100-80gb"], "bf16", 128, rep, False) \
        == "flash_attention_2"
    assert choose_dtypes(GPUS["a100-80gb"], "nf4", None, None, rep, False) == ("bf16", "bf16")


def test_c2_fa2_with_parameters_resolving_to_float32():
    """C2: FA2, no dtype passed, on a stack where the parameters end up float32 (transformers 4.x default),
    Mixtral-8x7B: the cost is 46.7e9 x 4 = 186.8 GB against 93.4 GB in bf16."""
    r = check("mixtral-8x7b", Settings(attn="flash_attention_2"), gpu="a100-80gb",
              env=env(transformers_version="4.44.0", flash_attn_version="2.6.3"), verify=False, unquantized=True)
    assert r.param_dtype == "fp32"
    fa2 = by_name(r, "flash_attention_2")[0]
    assert fa2.level == "fail" and fa2.value == "dtype float32" and "float16/bfloat16" in fa2.message
    pd = by_name(r, "param_dtype")[0]
    assert pd.level == "warn" and "186.8 GB in float32 against 93.4 GB in bfloat16" in pd.message
    # transformers 5: no dtype means "auto", the config's bfloat16: no failure from the dtype
    r5 = check("mixtral-8x7b", Settings(attn="flash_attention_2"), gpu="a100-80gb",
               env=env(transformers_version="5.17.0", flash_attn_version="2.6.3"), verify=False, unquantized=True)
    assert r5.param_dtype == "bf16" and not [f for f in by_name(r5, "flash_attention_2") if f.level == "fail"]


def test_c2_a_float32_checkpoint_loaded_as_stored_is_flagged_with_its_cost(tmp_path):
    """C2: a checkpoint stored in float32, no dtype passed: transformers 5 loads it as stored ("auto"), twice the
    memory of bf16 weights: a warning with the cost and the fix; passing --dtype fp32 on purpose is not flagged."""
    import transformers
    folder = tmp_path / "fp32-llama"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=1000)).save_pretrained(folder)  # float32, as constructed
    r = check(str(folder), Settings(attn="sdpa"), gpu="rtx-4090", env=env(transformers_version="5.24.0"),
              verify=False, unquantized=True)
    assert r.param_dtype == "fp32"
    pd = by_name(r, "param_dtype")[0]
    assert pd.level == "warn" and pd.value == "float32 (checkpoint stores fp32)"
    import re
    m = re.search(r"weights ([\d,]+) B in float32 against ([\d,]+) B in bfloat16", pd.message)
    f32, b16 = (int(x.replace(",", "")) for x in m.groups())
    assert "twice the memory of 16-bit weights" in pd.message and f32 == 2 * b16 and b16 > 0
    assert "dtype=torch.bfloat16" in pd.fix
    on_purpose = check(str(folder), Settings(attn="sdpa"), dtype="fp32", gpu="rtx-4090",
                       env=env(transformers_version="5.24.0"), verify=False, unquantized=True)
    assert by_name(on_purpose, "param_dtype")[0].level == "ok"
    as_stored = check(str(folder), Settings(attn="sdpa"), dtype="auto", gpu="rtx-4090",
                      env=env(transformers_version="5.24.0"), verify=False, unquantized=True)
    assert by_name(as_stored, "param_dtype")[0].level == "warn"  # "auto" is "as stored", not a choice of fp32
    # a folder vramguard loads itself with quant=fp32: the fix is the setting that loads it in 16 bits
    by_quant = check(str(folder), Settings(attn="sdpa", quant="fp32"), gpu="rtx-4090",
                     env=env(transformers_version="5.24.0"), verify=False)
    fix = by_name(by_quant, "param_dtype")[0].fix
    assert fix.startswith("pass quant=bf16") and "torch." not in fix
    assert as_flags(fix) == "pass --quant bf16 (--quant fp16 below compute capability 8.0)"
    # the same format as vramguard's own choice without a CUDA device (none given): said, not warned about
    own = check(str(folder), Settings(attn="sdpa"), env=env(transformers_version="5.24.0", cuda_available=False,
                                                            gpus=()), verify=False, quant_unset=True)
    assert by_name(own, "quant")[0].value == "fp32 (none given)"
    pd = by_name(own, "param_dtype")[0]
    assert pd.level == "info" and "vramguard loads without a CUDA device" in pd.message


def test_c3_compute_dtype_left_at_float32():
    """C3: 4-bit, bf16 activations, batch 32, 512 new tokens, bnb_4bit_compute_dtype unset (float32)."""
    s = Settings(quant="nf4", batch=32, prompt_tokens=256, max_new_tokens=512)
    r = check("mistral-7b-v0.3", s, dtype="bf16", gpu="rtx-4090", env=env(), verify=False)
    f = by_name(r, "compute_dtype")[0]
    assert f.level == "warn" and f.value == "bnb_4bit_compute_dtype fp32, activations bf16"
    assert "224.00 MiB against 112.00 MiB" in f.message
    assert f.fix.endswith("bfloat16")
    # below compute capability 8.0 the fix is float16
    r16 = check("mistral-7b-v0.3", s, dtype="fp16", gpu="t4", env=env(), verify=False)
    assert by_name(r16, "compute_dtype")[0].fix.endswith("float16")


def test_c11_largest_shard_against_free_ram(tmp_path):
    """C11: 12.7 GB of RAM: a single 14.10 GB shard will be killed; 9.95 GB + 4.48 GB shards pass."""
    import json
    import struct
    from vramguard.catalog.models import MODELS
    cfg = {k: v for k, v in MODELS["mistral-7b-v0.3"].items() if k != "source"}
    big, split = tmp_path / "single", tmp_path / "split"
    for folder, shards in ((big, [14_100_000_000]), (split, [9_950_000_000, 4_480_000_000])):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        for i, size in enumerate(shards):
            with open(folder / f"model-{i:05d}.safetensors", "wb") as f:
                # a valid header (one U8 tensor covering the rest), then sparse data: the size is what matters
                header = json.dumps({"w": {"dtype": "U8", "shape": [size - 8 - 256], "data_offsets": [0, size - 264]}})
                f.write(struct.pack("<Q", 256) + header.ljust(256).encode())
                f.truncate(size)
    e = env(ram_available_bytes=12_700_000_000)
    f = by_name(check(str(big), Settings(), env=e, verify=False, device_map="auto"), "ram_vs_shard")[0]
    # in the project's binary units, as every size: 14.1e9 / 2**30 = 13.13 GiB, 12.7e9 / 2**30 = 11.83 GiB
    assert f.level == "fail" and "13.13 GiB > 11.83 GiB free RAM" in f.value and "Killed" in f.message
    assert "max_shard_size" in f.fix
    ok = by_name(check(str(split), Settings(), env=e, verify=False), "ram_vs_shard")[0]
    assert ok.level == "ok" and ok.value == "largest shard model-00000.safetensors is 9.27 GiB, 11.83 GiB free RAM"
    assert " GB" not in f.value + ok.value  # 9.95e9 / 2**30 = 9.27


def test_c13_output_attentions_forces_eager():
    s = Settings(quant="bf16", prompt_tokens=2048, max_new_tokens=1, output_attentions=True)
    r = check("llama-3-70b", s, gpu="h100-80gb", env=env(), verify=False)
    f = by_name(r, "eager_forced")[0]
    assert f.level == "warn" and "512.00 MiB per layer" in f.message and "40.00 GiB over 80 layers" in f.message


def test_environment_branches():
    base = Settings(quant="nf4")
    assert by_name(check(None, base, env=env(torch_version=None, torch_reason="No module named 'torch'")),
                   "torch")[0].level == "fail"
    assert by_name(check(None, base, env=env(bnb_version=None)), "bitsandbytes")[0].level == "fail"
    broken = env(bnb_native_ok=False, bnb_reason="libbitsandbytes_cuda130.so: cannot open shared object")
    f = by_name(check(None, base, env=broken), "bitsandbytes")[0]
    assert f.level == "fail" and "cannot open" in f.message
    math_only = env(sdpa_backends={"flash": False, "efficient": False, "math": True, "cudnn": False})
    assert by_name(check(None, Settings(attn="sdpa"), env=math_only), "sdpa_backends")[0].level == "warn"
    conf = env(alloc_conf="expandable_segments:True")
    assert by_name(check(None, base, env=conf), "PYTORCH_CUDA_ALLOC_CONF")[0].level == "ok"
    busy = GpuSpec("rtx-3090", "NVIDIA GeForce RTX 3090", 24 * GiB, (8, 6), None, 6 * GiB, "detected")
    r = check(None, base, env=env(gpus=(busy,)))
    assert by_name(r, "other_processes")[0].level == "warn" and "6.00 GiB" in by_name(r, "other_processes")[0].value
    nogpu = check(None, base, env=env(cuda_available=False, cuda_reason="torch was built without CUDA"))
    assert by_name(nogpu, "cuda")[0].level == "warn" and "--gpu" in as_flags(by_name(nogpu, "cuda")[0].fix)
    assert not nogpu.failed
    # a catalog card's free memory was never measured: its total alone (T4: 15,843,721,216 B = 14.76 GiB)
    named = by_name(check(None, base, gpu="t4", env=env(cuda_available=False, gpus=())), "gpu")[0]
    assert named.value == "NVIDIA T4, compute capability 7.5, 14.76 GiB total (catalog card, not measured)"
    # a detected card's is: 24 - 6 GiB held by others = 18 GiB
    assert by_name(r, "gpu")[0].value == "NVIDIA GeForce RTX 3090, compute capability 8.6, 24.00 GiB total, " \
        "18.00 GiB free"


def test_device_map_auto_offloads_although_the_plan_fits():
    """device_map='auto' keeps ~10% back: a bf16 7B on a 13.6 GiB card fits the plan but goes partly to CPU."""
    card = GpuSpec("small", "a 13.6 GiB card", int(13.6 * GiB), (8, 9), None, 0, "detected")
    s = Settings(quant="bf16", prompt_tokens=64, max_new_tokens=16)
    r = check("llama-2-7b", s, env=env(gpus=(card,)), device_map="auto", verify=False)
    assert by_name(r, "plan")[0].level == "ok"
    f = by_name(r, "device_map")[0]
    assert f.level == "warn" and "off the GPU" in f.value and "device_map={'': 0}" in f.fix
    roomy = GpuSpec("big", "a 40 GiB card", 40 * GiB, (8, 0), None, 0, "detected")
    assert by_name(check("llama-2-7b", s, env=env(gpus=(roomy,)), device_map="auto", verify=False),
                   "device_map")[0].level == "ok"


def test_param_dtype_resolution_rules(tiny):
    folder, _ = tiny("LlamaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, vocab_size=300, max_position_embeddings=128, dtype="bfloat16")
    ck = read_checkpoint(folder)
    assert ck.format == "safetensors" and ck.stored_dtype == "bf16"
    assert resolve_param_dtype(None, ck, "5.17.0", "nf4")[0] == "bf16"
    assert resolve_param_dtype(None, ck, "4.44.0", "nf4")[0] == "fp32"
    assert resolve_param_dtype("fp16", ck, "4.44.0", "nf4")[0] == "fp16"
    assert resolve_param_dtype("auto", ck, "4.44.0", "nf4")[0] == "bf16"
    assert resolve_param_dtype(None, ck, "5.17.0", "fp32")[0] == "fp32"


def test_probe_env_on_this_machine_never_raises():
    e = probe_env()
    assert e.torch_version and e.ram_total_bytes and isinstance(e.sdpa_backends, dict)


def test_check_with_nothing_given_checks_what_vramguard_loads():
    """check MODEL then run: the check covers the settings run will use (bf16 compute where supported, fp16
    below compute capability 8.0), not bitsandbytes' bare float32 default, which --transformers-defaults keeps."""
    s = Settings(quant="nf4")
    r = check("mistral-7b-v0.3", s, gpu="rtx-4090", env=env(), verify=False, loader_defaults=True)
    f = by_name(r, "compute_dtype")[0]
    assert f.level == "ok" and f.value == "bf16" and by_name(r, "param_dtype")[0].value.startswith("bf16")
    t4 = check("mistral-7b-v0.3", s, gpu="t4", env=env(), verify=False, loader_defaults=True)
    assert by_name(t4, "compute_dtype")[0].value == "fp16"
    bare = check("mistral-7b-v0.3", s, gpu="rtx-4090", env=env(), verify=False)
    assert by_name(bare, "compute_dtype")[0].level == "warn"


def test_cli_check_defaults_and_the_transformers_defaults_flag():
    from conftest import run_cli

    def run(*extra):
        return run_cli("check", "mistral-7b-v0.3", "--gpu", "rtx-4090", "--no-verify", *extra).stdout
    assert "compute_dtype: bf16" in run() and "bnb_4bit_compute_dtype fp32" not in run()
    assert "bnb_4bit_compute_dtype fp32" in run("--transformers-defaults")
