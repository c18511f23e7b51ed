"""The values PyTorch's parser accepts for ``PYTORCH_CUDA_ALLOC_CONF`` options at start
(``c10/core/AllocatorConfig.cpp``): what :meth:`vramguard.memory.allocator.AllocatorConfig.parse` refuses before a
plan is made on a setting that would stop the user's process. Pure Python."""

from __future__ import annotations

import re

SIZE_T_MAX = 2**64 - 1  # PyTorch reads whole-number options with std::stoull (c10/core/AllocatorConfig.h)


def _quoted(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:37] + "...")


def _c_unsigned(key: str, text: str) -> int:
    """``text`` as ``std::stoull`` reads it: its leading whole number (a sign allowed, ``-n`` wrapping to 2**64 - n,
    what follows the digits ignored); ValueError naming ``key`` where stoull throws (no digits, beyond 2**64 - 1)."""
    m = re.match(r"([+-]?)(\d+)", text)
    if m is None:
        raise ValueError(f"{key} must be a whole number, not {_quoted(text)}")
    digits = m.group(2).lstrip("0") or "0"
    if len(digits) > 20 or int(digits) > SIZE_T_MAX:
        raise ValueError(f"{key}: {_quoted(text)} is too large for PyTorch to read (at most {SIZE_T_MAX}, a 64-bit "
                         "size); send a smaller number")
    return (-int(digits)) % 2**64 if m.group(1) == "-" else int(digits)


def _c_double(text: str) -> float | None:
    """The leading number of ``text`` as ``std::stod`` reads it (decimal, hex, inf, nan), None where it has none."""
    m = re.match(r"[+-]?(0[xX]([0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)([pP][+-]?\d+)?|(\d+\.?\d*|\.\d+)"
                 r"([eE][+-]?\d+)?|inf(inity)?|nan)", text, re.IGNORECASE)
    if m is None:
        return None
    number = m.group(0)
    if "x" in number.lower():
        hex_text = number if "p" in number.lower() else number + "p0"
        return float.fromhex(hex_text)
    return float(number)


def _power_of_2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_value(key: str, value: str) -> None:
    """Raise ValueError naming ``key``, ``value``, the accepted values and the fix where PyTorch's parser refuses
    ``key:value`` at start (c10/core/AllocatorConfig.cpp: ``parseMaxSplitSize``, ``parseGarbageCollectionThreshold``,
    ``parseRoundUpPower2Divisions``); only what it surely refuses is refused (``4abc`` reads as 4 there)."""
    if key == "expandable_segments" and value not in ("True", "False", "true", "false", "1", "0"):
        raise ValueError(f"expandable_segments must be True or False, not {value!r}")
    if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
        whole = value.isascii() and value.isdigit()
        if not whole or len(value.lstrip("0")) <= 2 and int(value) < 20:
            raise ValueError(f"{key} must be a whole number of MiB of at least 20 (PyTorch refuses a smaller one "
                             f"at start), not {_quoted(value)}")
        if len(value.lstrip("0")) > 20 or int(value) > SIZE_T_MAX:
            raise ValueError(f"{key} must be a whole number of MiB from 20 to {SIZE_T_MAX:,} (PyTorch cannot read a "
                             f"larger one: a 64-bit size), not {_quoted(value)}; leave it out for no limit")
    elif key == "garbage_collection_threshold":
        threshold = _c_double(value)
        if threshold is None or not 0 < threshold < 1:
            raise ValueError(f"garbage_collection_threshold must be a number between 0 and 1, both excluded "
                             f"(PyTorch refuses any other at start), not {_quoted(value)}; e.g. 0.6")
    elif key == "roundup_power2_divisions":
        _check_divisions(value)


def _check_divisions(value: str) -> None:
    """``roundup_power2_divisions``: one power of 2, or ``[size_mb:divisions,...,>:divisions]`` with each size a power
    of 2 (or ``>``) and each division 0 (no rounding) or a power of 2."""
    key = "roundup_power2_divisions"
    if not value.startswith("["):
        if not _power_of_2(_c_unsigned(key, value)):
            raise ValueError(f"{key} must be a power of 2 (1, 2, 4, 8...; PyTorch refuses any other at start), not "
                             f"{_quoted(value)}; or give a list such as [256:1,>:4]")
        return
    if not value.endswith("]"):
        raise ValueError(f"{key}: the list {_quoted(value)} has no closing ']'; e.g. [256:1,>:4]")
    for item in filter(None, (i.strip() for i in value[1:-1].split(","))):
        size, colon, divisions = item.partition(":")
        if not colon:
            raise ValueError(f"{key}: {_quoted(item)} in the list is not size_mb:divisions; e.g. [256:1,>:4]")
        if size.strip() != ">" and not _power_of_2(_c_unsigned(key, size.strip())):
            raise ValueError(f"{key}: the size {_quoted(size.strip())} in the list must be a power of 2 (MiB) or "
                             "'>' (PyTorch refuses any other at start); e.g. [256:1,>:4]")
        n = _c_unsigned(key, divisions.strip())
        if n != 0 and not _power_of_2(n):
            raise ValueError(f"{key}: the divisions {_quoted(divisions.strip())} of {_quoted(size.strip())} must be "
                             "0 (no rounding) or a power of 2 (PyTorch refuses any other at start); e.g. [256:1,>:4]")
