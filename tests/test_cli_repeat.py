"""An option of one value given twice is refused, not last-wins; a catalog listing says what it ignores; a plan that
fails says its error alone; a size the units cannot read says why (exponent notation, a unit above TiB)."""

from __future__ import annotations

import json

import pytest

from conftest import run_cli as _run_cli
from vramguard.errors import InvalidValue
from vramguard.units import parse_card_size, parse_size

pytestmark = pytest.mark.usefixtures("shared_plans")  # the same plans asked for again and again: each computed once

M = "llama-3.1-8b"


def run_cli(*args: str):
    """The command run wide enough that no message line is wrapped."""
    return _run_cli(*args, columns="1000")


def _error(r) -> tuple[str, str]:
    """The error's two lines (error ..., fix: ...) of a run that exited 2 with nothing on stdout but, under
    ``--format json``, the error as JSON."""
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" or json.loads(r.stdout)["error"]["exit_code"] == 2
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 2, r.stderr
    assert lines[0].startswith("error ") and lines[1].startswith("fix: ")
    return lines[0], lines[1]


def test_gpu_given_twice_is_refused_with_the_comma_list():
    line, fix = _error(run_cli("plan", M, "--gpu", "h100-80gb", "--gpu", "rtx-3060-12gb", "--format", "json"))
    assert line == "error --gpu: given twice ('h100-80gb', then 'rtx-3060-12gb'); accepted: one --gpu."
    assert fix == "fix: name several cards in one: --gpu h100-80gb,rtx-3060-12gb"


def test_the_comma_list_the_fix_names_plans_both_cards():
    r = run_cli("plan", M, "--gpu", "h100-80gb,rtx-3060-12gb", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)


def test_vram_given_twice_is_refused_with_the_comma_list():
    line, fix = _error(run_cli("plan", M, "--vram", "24GiB", "--vram=1GiB"))
    assert line == "error --vram: given twice ('24GiB', then '1GiB'); accepted: one --vram."
    assert fix == "fix: give the sizes of several cards in one: --vram 24GiB,1GiB"


def test_gpu_three_times_with_gpus_is_refused():
    line, fix = _error(run_cli("plan", M, "--gpus", "2", "--gpu", "h100", "--gpu", "a100-80gb", "--gpu", "h200"))
    assert line == "error --gpu: given three times ('h100', 'a100-80gb', then 'h200'); accepted: one --gpu."
    assert fix == "fix: name several cards in one: --gpu h100,a100-80gb,h200"


@pytest.mark.parametrize("args", [("plan", M, "--max-new-tokens", "5", "--max-new-tokens", "0"),
                                  ("plan", M, "--max-new-tokens=5", "--max-new-tokens=0"),
                                  ("explain", "CUDA out of memory", "--max-new-tokens", "5", "--max-new-tokens=0")])
def test_other_options_given_twice_say_give_it_once(args):
    line, fix = _error(run_cli(*args))
    assert line == "error --max-new-tokens: given twice ('5', then '0'); accepted: one --max-new-tokens."
    assert fix == "fix: give --max-new-tokens once"


def test_a_card_given_twice_to_a_command_of_one_card_says_give_it_once():
    line, fix = _error(run_cli("export", M, "--gpu", "h100-80gb", "--gpu", "a100-80gb"))
    assert line.startswith("error --gpu: given twice")
    assert fix == "fix: give --gpu once"  # export plans one card: no comma list to point to


def test_a_value_that_looks_like_an_option_is_the_value():
    """click gives an option of one value the next word whatever it is: ``--prompt --gpu`` is the prompt '--gpu',
    so the ``--gpu`` there is no option, and ``--prompt`` is what was given twice."""
    line, _ = _error(run_cli("run", M, "--prompt", "--vram-budget", "--prompt", "x"))
    assert line == "error --prompt: given twice ('--vram-budget', then 'x'); accepted: one --prompt."


def test_after_double_dash_nothing_is_an_option():
    r = run_cli("plan", M, "--vram", "24GiB", "--", "--vram")
    assert "given twice" not in r.stderr  # "--vram" after "--" is an argument (click refuses it as an extra one)


def test_a_switch_and_its_negation_are_refused():
    line, fix = _error(run_cli("plan", M, "--padded", "--no-padded"))
    assert line == "error --padded: given as --padded then --no-padded; accepted: one of them."
    assert fix == "fix: keep the one you mean: --no-padded or --padded, not both"


def test_a_switch_repeated_alone_is_kept():
    r = run_cli("plan", M, "--vram", "24GiB", "--padded", "--padded", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert "given" not in r.stderr


def test_an_option_taken_several_times_is_not_checked(tmp_path):
    """run's --context is ``multiple``: twice is two files, not a repeat."""
    from vramguard.cli.options import repeated_option
    import typer.main
    from vramguard.cli import app
    group = typer.main.get_command(app)
    assert repeated_option(group, ["run", M, "--context", "a.txt", "--context", "b.txt"]) is None
    assert "--seed" in str(repeated_option(group, ["run", M, "--context", "--seed", "--seed", "1", "--seed", "2"]))


@pytest.mark.parametrize("args, ignored", [(("plan", "--list-gpus", "--gpu", "nonsense"), "--gpu 'nonsense'"),
                                           (("plan", M, "--list-gpus"), f"MODEL '{M}'"),
                                           (("plan", M, "--list-models", "--no-padded"), "--no-padded")])
def test_a_listing_notes_what_it_ignores(args, ignored):
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout
    assert r.stderr.startswith("note: --list-")
    assert "lists the catalog and exits; ignored: " in r.stderr and ignored in r.stderr


def test_a_listing_alone_says_nothing():
    r = run_cli("plan", "--list-gpus", "--format", "json")
    assert r.returncode == 0 and r.stderr == ""
    assert json.loads(r.stdout)


def test_freed_before_note_is_not_said_before_an_error():
    r = run_cli("plan", M, "--freed-before", "--gpus", "2")  # no card named and none detected here
    assert r.returncode == 2, r.stderr
    assert "plans one card" not in r.stderr
    assert r.stderr.startswith("error --gpu/--vram")


def test_freed_before_note_is_said_with_a_plan():
    r = run_cli("plan", M, "--freed-before", "--gpus", "2", "--gpu", "h100-80gb", "--format", "json")
    assert r.returncode == 0, r.stderr
    assert "note: --freed-before plans one card" in r.stderr


@pytest.mark.parametrize("text, fix", [("1e3GiB", "exponent notation (1e3GiB) is not read: write the number in "
                                                  "digits, 1000GiB"),
                                       ("1.5e2G", "exponent notation (1.5e2G) is not read: write the number in "
                                                  "digits, 150G"),
                                       ("1e30GiB", "exponent notation (1e30GiB) is not read: write the number in "
                                                   "digits, e.g. 24GiB"),
                                       ("1e-300GiB", "exponent notation (1e-300GiB) is not read: write the number "
                                                     "in digits, e.g. 24GiB"),
                                       ("24PiB", "PiB is larger than any unit read (the largest: TiB, TB): write "
                                                 "e.g. 24GiB"),
                                       ("24gigs", "'gigs' is not a unit read: write the number and one of the "
                                                  "units, e.g. 24GiB")])
def test_parse_size_says_why_it_cannot_read_a_size(text, fix):
    with pytest.raises(InvalidValue) as e:
        parse_size(text, "vram")
    assert e.value.fix == fix


def test_a_card_size_in_a_unit_above_tib_states_the_limit():
    with pytest.raises(InvalidValue) as e:
        parse_card_size("24PiB", "vram")
    assert e.value.fix == ("PiB is larger than any unit read (the largest: TiB, TB): write e.g. 24GiB; at most "
                           "288 GB (268.22 GiB) per card")


@pytest.mark.parametrize("value, words", [("2.4e1GiB", "write the number in digits, 24GiB"),
                                          # 1000GiB is above any card: not offered back
                                          ("1e3GiB", "digits, e.g. 24GiB; at most 288 GB (268.22 GiB) per card"),
                                          ("24PiB", "the largest: TiB, TB"),
                                          ("1e30GiB", "at most 288 GB (268.22 GiB) per card")])
def test_vram_that_cannot_be_read_says_why(value, words):
    line, fix = _error(run_cli("plan", M, "--vram", value))
    assert line.startswith(f"error --vram: '{value}' is not valid")
    assert words in fix
    assert "write the number and a unit" not in fix


def test_max_body_size_in_exponent_notation_says_why():
    line, fix = _error(run_cli("serve", M, "--max-body-size", "1e6B"))
    assert fix == "fix: exponent notation (1e6B) is not read: write the number in digits, 1000000B"
