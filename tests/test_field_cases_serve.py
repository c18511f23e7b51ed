"""Field cases of shared/cases/field-cases.md on the generation and serving paths (CPU, tiny random models).

C8 (logits for every prompt position): the planner and the serving pool plan assume that ``generate`` and the
serving engine compute logits for the last position of each sequence only (``logits_to_keep``), never for every
prompt position (a 8,192-token Llama-3-8B prompt would otherwise add 1.957 GiB of bf16 logits and a 3.914 GiB
float32 copy). These tests watch the ``lm_head`` of the real model while vramguard's own generation strategies,
its graph decoder (eager on the CPU) and its continuous-batching server run, and check that every call sees one
row per sequence, as the plan counts.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from conftest import concurrently, save_tiny_llama

from vramguard.run import generate as G
from vramguard.memory.forward import logits_bytes
from vramguard.plan import estimate, plan
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.spec import spec_from_config
from vramguard.units import GiB, MiB
from vramguard.plan.choice import choose

VOCAB = 300
CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=VOCAB, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2)
LONG_PROMPT = [1] + [3 + (i * 7) % 290 for i in range(599)]  # 600 tokens: two 512-token prefill chunks


@pytest.fixture(scope="module")
def model():
    import transformers
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**CFG)).eval()


class _LmHeadRows:
    """Records, for every call of ``lm_head``, how many positions (rows) it computed logits for."""

    def __init__(self, model):
        self.rows: list[int] = []
        self._h = model.get_output_embeddings().register_forward_hook(self._hook)

    def _hook(self, _m, args, out):
        self.rows.append(int(out.reshape(-1, out.shape[-1]).shape[0]))

    def close(self):
        self._h.remove()


def _oom_before(k):
    """Injector: out of memory at the prefill of every attempt before ``k``, so attempt ``k`` runs to the end."""
    def inj(phase, attempt, step):
        if attempt < k and phase == "prefill":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
    return inj


def test_c8_the_plan_counts_last_position_logits_for_generate():
    """C8 values on the planner side that the generation paths below must honour: 8,192 x 128,256 x 2 B =
    1.957 GiB plus a 3.914 GiB float32 copy for every position, 0.49 MiB for the last one (generate)."""
    spec = resolve_model("llama-3-8b")
    native, fp32 = logits_bytes(spec, 1, 8192, "bf16")
    assert native == 8192 * 128_256 * 2 and round(native / GiB, 3) == 1.957 and round(fp32 / GiB, 3) == 3.914
    assert round(logits_bytes(spec, 1, 1, "bf16")[1] / MiB, 2) == 0.49
    p = plan(spec, Settings(prompt_tokens=8191, max_new_tokens=1), vram="80GiB", solve=False)
    assert p.logits_case.startswith("last position only")
    # the preflight of guarded generation plans every strategy with the same last-position logits
    for st in G.STRATEGIES:
        est = estimate(choose(spec).model, Settings(prompt_tokens=8191, max_new_tokens=1).with_(**st.plan))
        assert est.components.get("logits", 0) < MiB, st.name


@pytest.mark.parametrize("k", range(len([s for s in G.STRATEGIES if s.available(False)[0]])))
def test_c8_every_cpu_strategy_of_guarded_generate_keeps_one_logit_row(model, k):
    """C8 on vramguard.run.generate: whichever strategy finishes (dynamic, chunked prefill 2048, static cache + chunked
    prefill 512, ...), lm_head computes one row per forward, never one per prompt position (600 here)."""
    names = [s.name for s in G.STRATEGIES if s.available(False)[0]]
    G.OOM_INJECTOR = _oom_before(k)
    tap = _LmHeadRows(model)
    try:
        r = G.generate(model, None, LONG_PROMPT, 6)
    finally:
        tap.close()
    assert r.strategy == names[k] and len(r.token_ids) == 6
    assert tap.rows and max(tap.rows) == 1, (names[k], sorted(set(tap.rows)))
    # the plan the preflight used for this model counted the same: one row, float32 copy included
    spec = spec_from_config(model.config.to_dict(), name="tiny")
    assert logits_bytes(spec, 1, 1, "fp32")[1] == VOCAB * 4


def test_c8_fast_decode_prefill_keeps_one_logit_row(model):
    """C8 on the graph strategies (eager on the CPU): the prefill, in one forward or in chunks, asks
    logits_to_keep=1."""
    from vramguard.run.fastdecode import graph_decode
    tap = _LmHeadRows(model)
    try:
        r = G.generate(model, None, LONG_PROMPT, 6, fast_decode=True)
        one = list(tap.rows)
        chunked = graph_decode(model, LONG_PROMPT, 6, prefill_chunk_tokens=512, eos_token_id=None)
    finally:
        tap.close()
    assert r.strategy == G.GRAPH_STRATEGY.name and r.decode_mode == "eager" and len(r.token_ids) == 6
    # one prefill forward of 600 tokens, then 5 decode steps, each one row
    assert one == [1] * (1 + 5)
    # 600 prompt tokens in 512-token chunks: 2 prefill forwards, then 5 decode steps, each one row
    assert len(chunked.token_ids) == 6 and tap.rows[len(one):] == [1] * (2 + 5)


# ---------------------------------------------------------------------------------------------- serving
def _save(folder: Path) -> Path:
    return save_tiny_llama(folder, **{**CFG, "max_position_embeddings": 512})


def test_c8_serving_engine_computes_one_logit_row_per_request(tmp_path):
    """C8 on vramguard serve: a step of continuous batching computes logits for one position per request in the
    step (what the pool plan charges: max_requests x vocab x 34 B), never for every prompt token. Three requests
    of 100-token prompts go through 64-token steps together."""
    from vramguard.serve.pool import LOGIT_ROW_BYTES_PER_VOCAB
    from vramguard.serve.server import build
    s = build(str(_save(tmp_path / "tiny")), quant="fp32", page_size=16, max_batch_tokens=64, max_running=4,
              max_queue=4, max_kv_blocks=40, verify=False, served_name="tiny")
    e = s.engine
    steps: list[tuple[int, ...]] = []
    e.before_step = lambda index, ids: steps.append(tuple(ids))
    tap = _LmHeadRows(e.model)
    url = s.start_background()
    try:
        prompts = [[1] + [3 + (i + j) % 290 for j in range(99)] for i in range(3)]
        out = [None] * 3

        def one(i):
            out[i] = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompts[i],
                                                               "max_tokens": 8, "temperature": 0,
                                                               "ignore_eos": True}, timeout=60)

        concurrently(one, 3, 60)
        assert [o.status_code for o in out] == [200, 200, 200]
        assert all(o.json()["usage"]["completion_tokens"] == 8 for o in out)
    finally:
        e.before_step = None
        tap.close()
        s.stop()
    assert tap.rows and steps
    # one logit row per request of a step: at most max_running, far below the 64 tokens a step computes
    assert max(tap.rows) <= s.pool.max_requests == 4
    assert max(tap.rows) <= max(len(ids) for ids in steps)
    assert s.pool.step_peak_bytes >= s.pool.max_requests * VOCAB * LOGIT_ROW_BYTES_PER_VOCAB


def test_c1_serve_replaces_a_flash_attention_2_request_that_cannot_run(tmp_path):
    """C1 on vramguard serve: FlashAttention-2 asked for where it cannot run (here: no flash_attn package, no
    CUDA card). The load must not succeed with FA2 only for the first request to crash in its kernel: the loader
    replaces it by sdpa, says so, and the first request completes."""
    from vramguard.serve.server import build
    with pytest.warns(UserWarning, match="attn: flash_attention_2 -> sdpa"):
        s = build(str(_save(tmp_path / "tiny")), quant="fp32", attn="flash_attention_2", page_size=16,
                  max_batch_tokens=64, max_running=2, max_queue=2, max_kv_blocks=20, verify=False,
                  served_name="tiny")
    url = s.start_background()
    try:
        assert s.report.active["attn"] != "flash_attention_2"
        assert any("attn: flash_attention_2 -> sdpa" in o and "flash_attn package is not installed" in o
                   for o in s.report.overrides)
        assert "flash_attention_2" not in (s.engine.attn_implementation or "")
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 5, 6, 7], "max_tokens": 4,
                                                      "temperature": 0, "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
    finally:
        s.stop()
