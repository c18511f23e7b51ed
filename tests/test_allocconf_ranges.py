"""PYTORCH_CUDA_ALLOC_CONF values PyTorch's parser refuses at start are refused by the allocator model too, naming
the option, the value, the accepted range and a fix (c10/core/AllocatorConfig.cpp: ``parseMaxSplitSize``,
``parseGarbageCollectionThreshold``, ``parseRoundUpPower2Divisions``, whole numbers read by ``std::stoull``);
values it accepts stay accepted."""

from __future__ import annotations

import pytest
from conftest import run_cli

from vramguard.memory.allocator import AllocatorConfig, ignored_options


@pytest.mark.parametrize("conf,words", ids=lambda v: str(v)[:50], argvalues=[
    ("garbage_collection_threshold:nan", ("garbage_collection_threshold", "'nan'", "between 0 and 1", "e.g. 0.6")),
    ("garbage_collection_threshold:2", ("garbage_collection_threshold", "'2'", "between 0 and 1")),
    ("garbage_collection_threshold:1", ("garbage_collection_threshold", "'1'", "both excluded")),
    ("garbage_collection_threshold:0", ("garbage_collection_threshold", "'0'", "both excluded")),
    ("garbage_collection_threshold:-0.5", ("garbage_collection_threshold", "'-0.5'")),
    ("garbage_collection_threshold:inf", ("garbage_collection_threshold", "'inf'")),
    ("garbage_collection_threshold:abc", ("garbage_collection_threshold", "'abc'")),
    ("roundup_power2_divisions:3", ("roundup_power2_divisions", "'3'", "power of 2", "[256:1,>:4]")),
    ("roundup_power2_divisions:0", ("roundup_power2_divisions", "'0'", "power of 2")),  # 0 only inside a list
    ("roundup_power2_divisions:-4", ("roundup_power2_divisions", "'-4'", "power of 2")),  # stoull wraps it
    ("roundup_power2_divisions:x", ("roundup_power2_divisions", "whole number", "'x'")),
    ("roundup_power2_divisions:[64:3,>:1]", ("roundup_power2_divisions", "'3'", "0 (no rounding) or a power of 2")),
    ("roundup_power2_divisions:[64:8,>:6]", ("roundup_power2_divisions", "'6'", "of '>'")),
    ("roundup_power2_divisions:[100:8,>:1]", ("roundup_power2_divisions", "'100'", "power of 2 (MiB) or '>'")),
    ("roundup_power2_divisions:[64:8,>:1", ("roundup_power2_divisions", "closing ']'")),
    ("roundup_power2_divisions:[64:" + "9" * 30 + "]", ("roundup_power2_divisions", "too large", "64-bit")),
    ("max_split_size_mb:99999999999999999999999", ("max_split_size_mb", "'99999999999999999999999'",
                                                   "from 20 to 18,446,744,073,709,551,615", "leave it out")),
    ("max_split_size_mb:18446744073709551616", ("max_split_size_mb", "64-bit size")),  # 2**64: stoull's out_of_range
    ("max_split_size_mb:" + "9" * 5000, ("max_split_size_mb", "'99999", "...'", "64-bit size")),  # not Python's text
    ("max_non_split_rounding_mb:10", ("max_non_split_rounding_mb", "'10'", "at least 20")),
    ("max_non_split_rounding_mb:" + "9" * 25, ("max_non_split_rounding_mb", "64-bit size")),
])
def test_values_pytorch_refuses_at_start_are_refused(conf, words):
    with pytest.raises(ValueError) as e:
        AllocatorConfig.parse(conf)
    text = str(e.value)
    assert all(w in text for w in words), text
    assert "sys.set_int_max_str_digits" not in text and len(text) < 300


@pytest.mark.parametrize("conf", [
    "garbage_collection_threshold:0.6", "garbage_collection_threshold:0.999", "garbage_collection_threshold:1e-3",
    "garbage_collection_threshold:.5abc",  # std::stod reads the leading 0.5
    "roundup_power2_divisions:1", "roundup_power2_divisions:4", "roundup_power2_divisions:16",
    "roundup_power2_divisions:[64:8,>:1]", "roundup_power2_divisions:[64:0,256:4,>:0]",
    "roundup_power2_divisions:[1:2, 1024:8, >:1]",
    "max_split_size_mb:20", "max_split_size_mb:18446744073709551615", "max_non_split_rounding_mb:20",
    "garbage_collection_threshold:0.6,roundup_power2_divisions:[64:8,>:1],expandable_segments:True",
])
def test_values_pytorch_accepts_stay_accepted(conf):
    AllocatorConfig.parse(conf)
    assert "max_split_size_mb" not in ignored_options(conf) and "expandable_segments" not in ignored_options(conf)


def test_existing_refusals_keep_their_words():
    for conf in ("max_split_size_mb:abc", "max_split_size_mb:0", "max_split_size_mb:-1"):
        with pytest.raises(ValueError, match="max_split_size_mb must be a whole number of MiB of at least 20"):
            AllocatorConfig.parse(conf)


@pytest.mark.parametrize("conf,word", [("garbage_collection_threshold:nan", "between 0 and 1"),
                                       ("garbage_collection_threshold:2", "between 0 and 1"),
                                       ("roundup_power2_divisions:3", "power of 2"),
                                       ("max_split_size_mb:99999999999999999999999", "64-bit size")])
def test_cli_plan_refuses_them_with_exit_2(conf, word):
    r = run_cli("plan", "llama-3.1-8b", "--gpu", "h100", "--alloc-conf", conf, columns="200")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "error --alloc-conf: " in r.stderr and word in r.stderr and "Traceback" not in r.stderr
