"""The first hour, round three: the plan says when the model's context, not memory, caps the largest prompt and
new tokens; an unknown model id gets a stand-in of its family and size, or none; long commands show a progress
line on a terminal."""

import io
import json
import re
import sys
import time

import pytest

from conftest import run_cli
from vramguard.plan import plan
from vramguard.plan.limits import bound_by
from vramguard.resolve import resolve_model
from vramguard.settings import Settings

pytestmark = pytest.mark.usefixtures("shared_plans")  # the same plans asked for again and again: each computed once


def test_bound_by_compares_with_the_context_less_the_other_part():
    spec = resolve_model("llama-2-7b")  # max_position_embeddings 4,096
    s = Settings(prompt_tokens=1024, max_new_tokens=512)
    # prompt cap 4,096 - 512 = 3,584; new-token cap 4,096 - 1,024 = 3,072
    assert bound_by(spec, s, 3584, 3072) == {"max_prompt_tokens": "context", "max_new_tokens": "context"}
    assert bound_by(spec, s, 3583, 3071) == {"max_prompt_tokens": "memory", "max_new_tokens": "memory"}
    assert bound_by(spec, s, None, None) == {"max_prompt_tokens": None, "max_new_tokens": None}


def test_plan_json_and_table_say_the_context_caps_on_a_large_card():
    # llama-2-7b NF4 on an H200: memory holds far more than its 4,096-token context, so both are capped by it
    p = plan("llama-2-7b", Settings(quant="nf4", prompt_tokens=1024, max_new_tokens=512), gpu="h200",
             alloc_conf=None)
    v = p.cards[0]
    assert (v.max_prompt_tokens, v.max_new_tokens) == (3584, 3072)
    r = run_cli("plan", "llama-2-7b", "--gpu", "h200", "--prompt-tokens", "1024", "--max-new-tokens", "512",
                "--format", "json")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)["cards"][0]
    assert card["bound_by"] == {"max_prompt_tokens": "context", "max_new_tokens": "context"}
    t = run_cli("plan", "llama-2-7b", "--gpu", "h200", "--prompt-tokens", "1024", "--max-new-tokens", "512",
                columns="80")
    assert "3,584*" in t.stdout and "3,072*" in t.stdout
    assert "*: capped by the model's context, max_position_embeddings 4,096 (prompt + new tokens), not by memory" \
        in " ".join(t.stdout.split())
    # a context the user set is named as theirs, not as the model's
    t = run_cli("plan", "llama-2-7b", "--gpu", "h200", "--context", "2048", "--prompt-tokens", "1024",
                "--max-new-tokens", "512", columns="80")
    assert "*: capped by the context you set, 2,048 tokens (prompt + new tokens), not by memory" \
        in " ".join(t.stdout.split())
    n = run_cli("plan", "llama-2-7b", "--gpu", "h200", "--context", "300", columns="300")
    assert "the default --prompt-tokens 128 + --max-new-tokens 256 exceed the --context 300 you set" in n.stderr
    e = run_cli("plan", "llama-2-7b", "--gpu", "h200", "--context", "1000", "--prompt-tokens", "1024")
    said = " ".join(e.stderr.split())
    assert e.returncode == 2 and "accepted: at most the context you set, 1,000 tokens" in said
    assert said.startswith("error --prompt-tokens + --max-new-tokens: '1,024 + 256 = 1,280'")
    assert "or a larger context" in said and "max_position_embeddings" not in said


def test_plan_json_says_memory_caps_on_a_small_card():
    r = run_cli("plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--prompt-tokens", "4096", "--format", "json")
    assert r.returncode == 0, r.stderr
    card = json.loads(r.stdout)["cards"][0]
    # 131,072-token context; a 24 GiB card holds a prompt of tens of thousands of tokens with NF4, not 130,944
    assert card["max_prompt_tokens"] < 131072 - 128
    assert card["bound_by"] == {"max_prompt_tokens": "memory", "max_new_tokens": "memory"}
    t = run_cli("plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--prompt-tokens", "4096", columns="80")
    assert "capped by the model's context" not in t.stdout


def test_multi_card_plan_says_the_context_caps_its_largest_prompt():
    args = ("plan", "llama-2-7b", "--gpu", "h200,h200", "--prompt-tokens", "1024", "--max-new-tokens", "512")
    j = json.loads(run_cli(*args, "--format", "json").stdout)
    assert j["max_prompt_tokens"] == 4096 - 512 and j["bound_by"] == {"max_prompt_tokens": "context"}
    assert ("3,584 tokens (capped by the model's context, max_position_embeddings 4,096, not by memory)"
            in " ".join(run_cli(*args).stdout.split()))


# Suggestions for a model id the Hub cannot give: by family, generation and size, or none


def test_gemma_3_12b_is_pointed_to_the_nearest_gemma_by_size():
    from vramguard.resolve import _catalog_hint, closest_catalog_name
    # the catalog holds gemma-2-2b and gemma-2-9b: 9B is the nearest to 12B (ratio 1.33), 2B is 6x smaller
    assert closest_catalog_name("google/gemma-3-12b-it") == "gemma-2-9b"
    assert _catalog_hint("google/gemma-3-12b-it") == (
        "gemma-2-9b is the nearest of the gemma family in the catalog (generation 2, not 3; 9B parameters, not "
        "12B): a stand-in only, check its shapes against your model's")
    # a gemma3 entry in the catalog is preferred, at the nearest size
    names = ["gemma-2-2b", "gemma-2-9b", "gemma-3-4b", "gemma-3-12b", "gemma-3-27b"]
    assert closest_catalog_name("google/gemma-3-12b-it", names) == "gemma-3-12b"
    assert closest_catalog_name("google/gemma-3-14b-it", names) == "gemma-3-12b"
    # 27B is 3x the largest gemma-2 (9B): no stand-in rather than a misleading one
    assert closest_catalog_name("google/gemma-3-27b-it") is None


def test_qwen3_8b_is_qwen3_when_the_catalog_has_it_else_the_nearest_generation():
    from vramguard.resolve import _catalog_hint, closest_catalog_name
    assert closest_catalog_name("Qwen/Qwen3-8B", ["qwen2-7b", "qwen2.5-7b", "qwen3-4b", "qwen3-8b"]) == "qwen3-8b"
    # without qwen3: qwen2.5 (generation 2.5) is nearer than qwen2, and 7B the nearest size, never 0.5B or 3B
    assert closest_catalog_name("Qwen/Qwen3-8B") == "qwen2.5-7b"
    assert "generation 2.5, not 3; 7B parameters, not 8B" in _catalog_hint("Qwen/Qwen3-8B")


def test_gpt_oss_20b_has_no_stand_in_unless_the_catalog_has_a_gpt_oss():
    from vramguard.resolve import _catalog_hint, closest_catalog_name
    assert closest_catalog_name("openai/gpt-oss-20b") is None and _catalog_hint("openai/gpt-oss-20b") is None
    assert closest_catalog_name("openai/gpt-oss-20b", ["llama-3.1-8b", "gpt-oss-20b"]) == "gpt-oss-20b"
    assert closest_catalog_name("openai/gpt-oss-20b", ["llama-3.1-8b", "gpt-oss-120b"]) is None  # 6x larger


def test_name_parts_reads_family_generation_and_size():
    from vramguard.resolve import NameParts, name_parts
    assert name_parts("google/gemma-3-12b-it") == NameParts("gemma", 3.0, 12.0)
    assert name_parts("Qwen/Qwen2.5-0.5B-Instruct") == NameParts("qwen", 2.5, 0.5)
    assert name_parts("meta-llama/Meta-Llama-3-8B") == NameParts("llama", 3.0, 8.0)
    assert name_parts("mistralai/Mixtral-8x7B-v0.1") == NameParts("mixtral", None, 56.0)
    assert name_parts("openai/gpt-oss-20b") == NameParts("gpt", None, 20.0)
    assert name_parts("microsoft/Phi-3-mini-4k-instruct") == NameParts("phi", 3.0, None)
    assert name_parts("someone/3b-model") is None


def test_an_offline_unknown_id_names_the_stand_in_in_the_error():
    from vramguard.errors import UnknownModel
    with pytest.raises(UnknownModel) as e:
        resolve_model("nobody-here/gemma-3-12b-it")
    assert "gemma-2-9b is the nearest of the gemma family" in e.value.fix and "gemma-2-2b" not in e.value.fix


# A progress line on stderr for long commands, on a terminal only


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_progress_line_shows_after_its_delay_on_a_terminal_and_is_removed(monkeypatch):
    from vramguard.cli.common import working
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with working("planning llama-3.1-8b", delay_s=0.05):
        deadline = time.time() + 30  # the work outlasts the delay: wait for the line, however busy the machine
        while "planning" not in sys.stderr.getvalue() and time.time() < deadline:
            time.sleep(0.01)
    out = sys.stderr.getvalue()
    assert "planning llama-3.1-8b" in out and out.endswith("\x1b[2K")  # rich's transient line, erased at the end


def test_no_progress_line_for_quick_work_or_off_a_terminal(monkeypatch):
    from vramguard.cli.common import working
    monkeypatch.setattr(sys, "stderr", _Terminal())
    with working("planning x", delay_s=30):
        pass  # ends long before the delay: the timer is cancelled, nothing is written
    assert sys.stderr.getvalue() == ""
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # a pipe or a log
    with working("planning x", delay_s=0):
        time.sleep(0.2)
    assert sys.stderr.getvalue() == ""


def test_a_piped_plan_prints_no_progress_line():
    r = run_cli("plan", "llama-3.1-8b", "--gpu", "rtx-4090")
    assert r.returncode == 0 and "planning llama-3.1-8b" not in r.stderr and "\x1b[" not in r.stderr


@pytest.mark.parametrize("verb", ["plan", "check", "export"])
def test_gpu_help_says_it_takes_the_names_nvidia_smi_prints(verb):
    r = run_cli(verb, "--help", columns="200")
    block = " ".join(re.split(r"\n\s+--gpu ", r.stdout)[1].split())[:200]  # the option's own help
    assert r.returncode == 0 and "the name nvidia-smi prints" in block, block
