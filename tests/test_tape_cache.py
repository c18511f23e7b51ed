"""The tape cache on disk: a second plan reads the tape the first recorded, byte for byte, and a changed setting,
a damaged file or a cache turned off never hands back a wrong tape."""

from __future__ import annotations

import gzip

import pytest

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=2048)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    from transformers import LlamaConfig

    from vramguard.introspect import alloc_replay, hand
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    LlamaConfig(**TINY).save_pretrained(tmp_path / "model")
    monkeypatch.setenv("VRAMGUARD_CACHE_DIR", str(tmp_path / "vg"))
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", "1")
    monkeypatch.setattr(hand, "ENABLED", False)  # the tapes of transformers' forward (a Llama's is written by hand)
    alloc_replay._hand_spec.cache_clear()
    alloc_replay._cached_events.cache_clear()
    yield resolve_model(str(tmp_path / "model")), Settings(quant="nf4", attn="sdpa", prompt_tokens=1,
                                                           max_new_tokens=1), tmp_path / "vg" / "tapes"
    alloc_replay._cached_events.cache_clear()
    alloc_replay._hand_spec.cache_clear()


def test_second_read_is_the_recorded_tape(tiny):
    from vramguard.introspect.alloc_replay import _cached_events, _record_events
    spec, key, folder = tiny
    first = _cached_events(spec.config_json, spec.name, key, 40, 3)
    assert len(list(folder.iterdir())) == 1
    _cached_events.cache_clear()
    again = _cached_events(spec.config_json, spec.name, key, 40, 3)  # read from the file, no forward
    assert again == first == _record_events(spec.config_json, spec.name, key, 40, 3)
    assert len(first) == 3 and all(first)  # the prefill and two decode steps, none empty
    _cached_events(spec.config_json, spec.name, key, 41, 3)  # another prompt: its own file
    _cached_events(spec.config_json, spec.name, key.with_(quant="bf16"), 40, 3)  # another setting: its own file
    assert len(list(folder.iterdir())) == 3


def test_damaged_file_is_recorded_again(tiny):
    from vramguard.introspect import tape_cache
    from vramguard.introspect.alloc_replay import _cached_events
    spec, key, folder = tiny
    first = _cached_events(spec.config_json, spec.name, key, 40, 3)
    (path,) = folder.iterdir()
    path.write_bytes(gzip.compress(b'{"forwards": [[[1, '))  # cut short
    assert tape_cache.read(path) is None
    _cached_events.cache_clear()
    assert _cached_events(spec.config_json, spec.name, key, 40, 3) == first
    assert tape_cache.read(path) == first  # written again


def test_turned_off_writes_nothing(tiny, monkeypatch):
    from vramguard.introspect.alloc_replay import _cached_events
    spec, key, folder = tiny
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", "off")
    assert _cached_events(spec.config_json, spec.name, key, 40, 3)
    assert not folder.exists()


def test_unwritable_folder_still_plans(tiny, monkeypatch, tmp_path):
    from vramguard.introspect.alloc_replay import _cached_events
    spec, key, _ = tiny
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("VRAMGUARD_CACHE_DIR", str(tmp_path / "file"))  # a file where the folder should be
    monkeypatch.setattr("vramguard.introspect.tape_cache._WARNED", set())
    with pytest.warns(UserWarning, match=r"tape cache folder .*file.* cannot be written.*VRAMGUARD_TAPE_CACHE"):
        assert _cached_events(spec.config_json, spec.name, key, 40, 3)
    import warnings
    with warnings.catch_warnings():  # said once per folder
        warnings.simplefilter("error")
        assert _cached_events(spec.config_json, spec.name, key, 41, 3)


def test_unreadable_recording_code_caches_nothing(tiny, monkeypatch):
    from vramguard.introspect import tape_cache
    from vramguard.introspect.alloc_replay import _cached_events
    spec, key, folder = tiny
    monkeypatch.setattr(tape_cache, "_SOURCES", ("no_such_module.py",))
    tape_cache._code_version.cache_clear()
    try:
        assert tape_cache.tape_path("x") is None
        assert _cached_events(spec.config_json, spec.name, key, 40, 3)
        assert not folder.exists()
    finally:
        tape_cache._code_version.cache_clear()


def test_a_folder_in_the_variable_keeps_the_tapes_there(tiny, monkeypatch, tmp_path):
    from vramguard.introspect.alloc_replay import _cached_events
    spec, key, default_folder = tiny
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", str(tmp_path / "mine"))
    assert _cached_events(spec.config_json, spec.name, key, 40, 3)
    assert len(list((tmp_path / "mine").glob("*.json.gz"))) == 1 and not default_folder.exists()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", "tapes")  # a relative folder, no separator: still a folder
    assert _cached_events(spec.config_json, spec.name, key, 41, 3)
    assert len(list((tmp_path / "tapes").glob("*.json.gz"))) == 1 and not default_folder.exists()


def test_a_replay_record_that_is_not_one_is_replayed_again(tiny, monkeypatch, tmp_path):
    import gzip

    from vramguard.introspect import alloc_replay, tape_cache
    from vramguard.memory.allocator import AllocatorConfig
    spec, key, folder = tiny
    s, conf = key.with_(prompt_tokens=40, max_new_tokens=3), AllocatorConfig()
    good = alloc_replay.replay_generate(spec, s, conf)
    path = tape_cache.tape_path("replay", repr(spec), s, conf, False, True)
    with gzip.open(path, "wt") as f:
        f.write("{}")  # valid JSON, not a record
    assert alloc_replay.replay_generate(spec, s, conf) == good
