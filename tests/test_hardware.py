"""Which card a plan targets: detected (forced through the override hook), named, sized, or the defaults."""

import pytest

from vramguard import hardware
from vramguard.catalog.gpus import GPUS, GpuSpec
from vramguard.errors import InvalidValue, UnknownGpu
from vramguard.plan import plan
from vramguard.settings import Settings
from vramguard.units import GiB


def test_catalog_has_15_cards_with_capability():
    assert len(GPUS) >= 15
    assert all(g.compute_capability and g.total_bytes > 0 for g in GPUS.values())
    assert GPUS["t4"].compute_capability == (7, 5) and GPUS["rtx-4090"].total_bytes < 24 * GiB


def test_detected_gpu_is_planned_against_with_other_processes_subtracted(monkeypatch):
    card = GpuSpec("rtx-3090", "NVIDIA GeForce RTX 3090", 24 * GiB, (8, 6), None, 2 * GiB, "detected")
    monkeypatch.setattr(hardware, "DETECT_OVERRIDE", lambda: hardware.DetectedGpus((card,), "1 GPU(s) found"))
    p = plan("llama-2-7b", Settings(), solve=False)
    assert len(p.cards) == 1 and p.cards[0].usable_bytes == 22 * GiB
    assert p.cards_reason.startswith("detected")


def test_no_gpu_plans_against_common_sizes():
    p = plan("llama-2-7b", Settings(), solve=False)
    assert [c.gpu.total_bytes for c in p.cards] == [8 * GiB, 12 * GiB, 16 * GiB, 24 * GiB]
    assert "no GPU detected" in p.cards_reason


def test_named_and_sized_cards():
    assert hardware.gpu_from_catalog("NVIDIA GeForce RTX 4090").name == "rtx-4090"
    assert hardware.gpu_from_catalog("4090").name == "rtx-4090"
    assert hardware.gpu_from_vram("24000MiB").total_bytes == 24000 * 2**20
    with pytest.raises(UnknownGpu) as e:
        hardware.gpu_from_catalog("rtx-9999")
    assert "rtx-4090" in str(e.value)
    assert hardware.gpu_from_catalog("rtx4090").name == "rtx-4090"  # hyphens optional
    assert hardware.gpu_from_catalog("a100-40").name == "a100-40gb"  # the start of one name
    for short, sizes in (("a100", "a100-40gb, a100-80gb"), ("v100", "v100-16gb, v100-32gb")):
        with pytest.raises(UnknownGpu) as e:  # two memory sizes: never one picked silently
            hardware.gpu_from_catalog(short)
        assert e.value.accepted == sizes and "name one of them" in e.value.fix
    with pytest.raises(InvalidValue):
        hardware.resolve_gpus("t4", "16GiB")


def test_real_detection_without_driver_returns_a_reason(monkeypatch):
    monkeypatch.setattr(hardware, "DETECT_OVERRIDE", None)
    det = hardware.detect_gpus()
    if det.gpus:
        pytest.skip("this machine has an NVIDIA GPU")
    assert det.reason and ("NVML" in det.reason or "nvidia-ml-py" in det.reason)


def test_a_card_smaller_than_any_gpu_is_a_unit_mistyped():
    """``--vram 1B`` is one byte: refused with the unit it likely meant, never planned as a card."""
    gpu_from_vram, MIN_CARD_BYTES = hardware.gpu_from_vram, hardware.MIN_CARD_BYTES
    with pytest.raises(InvalidValue) as e:
        gpu_from_vram("1B")
    assert "at least 1 MiB" in e.value.accepted and e.value.fix.endswith("e.g. 1GiB")
    with pytest.raises(InvalidValue) as e:
        gpu_from_vram("512KiB")
    assert e.value.fix.endswith("e.g. 24GiB")
    assert gpu_from_vram("1MiB").total_bytes == MIN_CARD_BYTES  # tiny test cards of tiny models are kept
