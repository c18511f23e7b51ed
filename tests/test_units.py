import pytest

from vramguard.errors import InvalidValue
from vramguard.units import GiB, fmt_bytes, fmt_gib, parse_size


@pytest.mark.parametrize("text,expected", [
    ("24GiB", 24 * 2**30),            # 25,769,803,776
    ("24GB", 24 * 10**9),
    ("24000MiB", 24000 * 2**20),      # 25,165,824,000
    ("12.5GiB", 13421772800),         # 12.5 x 2**30
    ("512B", 512),
    ("24gib", 24 * 2**30),
    ("24G", 24 * 2**30), ("24g", 24 * 2**30), ("24Gi", 24 * 2**30), ("512M", 512 * 2**20),  # binary, as nvidia-smi
    ("24gb", 24 * 10**9),             # decimal GB, case-insensitive (a note says what that means: below)
])
def test_parse_size_accepted_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24", "24 gigs", "-1GiB", "0GiB", "GiB", "24XB", ""])
def test_parse_size_rejects_and_names_the_forms(text):
    with pytest.raises(InvalidValue) as e:
        parse_size(text, "--vram")
    assert "--vram" in str(e.value)
    if text not in ("-1GiB", "0GiB"):
        assert "24GiB" in str(e.value) and "24000MiB" in str(e.value)


def test_formatting_divides_by_2_30_for_gib():
    assert fmt_gib(3 * GiB // 2) == "1.50 GiB"
    assert fmt_bytes(512 * 2**20) == "512.00 MiB"
    assert fmt_bytes(100) == "100 B"


def test_plural_counts():
    from vramguard.units import plural
    assert (plural(1, "warning"), plural(0, "warning"), plural(1024, "line")) == ("1 warning", "0 warnings",
                                                                                "1,024 lines")


def test_a_byte_count_without_unit_is_suggested_as_bytes():
    with pytest.raises(InvalidValue) as e:
        parse_size("25769803776", "--vram")
    assert e.value.fix == "for 25,769,803,776 bytes write 25769803776B (= 24GiB)"
    assert parse_size("25769803776B") == 24 * GiB
    with pytest.raises(InvalidValue) as e:
        parse_size("24", "--vram")
    assert "24GiB" in e.value.fix


def test_decimal_gb_says_what_was_understood_and_what_a_24_gb_card_has():
    from vramguard.units import decimal_size_note
    from vramguard.cli.flags import as_flags
    note = decimal_size_note("24gb")
    assert "24,000,000,000 B (22.35 GiB)" in note and "25,769,803,776 B" in note and "vram=24GiB" in note
    assert "--vram 24GiB" in as_flags(note) and "--gpu NAME" in as_flags(note)
    assert decimal_size_note("24GiB") is None and decimal_size_note("24G") is None


def test_a_size_split_in_two_words_is_a_clear_error():
    from conftest import run_cli
    r = run_cli("plan", "--vram", "24", "GiB")
    assert r.returncode == 2 and "two arguments" in r.stderr and "--vram 24GiB" in r.stderr, r.stderr
    r = run_cli("plan", "llama-2-7b", "--vram", "24gb")
    assert r.returncode == 0 and "22.35 GiB" in r.stderr


def test_a_decimal_budget_says_what_it_was_read_as(capsys):
    """--vram-budget 24gb (run, profile, serve) is 24 x 10**9 B, and says so beside what a "24 GB" card has."""
    from vramguard.cli.common import size_option
    assert size_option("24gb", "vram_budget") == 24 * 10**9
    err = capsys.readouterr().err
    assert "--vram-budget 24gb read as 24 GB = 24,000,000,000 B (22.35 GiB)" in " ".join(err.split())
    assert size_option("24GiB", "vram_budget") == 24 * 2**30 and capsys.readouterr().err == ""


def test_zero_and_empty_sizes_are_refused_with_a_fix_that_works():
    import pytest as _pytest

    from vramguard.errors import InvalidValue
    from vramguard.hardware import resolve_gpus
    from vramguard.units import parse_size
    with _pytest.raises(InvalidValue) as e:
        parse_size("0", "--vram")
    assert "positive size such as 24GiB" in e.value.fix
    with _pytest.raises(InvalidValue):  # --vram "" is a bad size, not the default cards
        resolve_gpus(None, "")


def test_serve_counts_have_an_upper_bound_named_by_their_option():
    import pytest as _pytest

    from vramguard.errors import InvalidValue
    from vramguard.serve.config import MAX_COUNT, _check_limits
    with _pytest.raises(InvalidValue) as e:
        _check_limits(10.0, page_size=(10**14, 4))
    assert e.value.field == "page_size" and f"{MAX_COUNT:,}" in e.value.fix
    _check_limits(10.0, page_size=(256, 4))
