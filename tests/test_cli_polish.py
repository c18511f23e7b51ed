"""Small CLI fixes from a user trial: the catalog listings as JSON, the refusal of a switch with --engine vllm and of
a switch given a value, one range for --max-new-tokens per path, and the note of an option not applied to cards
used together carried in the JSON too."""

import json

import pytest
from conftest import run_cli
from typer.testing import CliRunner

from vramguard.catalog.gpus import GPUS
from vramguard.catalog.models import MODELS
from vramguard.cli import app
from vramguard.settings import MAX_TOKENS

pytestmark = pytest.mark.usefixtures("shared_plans")  # the same plans asked for again and again: each computed once


def invoke(*args):
    return CliRunner().invoke(app, list(args))


def test_list_gpus_as_json_has_the_table_fields_and_bytes_as_integers():
    r = invoke("plan", "--list-gpus", "--format", "json")
    assert r.exit_code == 0, r.output
    cards = json.loads(r.stdout)
    assert [c["name"] for c in cards] == list(GPUS)
    c = next(c for c in cards if c["name"] == "rtx-4090")
    assert c["label"] == GPUS["rtx-4090"].label and c["compute_capability"] == [8, 9]
    assert c["total_bytes"] == GPUS["rtx-4090"].total_bytes and isinstance(c["total_bytes"], int)
    assert c["total_estimated"] is False


def test_list_models_as_json_names_each_model_and_its_source():
    r = invoke("plan", "--list-models", "--format", "json")
    assert r.exit_code == 0, r.output
    models = json.loads(r.stdout)
    assert models == [{"name": name, "source": cfg["source"]} for name, cfg in MODELS.items()]


def test_both_listings_as_json_are_one_document():
    r = invoke("plan", "--list-models", "--list-gpus", "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert [m["name"] for m in d["models"]] == list(MODELS) and [g["name"] for g in d["gpus"]] == list(GPUS)


def test_the_listings_stay_tables_without_json():
    r = invoke("plan", "--list-gpus")
    assert r.exit_code == 0 and r.stdout.startswith("gtx-1080-ti")


def test_freed_before_with_engine_vllm_names_the_switch_the_engine_and_both_fixes():
    r = invoke("plan", "llama-3.1-8b", "--engine", "vllm", "--freed-before")
    assert r.exit_code == 2 and r.stdout == ""
    err = " ".join(r.stderr.split())
    assert "True" not in err
    assert err.startswith("error --freed-before: '--freed-before with --engine vllm' is not valid; accepted: with "
                          "the transformers engine only")
    assert "fix: leave --freed-before out, or plan with --engine transformers" in err


def test_a_negative_switch_with_engine_vllm_is_shown_as_written():
    r = invoke("plan", "llama-3.1-8b", "--engine", "vllm", "--no-double-quant")
    assert r.exit_code == 2
    assert r.stderr.startswith("error --double-quant: '--no-double-quant with --engine vllm' is not valid")


def test_a_switch_given_a_value_is_named_as_a_switch_without_one():
    # click's own usage error: it reaches vramguard's wording through main(), so the test runs main() (run_cli)
    r = run_cli("plan", "llama-3.1-8b", "--freed-before=yes")
    assert r.returncode == 2 and r.stdout == ""
    err = " ".join(r.stderr.split())
    assert err.startswith("error --freed-before: '--freed-before=yes' is not valid; accepted: the switch alone, "
                          "without a value")
    assert "fix: write --freed-before alone, without =yes: a switch takes no value" in err


@pytest.mark.parametrize("value, accepted", [("0", "an integer >= 1."), ("-1", "an integer >= 1."),
                                             (str(MAX_TOKENS + 1), "an integer from 1 to 2,147,483,647.")])
def test_max_new_tokens_of_generate_states_its_range_from_1(value, accepted):
    """Generating (--logits last) takes 1 to MAX_TOKENS new tokens: a value below says the lower end as run does,
    one above the whole range from 1 (not Settings' range from 0, that of a forward)."""
    r = invoke("plan", "llama-3.1-8b", "--max-new-tokens", value)
    assert r.exit_code == 2
    first = " ".join(r.stderr.split("\nfix:")[0].split())  # the line as said, unwrapped
    assert first == f"error --max-new-tokens: {value} is not valid; accepted: {accepted}"


@pytest.mark.parametrize("value", ["-1", str(MAX_TOKENS + 1)])
def test_max_new_tokens_of_a_forward_states_its_range_from_0(value):
    r = invoke("plan", "llama-3.1-8b", "--logits", "all", "--max-new-tokens", value)
    assert r.exit_code == 2
    err = " ".join(r.stderr.split())
    assert "from 0 to 2,147,483,647" in err or ">= 0 and <= 2,147,483,647" in err


def test_freed_before_over_several_cards_is_a_finding_in_the_json():
    r = invoke("plan", "llama-3.1-8b", "--gpu", "rtx-4090,rtx-4090", "--freed-before", "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    f = [f for f in d["findings"] if f["code"] == "freed_before"]
    assert len(f) == 1 and "not applied" in f[0]["message"] and "several cards" in f[0]["message"]
    assert "--freed-before plans one card" in r.stderr  # and still said on stderr


def test_several_cards_without_a_one_card_option_have_no_finding():
    r = invoke("plan", "llama-3.1-8b", "--gpu", "rtx-4090,rtx-4090", "--format", "json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["findings"] == []


def test_a_16_bit_plan_names_its_weights_as_they_are_and_the_docs_count_the_cards():
    """A bf16 plan's weights row says bf16 linears (not "quantized linears, 16-bit embeddings"), its load line says
    no tensor sits beside the weights; docs/plan.md's count of catalog cards is the catalog's."""
    import re
    from pathlib import Path
    r = invoke("plan", "qwen2.5-7b", "--quant", "bf16", "--vram", "24GiB", "--alloc-conf", "formula")
    assert r.exit_code == 0, r.output
    text = " ".join(r.stdout.split())
    assert "weights (bf16 linears, embeddings, lm_head, norms)" in text and "quantized linears" not in text
    r = invoke("plan", "qwen2.5-7b", "--vram", "24GiB", "--alloc-conf", "formula")
    assert "quantized linears" in " ".join(r.stdout.split())
    docs = (Path(__file__).resolve().parents[1] / "docs" / "plan.md").read_text()
    assert int(re.search(r"card catalog \((\d+) cards\)", docs).group(1)) == len(GPUS)


def test_the_json_says_freed_before_when_the_plan_has_one_layout():
    """With expandable segments the plan has one layout: the JSON still says it planned a process that freed
    memory before (the finding's code), with null layout figures."""
    r = invoke("plan", "llama-3.2-1b", "--vram", "24GiB", "--alloc-conf", "expandable_segments:True",
               "--freed-before", "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    est = d.get("estimate", d)
    assert est["freed_before"] is True and est["freed_layout_reserved_bytes"] is None
    assert any(f["code"] == "freed_before" for f in d["findings"])
    r = invoke("plan", "llama-3.2-1b", "--vram", "24GiB", "--alloc-conf", "expandable_segments:True",
               "--format", "json")
    d = json.loads(r.stdout)
    assert d.get("estimate", d)["freed_before"] is False


def test_the_plan_header_names_latent_attention_by_its_own_sizes(tmp_path):
    """DeepSeek-V2's MLA: ``head_dim`` (the rope part, 64) and ``num_key_value_heads`` are not what it caches; the
    header names the latent's rank and the key and value head sizes instead; other models keep heads / KV heads."""
    import json

    from vramguard.cli.render import heads_text
    from vramguard.resolve import resolve_model
    cfg = {"model_type": "deepseek_v2", "hidden_size": 2048, "num_hidden_layers": 2, "num_attention_heads": 16,
           "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
           "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 1000, "intermediate_size": 1024,
           "moe_intermediate_size": 256, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
           "first_k_dense_replace": 1}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert heads_text(resolve_model(str(tmp_path))) == \
        "16 heads, multi-head latent attention (kv_lora_rank 512; keys 192, values 128 per head)"
    assert heads_text(resolve_model("llama-3.1-8b")) == "32 heads / 8 KV heads (head_dim 128)"
