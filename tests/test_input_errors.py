"""Errors a new user meets on the card options of ``plan``: each names the option typed, the value and the fix."""

import pytest

from conftest import run_cli

from vramguard.errors import InvalidValue
from vramguard.units import parse_size


def _err(r) -> str:
    return " ".join(r.stderr.split())


@pytest.mark.parametrize("args,fixed", [
    (["--vram", "24,5GiB"], "write 24.5GiB"),
    (["--vram", "24,5"], "write 24.5GiB"),
    (["--vram", "24,5GiB,12GiB"], "write 24.5GiB,12GiB"),
    (["--vram", "24GiB,24GiB", "--max-memory", "20,5GiB,10GiB"], "write 20.5GiB,10GiB"),
])
def test_a_decimal_comma_is_refused_as_one(args, fixed):
    r = run_cli("plan", "llama-3.1-8b", *args)
    assert r.returncode == 2 and "a decimal comma is not accepted" in _err(r) and fixed in _err(r)
    assert "add a unit" not in _err(r)


def test_parse_size_refuses_a_decimal_comma():
    with pytest.raises(InvalidValue) as e:
        parse_size("24,5GiB", "vram")
    assert e.value.fix == "a decimal comma is not accepted: write 24.5GiB"
    assert parse_size("24.5GiB") == 49 * 2**29  # 24.5 x 2**30


@pytest.mark.parametrize("args", [["--gpu", "rtx-4090", "--vram", "24GiB"],
                                  ["--gpu", "rtx-4090,rtx-4090", "--vram", "24GiB,24GiB"]])
def test_gpu_and_vram_together_are_said_to_conflict(args):
    r = run_cli("plan", "llama-3.1-8b", *args)
    err = _err(r)
    assert r.returncode == 2 and "error --gpu/--vram:" in err and "they conflict" in err
    assert "pass one: --gpu rtx-4090" in err and "('" not in err  # no Python tuple


@pytest.mark.parametrize("args,flag,value", [
    (["--max-memory", "30GiB", "--gpu", "h100"], "--max-memory", "30GiB"),
    (["--device-map", "sequential", "--vram", "24GiB"], "--device-map", "sequential"),
])
def test_a_split_option_with_one_card_names_that_option(args, flag, value):
    r = run_cli("plan", "llama-3.1-8b", *args)
    err = _err(r)
    assert r.returncode == 2 and f"error {flag}: '{value}' is not valid" in err and "--gpus" not in err
    assert f"leave {flag} out for one card" in err


@pytest.mark.parametrize("args", [
    ["run", "no-such-folder", "--prompt", "hi", "--seed", str(2**64), "--do-sample"],
    ["run", "no-such-folder", "--prompt", "hi", "--seed", "-1"],
])
def test_a_seed_outside_torchs_range_is_refused_before_loading(args):
    # torch.manual_seed unpacks a signed 64-bit integer: 2**64 used to end in "internal error ValueError: Overflow"
    r = run_cli(*args)
    assert r.returncode == 2 and "internal error" not in r.stderr
    assert "error --seed:" in r.stderr and "9,223,372,036,854,775,807" in _err(r)


def test_the_library_and_the_server_refuse_a_seed_beyond_64_bits():
    from vramguard.run.generate import MAX_SEED, check_seed
    from vramguard.serve.server import build
    check_seed(MAX_SEED)
    check_seed(None)
    with pytest.raises(InvalidValue) as e:
        check_seed(MAX_SEED + 1)
    assert e.value.field == "seed"
    with pytest.raises(InvalidValue) as e:  # before the model is read: the folder does not exist
        build("no-such-folder", seed=2**64)
    assert e.value.field == "seed"


def test_a_mistyped_command_names_it_and_the_likely_one():
    r = run_cli("plna", "llama-3.1-8b")
    assert r.returncode == 2
    assert _err(r).startswith("error COMMAND: 'plna' is not valid; accepted: plan, check,")
    assert "fix: did you mean plan?" in _err(r)
