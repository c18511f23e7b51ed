"""The card catalog: each total is what the card's driver reports, with its source; the names drivers print."""

import json
import re
from pathlib import Path

import pytest

from vramguard.catalog.gpus import GPUS, reported_gib
from vramguard.units import GiB, MiB


@pytest.mark.parametrize("name", list(GPUS))
def test_each_card_carries_a_sourced_driver_total_below_its_marketed_size(name):
    g = GPUS[name]
    # every driver keeps part of the memory (its reservation, the ECC share): CUDA's total is below the marketed size
    assert 0 < g.total_bytes < g.marketed_bytes, (name, g.total_bytes, g.marketed_bytes)
    src = g.total_source
    # a report is floored to whole MiB, unless it gives the exact bytes, which the source then quotes
    assert g.total_bytes % MiB == 0 or "measured" in src or f"{g.total_bytes:,} B" in src, (name, g.total_bytes)
    assert src and ("github.com/" in src or "measured" in src), (name, src)
    if src.startswith("no "):  # no report found: it says so, and what it planned at
        assert "planned at" in src, (name, src)
    reports = re.findall(r"'(\d+\.\d\d) GiB total capacity'", src)
    if reports:  # the figure quoted in the source is the one used, at the low end of what rounds to it
        x = float(reports[0])
        assert (x - 0.005) * GiB - MiB < g.total_bytes <= (x - 0.005) * GiB, (name, x, g.total_bytes)
    props = re.findall(r"'total_memory=(\d+)MB'", src)
    if props:  # torch prints totalGlobalMem // 2**20: the low end of that MiB
        assert g.total_bytes == int(props[0]) * MiB, (name, props[0], g.total_bytes)
    rounded = re.findall(r", (\d+)MiB\)'", src)
    if rounded:  # Ultralytics rounds total_memory / 2**20: the low end, N - 0.5 MiB, floored to N - 1 whole MiB
        assert g.total_bytes == (int(rounded[0]) - 1) * MiB, (name, rounded[0], g.total_bytes)
    exact = re.findall(r"'total_mb': (\d+\.\d+)", src)
    if exact:  # total_memory / 2**20 printed whole: those bytes exactly
        assert g.total_bytes == round(float(exact[0]) * MiB), (name, exact[0], g.total_bytes)


def test_reported_gib_takes_the_low_end_of_the_rounding():
    # 23.635 x 2**30 = 25,377,919,877.12 -> floored to 24,202 MiB
    assert reported_gib("23.64") == 24_202 * MiB == 25_377_636_352
    assert reported_gib("7.8") == reported_gib("7.80") == (1559 * GiB // 200) // MiB * MiB


def test_measured_totals():
    assert GPUS["t4"].total_bytes == 15_843_721_216  # torch total_memory on a T4
    ref = Path(__file__).resolve().parent / "data" / "h200_llama2_7b_shape.jsonl"
    versions = next(json.loads(line) for line in open(ref) if '"versions"' in line)
    assert versions["gpu"] == "NVIDIA H200" and GPUS["h200"].total_bytes == versions["total"]


def test_llama31_8b_30k_prompt_on_a_t4_is_planned_against_its_driver_total():
    from vramguard.plan import plan
    from vramguard.settings import Settings
    # the reserve formula: 1.07 GiB short of the T4's 15,843,721,216 B (with the 16 GiB of its name: "fits")
    v = plan("llama-3.1-8b", Settings(prompt_tokens=30_000), gpu="t4", alloc_conf=None).cards[0]
    assert not v.fits and v.usable_bytes == 15_843_721_216
    assert round(v.headroom_bytes / GiB, 2) == -1.07
    # the caching-allocator model (the default plan) places it, just: 0.09 GiB left, 30,060 tokens at most
    v = plan("llama-3.1-8b", Settings(prompt_tokens=30_000), gpu="t4", alloc_conf="").cards[0]
    assert v.fits and v.usable_bytes == 15_843_721_216
    assert round(v.headroom_bytes / GiB, 2) == 0.09 and v.max_prompt_tokens == 30_060


@pytest.mark.parametrize("printed,card", [
    ("Tesla T4", "t4"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-PCIE-40GB", "a100-40gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"), ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("Tesla V100-PCIE-32GB", "v100-32gb"), ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("NVIDIA RTX A6000", "rtx-a6000"),
    ("NVIDIA H200", "h200"), ("NVIDIA A10G", "a10g"), ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
    ("NVIDIA H100 NVL", "h100-nvl"), ("NVIDIA A10", "a10"), ("NVIDIA GeForce RTX 4070", "rtx-4070"),
    ("NVIDIA GeForce RTX 4070 Ti", "rtx-4070-ti"), ("NVIDIA GeForce RTX 4070 Ti SUPER", "rtx-4070-ti-super"),
    ("NVIDIA GeForce RTX 5080", "rtx-5080"), ("NVIDIA GeForce RTX 4090 D", "rtx-4090-d"),
    ("NVIDIA GeForce RTX 3080 Ti", "rtx-3080-ti"),
])
def test_names_printed_by_nvidia_smi_and_torch_are_catalog_cards(printed, card):
    from vramguard.hardware import gpu_from_catalog, resolve_gpus
    assert gpu_from_catalog(printed).name == card
    cards, why = resolve_gpus(printed)
    assert cards[0].name == card and f"{printed!r} is the catalog card {card}" in why


def test_the_cli_plans_against_a_card_named_as_torch_prints_it():
    from conftest import run_cli
    r = run_cli("plan", "llama-3.1-8b", "--quant", "nf4", "--gpu", "NVIDIA GeForce RTX 5080")
    assert r.returncode == 0, r.stderr
    out = " ".join(r.stdout.split())
    assert "is the catalog card rtx-5080 (NVIDIA GeForce RTX 5080, 16,608,395,264 B as its driver reports)" in out
    assert any(line.split()[:3] == ["RTX", "5080", "15.47"] for line in r.stdout.splitlines())  # its row: 15.47 GiB


def test_a_detected_card_takes_the_catalog_bandwidth_by_its_driver_name():
    from vramguard.hardware import _match_catalog
    g = _match_catalog("NVIDIA A100-SXM4-80GB", 85_000_000_000, (8, 0), 0)
    assert g.name == "a100-80gb" and g.bandwidth_bytes_per_s == GPUS["a100-80gb"].bandwidth_bytes_per_s
    assert g.total_bytes == 85_000_000_000 and g.source == "detected"


def test_every_card_carries_a_driver_report_and_none_is_estimated():
    # the last estimate (the RTX 4070, derived from the RTX 3060) now has a report of its own
    assert sorted(n for n, g in GPUS.items() if g.total_estimated) == []
    assert not any(g.total_source.startswith("no ") for g in GPUS.values())


def test_a_card_without_a_driver_report_is_marked_estimated_in_plan_and_list(monkeypatch):
    """A catalog card whose total is derived from a like card (none today): resolve says it is an estimate and how
    to plan exactly; --list-gpus marks its total with ~ and explains the mark."""
    from typer.testing import CliRunner
    from vramguard.catalog.gpus import GpuSpec
    from vramguard.cli import app
    from vramguard.hardware import resolve_gpus
    guess = GpuSpec("rtx-9070", "NVIDIA GeForce RTX 9070", 12_001 * MiB, (8, 9), 504 * 10**9,
                    total_source="no CUDA total found; planned at 11.72 GiB, the RTX 3060's total less 6 MiB",
                    marketed_bytes=12 * GiB, total_estimated=True)
    monkeypatch.setitem(GPUS, guess.name, guess)
    _, why = resolve_gpus("rtx-9070")
    assert "an estimate" in why and "mem_get_info" in why and f"{guess.total_bytes:,} B" in why
    _, why = resolve_gpus("rtx-4070")
    assert "as its driver reports" in why and "estimate" not in why
    out = CliRunner().invoke(app, ["plan", "--list-gpus"]).output
    rows = {line.split()[0]: line for line in out.splitlines() if line and line.split()[0] in GPUS}
    assert "~11.72 GiB" in rows["rtx-9070"] and "~" not in rows["rtx-4070"] and "~" not in rows["a10"]
    assert "~ estimated: no driver report" in out
    assert all(len(line) <= 80 for line in out.splitlines())
    monkeypatch.delitem(GPUS, guess.name)
    out = CliRunner().invoke(app, ["plan", "--list-gpus"]).output
    assert "~" not in out  # no estimated card: no mark and no footnote


def test_l4_total_is_its_reported_capacity():
    # "GPU 0 has a total capacity of 22.03 GiB" on an L4 (github.com/ArcInstitute/evo2/issues/190):
    # (2 x 2203 - 1) x 2**30 / 200 = 23,649,383,301 B -> floored to 22,553 MiB = 23,648,534,528 B
    assert GPUS["l4"].total_bytes == 22_553 * MiB == 23_648_534_528 and not GPUS["l4"].total_estimated


@pytest.mark.parametrize("name,total,where", [
    # "(GPU 0; 10.91 GiB total capacity; ...)" on a GTX 1080 Ti: (2 x 1091 - 1) x 2**30 / 200 = 11,709,154,590.7 B
    # -> floored to 11,166 MiB
    ("gtx-1080-ti", 11_166 * MiB, "ktorch/examples"),
    # total_memory=16130MB on a Tesla V100-SXM2-16GB: 16,130 x 2**20 = 16,913,530,880 B
    ("v100-16gb", 16_130 * MiB, "ultralytics/yolov3"),
    # total_memory=16049MB on an RTX 4080: 16,049 x 2**20 = 16,828,596,224 B
    ("rtx-4080", 16_049 * MiB, "brainglobe"),
    # total_memory=48676MB on an RTX A6000: 48,676 x 2**20 = 51,040,485,376 B
    ("rtx-a6000", 48_676 * MiB, "pytorch/ao"),
    # "GPU 0 has a total capacity of 23.49 GiB" on an RTX 4090, driver 575: (2 x 2349 - 1) x 2**30 / 200
    # = 25,216,826,736.6 B -> floored to 24,048 MiB (23.64 GiB with other drivers would overstate by 154 MiB)
    ("rtx-4090", 24_048 * MiB, "Sautenich/UAV-VLA/issues/7"),
    # "GPU 0 has a total capacty of 21.99 GiB" on Lambda's A10: (2 x 2199 - 1) x 2**30 / 200 = 23,606,214,000.6 B
    # -> floored to 22,512 MiB (22.18 GiB in another report: the lowest is kept)
    ("a10", 22_512 * MiB, "zai-org/CogVLM/issues/236"),
    # "GPU 0 has a total capacity of 93.00 GiB" on an H100 NVL: (2 x 9300 - 1) x 2**30 / 200 = 99,852,620,922.9 B
    # -> floored to 95,226 MiB, below its NVML total of 99,961,274,368 B as CUDA's total always is
    ("h100-nvl", 95_226 * MiB, "ali-vilab/VACE/issues/56"),
    # "GPU 0 has a total capacity of 15.55 GiB" on an RTX 4060 Ti 16GB: (2 x 1555 - 1) x 2**30 / 200
    # = 16,691,316,654.1 B -> floored to 15,918 MiB (the estimate it replaces, 15.61 GiB, overstated it by 61 MiB)
    ("rtx-4060-ti-16gb", 15_918 * MiB, "boson-ai/higgs-audio/issues/48"),
    # 'total_mb': 11864.3125 (torch total_memory / 2**20) on an RTX 4070: 12,440,633,344 B exactly (the estimate it
    # replaces, 11.72 GiB = 12,001 MiB, overstated it by 137 MiB)
    ("rtx-4070", 12_440_633_344, "korayguzel/bio-inference-bench"),
    # "(GPU 0; 11.70 GiB total capacity; ...)" on an RTX 4070 Ti: (2 x 1170 - 1) x 2**30 / 200 = 12,557,410,631.7 B
    # -> floored to 11,975 MiB
    ("rtx-4070-ti", 11_975 * MiB, "Kwai-Kolors/Kolors/issues/11"),
    # total_memory=15974MB on an RTX 4070 Ti SUPER: 15,974 x 2**20 = 16,749,953,024 B
    ("rtx-4070-ti-super", 15_974 * MiB, "mathisweil/minihack-ReMDM-planner"),
    # Ultralytics' "CUDA:0 (NVIDIA GeForce RTX 5080, 15840MiB)" rounds total_memory / 2**20: at least 15,839.5 MiB,
    # floored to 15,839 MiB = 16,608,395,264 B
    ("rtx-5080", 15_839 * MiB, "neoluxis/anti-detr-x"),
    # "CUDA:0 (NVIDIA GeForce RTX 4090 D, 24111MiB)": 24,110 MiB = 25,281,167,360 B (62 MiB above the RTX 4090's
    # 23.49 GiB with driver 575: the same AD102 memory, another driver)
    ("rtx-4090-d", 24_110 * MiB, "Vaenix/CVLearning"),
    # YOLOv5's "CUDA:0 (NVIDIA GeForce RTX 3080 Ti, 12054MiB)" on driver 515.48.07: 12,053 MiB = 12,638,486,528 B
    ("rtx-3080-ti", 12_053 * MiB, "UnderOC/CS4302YOLO-Project"),
])
def test_cards_found_this_time_carry_their_own_driver_report(name, total, where):
    g = GPUS[name]
    assert g.total_bytes == total and not g.total_estimated and where in g.total_source


@pytest.mark.parametrize("printed,sizes,listed", [
    ("NVIDIA GeForce RTX 4060 Ti", "8 GB and 16 GB", "rtx-4060-ti-16gb; not in the catalog: the 8 GB rtx-4060-ti"),
    ("NVIDIA GeForce RTX 3060", "8 GB and 12 GB", "rtx-3060-12gb; not in the catalog: the 8 GB rtx-3060"),
    ("NVIDIA GeForce RTX 3080", "10 GB and 12 GB", "rtx-3080-10gb; not in the catalog: the 12 GB rtx-3080"),
    ("3060", "8 GB and 12 GB", "rtx-3060-12gb; not in the catalog: the 8 GB rtx-3060"),
    ("4060-ti", "8 GB and 16 GB", "rtx-4060-ti-16gb; not in the catalog: the 8 GB rtx-4060-ti"),
    ("rtx4060ti", "8 GB and 16 GB", "rtx-4060-ti-16gb; not in the catalog: the 8 GB rtx-4060-ti"),
    ("NVIDIA A100-PCIE", "40 GB and 80 GB", "a100-40gb, a100-80gb"),
    ("rtx-2060", "6 GB and 12 GB", "no catalog card; not in the catalog: the 6 GB and 12 GB rtx-2060"),
])
def test_a_name_sold_with_several_memory_sizes_is_refused_with_the_sizes(printed, sizes, listed):
    """nvidia-smi prints "NVIDIA GeForce RTX 4060 Ti" for the 8 GB card and the 16 GB one: the name alone picks
    neither; the error lists the sizes, the catalog cards of them, and the nvidia-smi query that tells."""
    from vramguard.errors import UnknownGpu
    from vramguard.hardware import gpu_from_catalog
    with pytest.raises(UnknownGpu) as e:
        gpu_from_catalog(printed)
    assert e.value.accepted == listed
    assert f"is sold with {sizes} under one name" in e.value.fix
    assert "nvidia-smi --query-gpu=name,memory.total --format=csv" in e.value.fix


@pytest.mark.parametrize("printed,card", [
    ("NVIDIA GeForce RTX 4060 Ti 16GB", "rtx-4060-ti-16gb"), ("rtx-4060-ti-16g", "rtx-4060-ti-16gb"),
    ("rtx-3060-12gb", "rtx-3060-12gb"), ("NVIDIA GeForce RTX 3060 12GB", "rtx-3060-12gb"),
    ("rtx-3080-10gb", "rtx-3080-10gb"), ("NVIDIA A100 80GB PCIe", "a100-80gb"), ("rtx-4060", "rtx-4060"),
])
def test_a_name_with_its_memory_size_picks_that_card(printed, card):
    from vramguard.hardware import gpu_from_catalog
    assert gpu_from_catalog(printed).name == card


def test_a_size_the_catalog_lacks_is_refused_with_the_way_to_plan_it():
    from vramguard.errors import UnknownGpu
    from vramguard.hardware import gpu_from_catalog
    with pytest.raises(UnknownGpu) as e:
        gpu_from_catalog("NVIDIA GeForce RTX 4060 Ti 8GB")
    assert "the 8 GB rtx-4060-ti is not in the catalog" in e.value.fix and "vram=" in e.value.fix
    with pytest.raises(UnknownGpu) as e:
        gpu_from_catalog("a100-24gb")
    assert "(a100 is sold with 40 GB and 80 GB)" in e.value.fix


def test_the_several_sizes_table_agrees_with_the_catalog():
    """Each catalog card of a name sold with several sizes is listed under its marketed size, and every card the
    table names is in the catalog with that size."""
    from vramguard.catalog.gpus import SEVERAL_MEMORY_SIZES
    from vramguard.hardware import _sizes_of
    for family, sizes in SEVERAL_MEMORY_SIZES.items():
        assert len(sizes) >= 2, family
        for gb, key in sizes.items():
            assert key is None or GPUS[key].marketed_bytes == gb * GiB, (family, gb, key)
    for name, g in GPUS.items():
        found = _sizes_of(name)
        if found is not None:
            assert found[1][g.marketed_bytes // GiB] == name and found[2] == g.marketed_bytes // GiB


def test_a_detected_card_of_a_several_sizes_name_is_told_by_its_total():
    """A detected "NVIDIA GeForce RTX 4060 Ti" of 16,7xx MiB is the 16 GB card (its bandwidth, 288 GB/s); one of
    8,188 MiB is the 8 GB card, which the catalog lacks: no bandwidth, its own total."""
    from vramguard.hardware import _match_catalog
    big = _match_catalog("NVIDIA GeForce RTX 4060 Ti", 16_380 * MiB, (8, 9), 0)
    assert big.name == "rtx-4060-ti-16gb" and big.bandwidth_bytes_per_s == 288 * 10**9
    assert big.total_bytes == 16_380 * MiB and big.source == "detected"
    small = _match_catalog("NVIDIA GeForce RTX 4060 Ti", 8_188 * MiB, (8, 9), 0)
    assert small.name == "rtx-4060-ti" and small.bandwidth_bytes_per_s is None


def test_the_cli_refuses_an_ambiguous_card_name_with_the_query_that_tells():
    from conftest import run_cli
    r = run_cli("plan", "llama-3.1-8b", "--gpu", "NVIDIA GeForce RTX 4060 Ti")
    assert r.returncode == 3 and not r.stdout.strip()
    err = " ".join(r.stderr.split())
    assert "error --gpu: 'NVIDIA GeForce RTX 4060 Ti' is not valid" in err
    assert "nvidia-smi --query-gpu=name,memory.total --format=csv" in err
    assert "e.g. --gpu rtx-4060-ti-16gb, or pass its total as --vram" in err


@pytest.mark.parametrize("typed,meant", [("rtx4900", ["rtx-4090", "rtx-4080"]), ("h2000", ["h200"]),
                                         ("l40x", ["l40s"]), ("foo", [])])
def test_an_unknown_card_name_says_which_catalog_card_was_meant(typed, meant):
    from vramguard.errors import UnknownGpu
    from vramguard.hardware import gpu_from_catalog
    with pytest.raises(UnknownGpu) as e:
        gpu_from_catalog(typed)
    assert (f"did you mean {' or '.join(meant)}?" in e.value.fix) if meant else "did you mean" not in e.value.fix


@pytest.mark.parametrize("typed,meant", [("lama-3.1-8b", "llama-3.1-8b"), ("qwen25-7b", "qwen2.5-7b"),
                                         ("gema-2-9b", "gemma-2-9b"), ("mixtral-8x7", "mixtral-8x7b"),
                                         ("llama-3.1-405b", None), ("gemma-3-12b", None), ("gpt-oss-20b", None)])
def test_an_unknown_model_name_says_which_catalog_name_was_meant_never_another_size(typed, meant):
    """A typo of a catalog name is named; a real model the catalog lacks (another size or generation: different
    digits) is never called a typo of a catalog model."""
    from vramguard.errors import UnknownModel
    from vramguard.resolve import resolve_model
    with pytest.raises(UnknownModel) as e:
        resolve_model(typed)
    assert (f"did you mean {meant}?" in e.value.fix) if meant else ("did you mean" not in e.value.fix), e.value.fix
