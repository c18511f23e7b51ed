"""Units: every size inside vramguard is an ``int`` of bytes; text is produced only here.

``GiB = 2**30`` and ``GB = 10**9``. :func:`parse_size` accepts exactly ``<number><unit>`` with the unit one of
B, KiB, MiB, GiB, TiB, KB, MB, GB, TB (case-insensitive on the letters, so ``24gib`` works), and rejects
anything else with a message naming the accepted forms.
"""

from __future__ import annotations

import re

from vramguard.errors import InvalidValue

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
KB = 10**3
MB = 10**6
GB = 10**9
TB = 10**12

# K, M, G, T alone and Ki, Mi, Gi, Ti are binary, as in nvidia-smi's MiB, torch's GiB and `docker --memory 24g`
_UNITS = {"b": 1, "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB, "kb": KB, "mb": MB, "gb": GB, "tb": TB,
          "k": KiB, "m": MiB, "g": GiB, "t": TiB, "ki": KiB, "mi": MiB, "gi": GiB, "ti": TiB}
UNIT_WORDS = frozenset(_UNITS) - {"b"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]+)\s*$")
ACCEPTED_SIZE_FORMS = ("a number and a unit, e.g. 24GiB, 24GB, 24000MiB, 12.5GiB (units: B KiB MiB GiB TiB KB MB GB "
                       "TB; G, Gi, M, Mi... are binary: 24G = 24GiB)")


def parse_size(text: str, field: str = "size", example: str = "24GiB", most: str | None = None,
               most_bytes: int | None = None) -> int:
    """Parse a memory size such as ``"24GiB"`` into bytes.

    Args:
        text: the size as typed by a user.
        field: the option or field name used in the error message.
        example: a typical value of the field, used in the fix (its unit is suggested for a bare number).
        most: the field's upper limit in words, said in the fix of a unit larger than any read (``24PiB``).
        most_bytes: that limit in bytes: a size in exponent notation above it is not offered back in digits.

    Returns:
        The size in bytes (int, rounded down to a whole byte).

    Raises:
        InvalidValue: the text has no unit, an unknown unit, a decimal comma (``24,5GiB``), exponent notation
            (``1e3GiB``), or is not positive.
    """
    t = str(text).strip()
    unit = example.lstrip("0123456789.")
    if t.startswith("-"):
        raise InvalidValue(field, text, "a size larger than 0 B", f"give a positive size such as {example}")
    if re.fullmatch(r"\d+,\d+\s*[A-Za-z]*", t):
        raise InvalidValue(field, text, ACCEPTED_SIZE_FORMS,
                           f"a decimal comma is not accepted: write {t.replace(',', '.')}")
    if re.fullmatch(r"\d+(?:\.\d+)?", t):
        if float(t) >= MiB:  # a count of bytes, e.g. torch's total_memory: say so in GiB
            n = int(float(t))
            raise InvalidValue(field, text, ACCEPTED_SIZE_FORMS, f"for {n:,} bytes write {n}B (= {n / GiB:g}GiB)")
        if float(t) == 0:
            raise InvalidValue(field, text, "a size larger than 0 B", f"give a positive size such as {example}")
        raise InvalidValue(field, text, ACCEPTED_SIZE_FORMS, f"add a unit: {t}{unit} or {t}{unit.replace('i', '')}")
    m = _SIZE_RE.match(t)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidValue(field, text, ACCEPTED_SIZE_FORMS, _unread_fix(t, m, example, most, most_bytes))
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise InvalidValue(field, text, "a size larger than 0 B", f"give a positive size such as {example}")
    return value


# units above TiB, in the forms the units read take (P, Pi, PiB, PB...): refused with the largest unit read
_LARGER_UNITS = frozenset(p + s for p in "pezy" for s in ("", "i", "ib", "b"))
_EXPONENT_RE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)[eE]([+-]?\d+)\s*([a-zA-Z]*)$")


def _unread_fix(t: str, m: re.Match | None, example: str, most: str | None, most_bytes: int | None = None) -> str:
    """The fix for a size :func:`parse_size` cannot read, saying why: exponent notation (``1e3GiB``: written in
    digits, ``1000GiB``, where that is short and within ``most_bytes``), a unit above TiB (``24PiB``: the largest
    read, and ``most``, the field's limit), an unknown unit, or no number and unit at all."""
    e = _EXPONENT_RE.match(t)
    if e:
        from decimal import Decimal
        digits = format(Decimal(e.group(1) + "e" + e.group(2)).normalize(), "f")
        unit = e.group(3) or example.lstrip("0123456789.")
        size = Decimal(digits) * _UNITS.get(unit.lower(), 1) if len(digits) <= 16 else None
        fits = size is not None and (most_bytes is None or size <= most_bytes)
        instead = f"{digits}{unit}" if fits else f"e.g. {example}" + (f"; {most}" if most else "")
        return f"exponent notation ({t}) is not read: write the number in digits, {instead}"
    if m and m.group(2).lower() in _LARGER_UNITS:
        limit = f"; {most}" if most else ""
        return f"{m.group(2)} is larger than any unit read (the largest: TiB, TB): write e.g. {example}{limit}"
    if m:
        return f"{m.group(2)!r} is not a unit read: write the number and one of the units, e.g. {example}"
    return f"write the number and a unit, e.g. {example}"


# the most memory one GPU is sold with: NVIDIA's Blackwell Ultra B300, 288 GB of HBM3e per GPU
# (https://www.nvidia.com/en-us/data-center/dgx-b300/: 2.3 TB over 8 GPUs); a driver reports less than that
MAX_CARD_BYTES = 288 * GB


def parse_card_size(text: str, field: str = "vram", example: str = "24GiB") -> int:
    """:func:`parse_size` of one card's memory (a card's total, a budget on it, a ``max_memory`` entry), at most
    :data:`MAX_CARD_BYTES`: ``"24TB"`` (24,000,000,000,000 B) and ``"300GiB"`` (322,122,547,200 B) are refused,
    ``"288GB"`` is taken.

    Raises:
        InvalidValue: as :func:`parse_size`, or a size above :data:`MAX_CARD_BYTES`.
    """
    most = f"at most {MAX_CARD_BYTES // GB} GB ({MAX_CARD_BYTES / GiB:.2f} GiB) per card"
    value = parse_size(text, field, example, most, MAX_CARD_BYTES)
    if value > MAX_CARD_BYTES:
        raise InvalidValue(field, text, most + ", the memory of the largest GPU sold (NVIDIA B300)",
                           f"{text.strip()} is {value:,} B: give the memory of one card, such as {example}")
    return value


def decimal_size_note(text: str, field: str = "vram") -> str | None:
    """What a size in decimal GB/TB was read as, and what a card sold as that size has: ``24gb`` is 24 x 10**9 B
    = 22.35 GiB, while a card sold as "24 GB" has 24 GiB (25,769,803,776 B) before its driver's reservation.
    None for any other unit."""
    m = _SIZE_RE.match(str(text))
    if not m or m.group(2).lower() not in ("gb", "tb"):
        return None
    unit = m.group(2).upper()
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    binary = int(float(m.group(1)) * (GiB if unit == "GB" else TiB))
    n = m.group(1)
    return (f"{field}={text.strip()} read as {n} {unit} = {value:,} B ({value / GiB:.2f} GiB); a card sold as "
            f"\"{n} {unit}\" has {n} {unit[0]}iB = {binary:,} B, less what its driver keeps: for such a card pass "
            f"gpu=NAME (its reported total) or {field}={n}{unit[0]}iB")


def plural(n: int, noun: str) -> str:
    """``1 warning``, ``2 warnings``, ``1,024 lines``: the count with thousands separators and the noun."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def fmt_gib(n: int | None, digits: int = 2) -> str:
    """Render bytes as GiB (divided by 2**30), e.g. ``3.61 GiB``; ``None`` renders as ``-``."""
    if n is None:
        return "-"
    return f"{n / GiB:.{digits}f} GiB"


def fmt_bytes(n: int | None) -> str:
    """Render bytes with the largest binary unit that keeps the number >= 1 (B, KiB, MiB, GiB, TiB)."""
    if n is None:
        return "-"
    sign = "-" if n < 0 else ""
    v = abs(n)
    for name, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if v >= size:
            return f"{sign}{v / size:.2f} {name}"
    return f"{sign}{v} B"


def fmt_tokens(n: int | None) -> str:
    """Render a token count with thousands separators."""
    return "-" if n is None else f"{n:,}"
