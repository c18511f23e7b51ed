"""Smaller findings of the first-hour trials: a card name that starts two names suggests the shorter; a vLLM
``--quantization`` of a checkpoint's format says why it is refused; ``check`` says which attention it checked when
none is given, as ``run`` loads it; ``explain`` fits its fixes to a training traceback; ``check``'s param_dtype label
matches its explanation; ``oom-log --since`` says it cannot filter the records it cannot date."""

import pytest

from conftest import run_cli
from test_check import env
from vramguard.check import check
from vramguard.check.rules import _param_dtype_line
from vramguard.engines.vllm import VllmSettings
from vramguard.errors import InvalidValue, UnknownGpu
from vramguard.explain import TRAINING_FIXES, explain, traceback_context
from vramguard.hardware import card_defaults, gpu_from_catalog
from vramguard.oomlog import oom_log

# (a) a prefix of two catalog names


def test_a_prefix_of_two_cards_suggests_the_shorter_name():
    with pytest.raises(UnknownGpu) as e:
        gpu_from_catalog("RTX 409")  # starts rtx-4090 (1 character left) and rtx-4090-d (2 left)
    assert e.value.accepted == "rtx-4090, rtx-4090-d"
    assert e.value.fix == "did you mean gpu=rtx-4090? Or name another of them"
    with pytest.raises(UnknownGpu) as e:
        gpu_from_catalog("rtx 40")  # four names of 7 characters start so: no one name meant, an example
    assert e.value.accepted.startswith("rtx-4060, rtx-4060-ti-16gb, rtx-4070")  # catalog order kept
    assert e.value.fix == "name one of them, e.g. gpu=rtx-4060"
    r = run_cli("plan", "llama-3.1-8b", "--gpu", "RTX 409", columns="200")
    assert r.returncode == 3 and "fix: did you mean --gpu rtx-4090? Or name another of them" in r.stderr


# (b) vLLM's --quantization of a checkpoint's format


@pytest.mark.parametrize("verb", [("plan", "llama-3.1-8b", "--engine", "vllm"),
                                  ("export", "llama-3.1-8b", "--to", "vllm")])
def test_quantization_gptq_says_why_it_is_refused_and_what_to_use(verb):
    r = run_cli(*verb, "--gpu", "h100", "--quantization", "gptq", columns="400")
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    text = " ".join(r.stderr.split())
    assert "accepted: bitsandbytes (NF4) or fp8, the formats vLLM quantizes a 16-bit checkpoint to as it loads" in text
    assert ("fix: gptq is the format of a checkpoint saved quantized, which vLLM reads from its config.json "
            "(quantization_config): leave the option unset and plan the gptq checkpoint itself") in text


def test_the_library_gives_the_same_reason_and_another_value_its_own():
    with pytest.raises(InvalidValue) as e:
        VllmSettings(quantization="awq")
    assert e.value.field == "quantization" and "awq is the format of a checkpoint saved quantized" in e.value.fix
    with pytest.raises(InvalidValue) as e:
        VllmSettings(quantization="int3")
    assert e.value.fix.startswith("leave it unset for a checkpoint saved quantized")
    assert VllmSettings(quantization="fp8").quantization == "fp8"


# (c) the attention check assumes when none is given


def _attention(report):
    (f,) = [f for f in report.findings if f.code == "attention"]
    return f


def test_check_without_attn_checks_what_run_loads_and_agrees_with_plan():
    # flash_attn installed, a card of compute capability 8.9: run loads flash_attention_2, as plan assumes
    fa2 = check(None, gpu="rtx-4090", env=env(flash_attn_version="2.7.4"), verify=False, loader_defaults=True,
                attn_unset=True)
    assert card_defaults("rtx-4090", None, None, False)[0] == "flash_attention_2"
    assert (_attention(fa2).level, _attention(fa2).value) == ("info", "flash_attention_2 (none given)")
    assert [f.level for f in fa2.findings if f.code == "flash_attention_2"] == ["ok"]  # checked, not "sdpa"
    # no flash_attn package: run loads sdpa, and the line says plan's assumption differs and why
    no_pkg = _attention(check(None, gpu="rtx-4090", env=env(), verify=False, loader_defaults=True,
                              attn_unset=True))
    assert no_pkg.value == "sdpa (none given)"
    assert no_pkg.message == ("vramguard run and serve load sdpa here: the flash_attn package is not installed; "
                              "vramguard plan assumes flash_attention_2 on this card, the loader's choice where it "
                              "is installed")
    # a card below 8.0 (plan's default there is sdpa too)
    t4 = _attention(check(None, gpu="t4", env=env(flash_attn_version="2.7.4"), verify=False, loader_defaults=True,
                          attn_unset=True))
    assert t4.value == "sdpa (none given)" and "compute capability >= 8.0" in t4.message
    assert card_defaults("t4", None, None, False)[0] == "sdpa"
    # transformers' defaults: sdpa, said so; an attention given: no such line, the one given is checked
    plain = _attention(check(None, gpu="rtx-4090", env=env(flash_attn_version="2.7.4"), verify=False,
                             attn_unset=True))
    assert plain.value == "sdpa (none given)" and "transformers' default" in plain.message
    given = check(None, gpu="rtx-4090", env=env(flash_attn_version="2.7.4"), verify=False, loader_defaults=True)
    assert not [f for f in given.findings if f.code == "attention"]


def test_check_cli_says_which_attention_it_checked():
    r = run_cli("check", "--gpu", "rtx-4090", "--no-verify", columns="200")
    out = " ".join(r.stdout.split())
    assert "INFO attention: sdpa (none given)" in out or "INFO attention: flash_attention_2 (none given)" in out
    h = " ".join(run_cli("check", "--help", columns="200").stdout.split())
    assert "attn_implementation you pass (unset: what vramguard run/serve load" in h and "[default: sdpa]" not in h


# (d) explain's fixes fit the traceback's context

_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 23.65 "
        "GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 22.44 GiB memory in use. Of "
        "the allocated memory 20.10 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch but "
        "unallocated.")
_GROWTH = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
           "23.65 GiB of which 10.00 MiB is free. Including non-PyTorch memory, this process has 23.19 GiB memory in "
           "use. Of the allocated memory 22.90 GiB is allocated by PyTorch, and 5.00 MiB is reserved by PyTorch but "
           "unallocated.")
_BACKWARD = ('Traceback (most recent call last):\n  File "train.py", line 88, in <module>\n    loss.backward()\n'
             '  File "/usr/lib/python3.11/site-packages/torch/autograd/graph.py", line 823, in _engine_run_backward\n'
             '    return Variable._execution_engine.run_backward(\n')
_GENERATE = ('Traceback (most recent call last):\n  File "chat.py", line 9, in <module>\n'
             '    out = model.generate(**inputs, max_new_tokens=512)\n'
             '  File "/usr/lib/python3.11/site-packages/transformers/generation/utils.py", line 2400, in generate\n')


def test_traceback_context_reads_the_innermost_kind():
    assert traceback_context(_BACKWARD + _OOM) == "training"
    assert traceback_context(_GENERATE + _OOM) == "generation"
    assert traceback_context(_OOM) is None
    # an evaluation that generates inside a training loop: the innermost frames are generation's
    evaluate = ('  File "/x/transformers/trainer.py", line 3000, in _inner_training_loop\n'
                '    self.evaluate()\n  File "eval.py", line 3, in evaluate\n    model.generate(ids)\n')
    assert traceback_context(evaluate + _OOM) == "generation"


def test_a_backward_pass_oom_gets_training_fixes_not_a_kv_cache():
    e = explain(_BACKWARD + _OOM)
    assert (e.kind, e.context) == ("fragmentation", "training")
    assert e.fixes[0].startswith("export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert "keep tensor shapes steady" in e.fixes[1] and e.fixes[2] == TRAINING_FIXES[0]
    assert not any("KV cache" in f or "vramguard plan" in f for f in e.fixes)
    assert "vramguard plan models generation, not training" in e.evidence[-1]
    growth = explain(_BACKWARD + _GROWTH)
    assert growth.kind == "steady_growth" and growth.fixes == list(TRAINING_FIXES)
    assert any("8-bit" in f for f in growth.fixes) and any("gradient checkpointing" in f for f in growth.fixes)
    cuda = explain(_BACKWARD + "RuntimeError: CUDA error: out of memory")
    assert cuda.kind == "cuda_error" and cuda.fixes[-2:] == list(TRAINING_FIXES[:2])
    assert not any("vram_budget" in f or "vramguard plan" in f for f in cuda.fixes)


def test_a_generation_oom_keeps_the_cache_fixes():
    e = explain(_GENERATE + _OOM)
    assert e.context == "generation" and any("static KV cache" in f for f in e.fixes)
    assert not any(f in e.fixes for f in TRAINING_FIXES)
    growth = explain(_GENERATE + _GROWTH)
    assert "quantized KV cache" in growth.fixes[0] and not any("gradient" in f for f in growth.fixes)
    bare = explain(_OOM)  # no traceback: the cache fix says when it applies
    assert bare.context is None and bare.fixes[1].startswith("when generating: use a static KV cache")


# (e) param_dtype's label matches its explanation


def test_param_dtype_label_follows_the_change_from_the_checkpoint():
    assert _param_dtype_line("bf16", "bf16", "given").level == "ok"
    assert _param_dtype_line("bf16", None, "given").level == "ok"
    narrowed = _param_dtype_line("bf16", "fp32", "none given")
    assert narrowed.level == "info" and "the float32 checkpoint is loaded in bfloat16, not its own dtype" in \
        narrowed.message
    to_half = _param_dtype_line("fp16", "bf16", "none given")
    assert to_half.level == "warn" and "overflows above 65,504" in to_half.message
    assert "dtype=torch.bfloat16" in to_half.fix


def test_check_on_a_turing_card_warns_of_a_bf16_checkpoint_in_fp16():
    r = check("llama-3.1-8b", gpu="t4", env=env(), verify=False, loader_defaults=True, attn_unset=True)
    (f,) = [f for f in r.findings if f.code == "param_dtype"]
    assert (f.level, f.value) == ("warn", "fp16 (checkpoint: bf16)")
    assert f.message.startswith("none given: vramguard run and serve pass fp16 to from_pretrained; bfloat16 is not "
                                "native on compute capability 7.5 (t4)")


# (f) oom-log --since and records without a date

_INVOKED = "python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0, oom_score_adj=0"
_KILLED = ("Out of memory: Killed process {pid} (python) total-vm:3000000kB, anon-rss:2500000kB, file-rss:1000kB, "
           "shmem-rss:0kB, UID:1000 pgtables:5000kB oom_score_adj:0")


def test_oom_log_since_says_it_cannot_filter_undated_records(tmp_path):
    raw = tmp_path / "dmesg.txt"  # a saved raw dmesg: seconds since an unknown boot
    raw.write_text(f"[12345.678901] {_INVOKED}\n[12345.679] {_KILLED.format(pid=42)}\n")
    r = oom_log(str(raw), "1h")
    assert [k.pid for k in r.kills] == [42]  # listed, not dropped
    assert r.message == (f"1 OOM kill(s) in {raw}; 1 record has no date (1 with seconds since boot only, from a "
                         "saved raw dmesg): since= cannot filter it, so it is listed")
    both = tmp_path / "both.txt"  # and one of `dmesg -t`: no time at all
    both.write_text(raw.read_text() + f"{_INVOKED}\n{_KILLED.format(pid=43)}\n")
    r = oom_log(str(both), "1h")
    assert sorted(k.pid for k in r.kills) == [42, 43]
    assert r.message.endswith("2 records have no date (1 with seconds since boot only, from a saved raw dmesg; 1 "
                              "with no time at all): since= cannot filter them, so they are listed")
    assert "no date" not in oom_log(str(both)).message  # without --since nothing is filtered, nothing to say
    cli = run_cli("oom-log", "--file", str(raw), "--since", "1h", columns="300")
    assert cli.returncode == 0 and "--since cannot filter it, so it is listed" in cli.stdout


# run's CPU default: the reason names both options in the CLI's words


def test_the_cpu_default_reason_names_both_weight_formats_as_options():
    from vramguard.cli.flags import as_flags
    from vramguard.runtime.load import default_quant
    quant, why = default_quant(on_cuda=False)
    assert quant == "fp32" and "--quant bf16 or --quant nf4 loads smaller weights" in as_flags(why)


def test_a_checkpoint_without_a_language_model_head_is_said(tmp_path):
    """A ``BertModel`` checkpoint (no LM head): the plan's memory holds, but AutoModelForCausalLM initializes the
    head anew, so the plan warns that the text would be noise; a causal-LM checkpoint and remote code get nothing."""
    import json

    from vramguard.plan import plan
    from vramguard.plan.findings import _head_findings
    cfg = {"model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 512, "architectures": ["BertModel"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    f = [f for f in plan(str(tmp_path), vram="24GiB").findings if f.code == "no_lm_head"]
    assert len(f) == 1 and f[0].level == "warn" and "BertModel" in f[0].message and "noise" in f[0].message
    for archs in (["LlamaForCausalLM"], ["GPT2LMHeadModel"], ["LlavaForConditionalGeneration"]):
        assert _head_findings({"architectures": archs}) == []
    assert _head_findings({"architectures": ["ChatGLMModel"], "auto_map": {"AutoModel": "x.Y"}}) == []
    assert _head_findings({"architectures": ["MistralForSequenceClassification"]})[0].code == "no_lm_head"
