"""The first hour, round three: the plan says when the model's context, not memory, caps the largest prompt and
new tokens."""

import json

from conftest import run_cli
from vramguard.plan import plan
from vramguard.plan.limits import bound_by
from vramguard.resolve import resolve_model
from vramguard.settings import Settings


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
    assert "*: capped by the model's context (prompt + new tokens = max_position_embeddings 4,096), not by memory" \
        in " ".join(t.stdout.split())


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
