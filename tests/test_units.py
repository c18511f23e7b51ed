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
])
def test_parse_size_accepted_forms(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["24", "24G", "24 gigs", "-1GiB", "0GiB", "GiB", "24XB", ""])
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
