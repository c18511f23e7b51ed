"""Every planned figure is the one recorded in ``tests/data/plan_snapshot.json`` (``tests/plan_snapshot.py``): the
plans of every catalog model and of the architectures of ``tests/archs.py``, to the byte. A change that moves a
figure on purpose writes the snapshot again (``python tests/plan_snapshot.py``) and says why in its commit."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import plan_snapshot  # noqa: E402

WANT = json.loads(plan_snapshot.SNAPSHOT.read_text())


@pytest.fixture(autouse=True)
def _no_plan_cache(monkeypatch):
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", "0")  # computed here, never read back from an earlier run


def test_the_snapshot_holds_every_case():
    assert sorted(WANT) == sorted(plan_snapshot.all_keys())


@pytest.mark.parametrize("key", plan_snapshot.quick_keys())
def test_the_plan_is_unchanged_to_the_byte(key):
    got = plan_snapshot.compute_case(key)
    assert plan_snapshot.differences(WANT[key], got) == []


def test_a_changed_figure_is_named():
    key = "catalog:llama-3.1-8b:default:formula"
    got = json.loads(json.dumps(WANT[key]))
    got["estimate"]["components"]["kv_cache"] += 1
    want_kv = WANT[key]["estimate"]["components"]["kv_cache"]
    assert plan_snapshot.differences(WANT[key], got) == [f".estimate.components.kv_cache: {want_kv} -> {want_kv + 1}"]
