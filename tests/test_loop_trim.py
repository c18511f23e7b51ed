"""A reference mixer's loop over chunks is replayed until it repeats (vramguard.introspect.loop_trim): the plan is the
one every iteration gives, to the byte, and a loop that does not repeat runs whole."""

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from archs import ARCHS

from vramguard.introspect import loop_trim
from vramguard.introspect.loop_trim import steady
from vramguard.introspect.tracker import StorageTracker

META = "meta"


def _scan(x, chunk: int = 8):
    """A scan in the reference rule's shape: a preallocated output, per chunk a few products and a new state."""
    n = x.shape[0] // chunk
    out = torch.zeros_like(x)
    state = torch.zeros(x.shape[1], x.shape[1], device=x.device)
    for i in range(n):
        part = x[i * chunk:(i + 1) * chunk]
        read = part @ state
        out[i * chunk:(i + 1) * chunk] = read + part
        state = state * 0.5 + part.transpose(0, 1) @ read
    return out, state


def _growing(x, chunk: int = 8):
    """A loop whose iterations keep what they make (a list concatenated after it): its memory grows each time."""
    parts = []
    chunks = range(x.shape[0] // chunk)
    for i in chunks:
        parts.append(x[i * chunk:(i + 1) * chunk] * 2)
    return torch.cat(parts), [i for i in range(x.shape[0])], len(chunks), chunks[-1]


def _traced(fn, *args):
    with StorageTracker() as t:
        out = fn(*args)
    return t, out


def test_a_steady_loop_runs_until_it_repeats_and_reaches_the_full_loops_peak():
    x = torch.empty(8 * 100, 32, device=META)
    before = loop_trim.SKIPPED[0]
    full, (out_full, state_full) = _traced(_scan, x)
    trimmed, (out, state) = _traced(steady(_scan), x)
    skipped = loop_trim.SKIPPED[0] - before
    assert skipped == 100 - (loop_trim.FIRST + loop_trim.ALIKE)  # iterations 0-3 ran, 96 left out
    assert trimmed.peak.bytes == full.peak.bytes > 0
    assert trimmed.largest_alloc == full.largest_alloc
    assert (out.shape, state.shape) == (out_full.shape, state_full.shape)
    full_allocs = sum(n >= 0 for _, n in full.log_since(0))
    assert sum(n >= 0 for _, n in trimmed.log_since(0)) == full_allocs - skipped * 5  # 5 tensors an iteration


def test_a_loop_that_keeps_what_it_makes_and_a_range_that_is_no_loop_run_whole():
    x = torch.empty(8 * 50, 16, device=META)
    before = loop_trim.SKIPPED[0]
    full, (cat_full, idx_full, *asked_full) = _traced(_growing, x)
    trimmed, (cat, idx, *asked) = _traced(steady(_growing), x)
    assert loop_trim.SKIPPED[0] == before
    assert cat.shape == cat_full.shape == (400, 16) and idx == idx_full == list(range(400))
    assert asked == asked_full == [50, 49]  # what else is asked of a range: the whole range's answer
    assert trimmed.peak.bytes == full.peak.bytes


def test_without_a_tracker_every_iteration_runs():
    x = torch.empty(8 * 20, 8, device=META)
    before = loop_trim.SKIPPED[0]
    steady(_scan)(x)
    assert loop_trim.SKIPPED[0] == before


def _gated_delta_rules() -> list:
    """transformers' reference gated delta rules (every modeling module that defines one), as their modules name
    them; the wrapper transformers puts around each (its kernel fallback) is left."""
    import importlib
    import pkgutil

    import transformers.models as models
    from vramguard.introspect.mixers import _wrapped
    found = []
    for m in pkgutil.iter_modules(models.__path__):
        try:
            module = importlib.import_module(f"transformers.models.{m.name}.modeling_{m.name}")
        except Exception:  # noqa: BLE001 - no modeling module, or one that needs another package
            continue
        fn = getattr(module, "torch_chunk_gated_delta_rule", None)
        if fn is not None:
            state = _wrapped(fn)
            found.append(pytest.param(state["torch_function"] if state else fn, id=m.name))
    return found


@pytest.mark.parametrize("rule", _gated_delta_rules())
def test_every_reference_gated_delta_rule_keeps_its_peak_with_the_loop_trimmed(rule):
    tokens, heads, dk, dv = 64 * 40 + 17, 4, 16, 32
    q, k = (torch.empty(1, tokens, 2, dk, dtype=torch.bfloat16, device=META) for _ in range(2))
    v = torch.empty(1, tokens, heads, dv, dtype=torch.bfloat16, device=META)
    g, beta = (torch.empty(1, tokens, heads, dtype=torch.bfloat16, device=META) for _ in range(2))
    kwargs = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    before = loop_trim.SKIPPED[0]
    full, (o_full, s_full) = _traced(lambda: rule(q, k, v, g=g, beta=beta, **kwargs))
    trimmed, (o, s) = _traced(lambda: steady(rule)(q, k, v, g=g, beta=beta, **kwargs))
    assert loop_trim.SKIPPED[0] - before == 41 - loop_trim.FIRST - loop_trim.ALIKE  # 41 chunks of 64
    assert trimmed.peak.bytes == full.peak.bytes and trimmed.peak.by_label == full.peak.by_label
    assert (o.shape, o.dtype, s.shape, s.dtype) == (o_full.shape, o_full.dtype, s_full.shape, s_full.dtype)


def _plan(folder, trim: bool, *args) -> subprocess.Popen:
    """``vramguard plan`` started in a new process with no plan or tape kept (with ``trim`` False: every iteration of
    every loop replayed)."""
    how = "atexit.register(lambda: print('left out', t.SKIPPED[0], file=sys.stderr))" if trim else \
        "setattr(t, 'steady', lambda fn: fn)"
    code = f"import atexit, sys; import vramguard.introspect.loop_trim as t; {how}; from vramguard.cli import main; " \
        "sys.argv = ['vramguard'] + sys.argv[1:]; main()"
    env = {**os.environ, "VRAMGUARD_PLAN_CACHE": "0", "VRAMGUARD_TAPE_CACHE": "0"}
    return subprocess.Popen([sys.executable, "-c", code, "plan", str(folder), *args, "--format", "json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _json(p: subprocess.Popen) -> tuple[dict, str]:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    return json.loads(out), err


def test_a_qwen3_next_plan_is_the_same_with_the_loop_trimmed(tmp_path):
    from transformers import AutoConfig
    AutoConfig.for_model("qwen3_next", **dict(ARCHS["qwen3_next"], max_position_embeddings=1024)) \
        .save_pretrained(tmp_path)
    args = ("--prompt-tokens", "700", "--max-new-tokens", "8", "--batch", "2", "--vram", "812MiB", "--kernels", "torch")
    trimmed, full = _plan(tmp_path, True, *args), _plan(tmp_path, False, *args)  # side by side
    (trimmed, said), (full, _) = _json(trimmed), _json(full)
    assert trimmed == full
    assert int(said.split("left out ")[1].split()[0]) > 100  # iterations the trimmed plan's replays left out
    card = trimmed["cards"][0]  # a search over the prompt, through lengths of many chunks of 64 tokens
    assert trimmed["kernel_path"]["replayed"] == "torch" and 64 * 5 < card["max_prompt_tokens"] < 1024 - 8


def test_a_loop_scan_pads_to_its_functions_chunk_and_is_periodic_past_the_loops_full_chunks():
    """Qwen3-Next's chunk is no config field: it is ``torch_chunk_gated_delta_rule``'s ``chunk_size`` default (64),
    and its replays are one polynomial only from the length at which the loop is cut (FIRST + ALIKE + 1 chunks:
    shorter loops are replayed whole, so their tapes differ in structure); Mamba-2's field chunk from two chunks."""
    from transformers import AutoConfig

    from vramguard.introspect import stretch
    assert stretch.LOOP_FULL_CHUNKS == loop_trim.FIRST + loop_trim.ALIKE + 1
    qwen = AutoConfig.for_model("qwen3_next", **ARCHS["qwen3_next"])
    assert stretch.chunk_period(qwen) == 64 and stretch.first_periodic(qwen, 64) == 5 * 64 + 1
    falcon = AutoConfig.for_model("falcon_h1")  # the class defaults: mamba_chunk_size
    p = stretch.chunk_period(falcon)
    assert p == falcon.mamba_chunk_size and stretch.first_periodic(falcon, p) == 2 * p + 1
    assert stretch.chunk_period(AutoConfig.for_model("llama")) is None
