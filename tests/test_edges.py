"""Edges a user meets: a card verdict whose need is within the card's memory (which rule says no, in text and JSON;
the changes measured against the same need), check's default weight format (run's rule), and errors as JSON on
stdout under ``--format json``."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from conftest import run_cli
from vramguard.catalog.gpus import GpuSpec
from vramguard.introspect.alloc_replay import allowed_bytes, offload_to_fit_bytes
from vramguard.plan.estimator import CardVerdict, misfit_reason, misfit_text

GIB8 = 8 * 2**30  # 8,589,934,592 B
CTX = 786_432_000  # the CUDA context the plan counts
BASE = 5_844_762_624  # llama-3.1-8b NF4 loaded, as the allocator model reserves it


def test_misfit_reason_names_the_rule_that_says_no():
    kept = 19_587_399  # (8,589,934,592 - 786,432,000 - 5,844,762,624) // 100
    assert GIB8 - CTX - allowed_bytes(GIB8 - CTX, BASE) == kept
    assert misfit_reason(True, GIB8 + 1, GIB8, kept) is None
    assert misfit_reason(False, GIB8 + 1, GIB8, kept) == "memory"
    assert misfit_reason(False, GIB8, GIB8, kept) == "kept_free"  # the card's whole memory: into the kept room
    assert misfit_reason(False, GIB8 - kept + 1, GIB8, kept) == "kept_free"
    assert misfit_reason(False, GIB8 - kept, GIB8, kept) == "fragmentation"  # 8,570,347,193: below the cap
    # nothing kept free (the replay failed with the whole card): a need within the card fails by its segments
    assert misfit_reason(False, GIB8, GIB8, 0) == "fragmentation"


def test_misfit_text_says_the_figures():
    card = GpuSpec("c", "8 GiB card", GIB8, None)
    v = CardVerdict(card, GIB8, 8_583_643_136, False, 6_291_456, misfit_reason="kept_free",
                    kept_free_bytes=19_587_399)
    assert misfit_text(v) == ("needs 7.99 GiB of 8.00 GiB, but the fit keeps 1/100 of the room above the loaded "
                              "model free (18.68 MiB, the allocator model's largest shortfall at a measured edge) "
                              "and the peak reaches into it")
    short = CardVerdict(card, GIB8, GIB8 + 2**20, False, -2**20, misfit_reason="memory")
    assert misfit_text(short) == "needs 8.00 GiB of 8.00 GiB: short by 1.00 MiB"


def test_offload_to_fit_keeps_the_room_the_cap_keeps():
    need, kept = 8_583_643_136, 19_587_399
    x = offload_to_fit_bytes(need, GIB8, kept)
    assert x == 13_430_247  # (8,583,643,136 - 8,589,934,592 + 19,587,399) = 13,295,943; * 100 / 99 up, + 1
    kept_after = GIB8 - CTX - allowed_bytes(GIB8 - CTX, BASE - x)  # the loaded model smaller by x
    assert kept_after == 19_721_702
    assert need - x == 8_570_212_889 <= GIB8 - kept_after == 8_570_212_890  # fits, by 1 B
    assert offload_to_fit_bytes(GIB8 - kept, GIB8, kept) == 0


@pytest.fixture(scope="module")
def edge_plan():
    """llama-3.1-8b NF4, 6,805 + 256 tokens on an 8 GiB card: 7.99 GiB needed, into the room the fit keeps."""
    from vramguard.plan import plan
    from vramguard.settings import Settings
    return plan("llama-3.1-8b", Settings(quant="nf4", prompt_tokens=6805), vram="8GiB", alloc_conf="")


def test_a_need_within_the_card_is_the_table_figure_with_its_reason(edge_plan):
    p = edge_plan
    c = p.cards[0]
    assert p.estimate.allocator.base_reserved_bytes == BASE
    # the need is the table's "card memory in use", not the card + 1 B placeholder (8,589,934,593)
    assert c.need_bytes == p.estimate.device_used_bytes == 8_583_643_136
    assert (c.fits, c.headroom_bytes, c.misfit_reason, c.kept_free_bytes) == (False, 6_291_456, "kept_free",
                                                                               19_587_399)
    from vramguard.cli.render import plan_to_json, print_plan
    card = plan_to_json(p)["cards"][0]
    assert (card["need_bytes"], card["misfit_reason"], card["kept_free_bytes"]) == (8_583_643_136, "kept_free",
                                                                                     19_587_399)
    out = io.StringIO()
    print_plan(p, Console(file=out, width=80, color_system=None))
    text = out.getvalue()
    assert " 8 GiB card    8.00  7.99   no†      0.01   6,795" in text
    assert "†: 8 GiB card needs 7.99 GiB of 8.00 GiB, but the fit keeps 1/100 of the room" in text


def test_the_changes_are_measured_against_the_card_need(edge_plan):
    by = {tuple(sorted(ch.settings)): ch for ch in edge_plan.changes}
    off = by[("cpu_offload_bytes", "device_map")]
    # what the 8,583,643,136 B need must lose to fit under a cap that keeps 1/100 free (not card + 1 B: 8.00 GiB)
    assert (off.settings["cpu_offload_bytes"], off.saved_bytes, off.need_bytes) == (13_430_247, 13_430_247,
                                                                                    8_570_212_889)
    assert off.description.startswith("weights: 12.81 MiB of them in CPU RAM")
    prompt = by[("prompt_tokens",)]
    # 10 fewer tokens save one 14 MiB segment (the replay reserves 7,797,211,136 B from 6,803 tokens on, and
    # 7,782,531,072 up to 6,802): 8,583,643,136 - 8,568,963,072, not the 329.70 MiB from the reserve formula's
    # need (8,914,683,136 B)
    assert (prompt.settings["prompt_tokens"], prompt.need_bytes, prompt.saved_bytes) == (6795, 8_568_963_072,
                                                                                         14_680_064)


def test_check_without_quant_checks_what_run_loads_here():
    from vramguard.check import check
    from vramguard.errors import InvalidValue
    from vramguard.probe.env import Env
    for cuda, want in ((False, "fp32"), (True, "nf4")):
        r = check(None, quant_unset=True, env=Env(cuda_available=cuda), verify=False)
        quant = [f for f in r.findings if f.code == "quant"]
        assert [f.value for f in quant] == [f"{want} (none given)"]
        assert quant[0].message.startswith("the weight format vramguard run and serve load here: ")
    named = check(None, quant_unset=True, env=Env(cuda_available=False), verify=False, gpu="rtx-4090")
    assert [f.value for f in named.findings if f.code == "quant"] == ["nf4 (none given)"]  # run on that card: NF4
    assert not [f for f in check(None, env=Env(), verify=False).findings if f.code == "quant"]  # given: as given
    with pytest.raises(InvalidValue) as e:
        check(None, compute_dtype="bf16", quant_unset=True, env=Env(), verify=False)
    assert e.value.field == "compute_dtype"
    assert e.value.accepted == ("unset with quant='fp32' (none given: vramguard run and serve load it here, no "
                                "CUDA device): the weights are not 4-bit")


def test_check_cli_leaves_the_default_to_the_library(monkeypatch):
    """``vramguard check`` without --quant asks check for run's default (quant_unset), on a machine without CUDA
    (an injected Env: no probe) fp32, as run loads there."""
    from vramguard.check import check
    from vramguard.cli import check as check_cli
    from vramguard.probe.env import Env
    seen = {}

    def without_cuda(*args, **kw):
        seen.update(kw)
        return check(*args, **{**kw, "env": Env(cuda_available=False)})
    monkeypatch.setattr(check_cli, "check_fn", without_cuda)
    r = run_cli("check", "--no-verify", "--format", "json")
    assert seen["quant_unset"] is True
    assert [f["value"] for f in json.loads(r.stdout)["findings"] if f["code"] == "quant"] == ["fp32 (none given)"]
    run_cli("check", "--no-verify", "--quant", "nf4", "--format", "json")
    assert seen["quant_unset"] is False


USAGE_ERRORS = [
    (("plan", "llama-3.1-8b", "--format", "json", "--batch", "x"),
     {"type": "InvalidValue", "field": "--batch", "value": "x", "accepted": "an integer",
      "fix": "pass --batch with an integer (`vramguard plan --help`)", "exit_code": 2}),
    (("plan", "llama-3.1-8b", "--format=json", "--vram", "24", "GiB"),
     {"type": "UsageError", "field": "--vram", "value": "24 GiB", "accepted": "a number and a unit in one word",
      "fix": "write --vram 24GiB (or quote it: --vram '24 GiB')", "exit_code": 2}),
    (("run", "llama-3.2-1b", "--prompt", "hi", "--format", "json", "--seed", "1", "--seed", "2"),
     {"type": "UsageError", "field": "--seed", "value": "'1', then '2'", "accepted": "one --seed",
      "fix": "give --seed once", "exit_code": 2}),
    (("check", "--format", "json", "--vram", "8GiB"),
     {"type": "InvalidValue", "field": "OPTION", "value": "--vram",
      "accepted": "an option of vramguard check (`vramguard check --help` lists them)",
      "fix": "check the spelling in `vramguard check --help`", "exit_code": 2}),
    (("plan", "llama-3.1-8b", "--format", "json", "--prompt-tokens", "-5"),
     {"type": "InvalidValue", "field": "--prompt-tokens", "value": "-5",
      "accepted": "an integer >= 1 and <= 2,147,483,647", "fix": "pass a whole number of at least 1",
      "exit_code": 2}),
]


@pytest.mark.parametrize("args,want", USAGE_ERRORS)
def test_a_usage_error_under_format_json_is_json_on_stdout(args, want):
    r = run_cli(*args)
    assert r.returncode == 2
    assert json.loads(r.stdout) == {"error": want}
    assert r.stderr.startswith(f"error {want['field']}: ")


def test_a_usage_error_without_json_leaves_stdout_empty():
    r = run_cli("plan", "llama-3.1-8b", "--batch", "x")
    assert (r.returncode, r.stdout) == (2, "")


def test_json_asked_reads_the_command_line_as_click_does():
    import typer.main

    from vramguard.cli import app
    from vramguard.cli.options import json_asked
    group = typer.main.get_command(app)
    assert json_asked(group, ["plan", "m", "--format", "json"])
    assert json_asked(group, ["oom-log", "--format=json"])
    assert not json_asked(group, ["plan", "m", "--format", "human"])
    assert not json_asked(group, ["plan", "m", "--", "--format", "json"])  # after --: an argument
    assert not json_asked(group, ["serve", "m", "--format", "json"])  # serve has no --format


def test_json_errors_hold_for_their_command_line_only():
    from vramguard.cli import common
    run_cli("plan", "llama-3.1-8b", "--format", "json", "--batch", "x")
    assert common._JSON_ERRORS["on"] is False  # the next command (an app invoked directly) says its errors as text


def test_a_json_error_names_the_command_that_lists_the_models_not_a_python_object(tmp_path):
    """The JSON error's ``accepted`` is in the CLI's words, as the text on stderr is."""
    import json

    from conftest import run_cli
    r = run_cli("plan", str(tmp_path / "no-such-folder"), "--format", "json")
    err = json.loads(r.stdout)["error"]
    assert r.returncode == 3 and "vramguard plan --list-models" in err["accepted"]
    assert "vramguard.catalog" not in err["accepted"]


def test_the_pool_refusal_says_how_the_pool_was_sized_without_a_bare_option():
    from types import SimpleNamespace

    from vramguard.serve.engine import Engine
    fake = SimpleNamespace(fits_pool=lambda tokens: False, pool=SimpleNamespace(pool_tokens=64, page_size=16))
    text = Engine.budget_refusal(fake, 60, 10, "max_tokens")
    assert text == ("max_tokens: 60 prompt + 10 new tokens needs more KV cache than this server's whole KV cache "
                    "pool (64 tokens, as the server was started); it can never run here: keep prompt + max_tokens "
                    "<= 64")


def test_ctrl_c_says_it_interrupted_the_command(monkeypatch):
    """Ctrl-C (KeyboardInterrupt, which typer turns into exit 130) ends with 130 and a line on stderr saying so."""
    from conftest import run_cli

    from vramguard.cli import explain as explain_cmd

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(explain_cmd, "read_message", interrupted)
    r = run_cli("explain", "-")
    assert r.returncode == 130 and "interrupted: stopped at Ctrl-C (exit 130)" in r.stderr
