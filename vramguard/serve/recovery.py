"""What the engine loop does when an iteration raises (see :mod:`vramguard.serve.engine` for the rules). Runs in
the engine thread, on the scheduler of transformers' continuous batching; knows nothing about HTTP.

Every function takes the :class:`~vramguard.serve.engine.Engine` (its handles, counters and isolation state), the
manager and its batch processor ``bp``.
"""

from __future__ import annotations

import gc
import itertools
import logging

from vramguard.serve.faults import MAX_FAILURES_IN_A_ROW, MAX_OOM_RETRIES, MAX_STEP_FAILURES, _first_line

log = logging.getLogger("vramguard.serve")

EVENTS_KEPT = 256
_PROBES = itertools.count()


def step_states(bp) -> list:
    """The request states of the step that failed, taken off the batch (so they are never updated): the step's own
    when its batch was prepared, else every active and waiting request (a failure before the batch existed)."""
    io = bp.inputs_and_outputs
    states = [fs.state for fs in getattr(io, "requests_in_batch", [])]
    if not states:
        sched = bp.scheduler
        states = list(sched.active_requests.values()) + list(sched.waiting_requests.values())
    try:
        io.requests_in_batch = []
    except AttributeError:
        pass
    sched = bp.scheduler
    return [st for st in states if st.request_id in sched.active_requests or st.request_id in sched.waiting_requests]


def unschedule(sched, rid: str) -> None:
    """Take a request out of the scheduler and give back its KV blocks."""
    sched.finish_request(rid)
    sched.waiting_requests.pop(rid, None)
    if rid in sched.waiting_requests_order:
        sched.waiting_requests_order.remove(rid)


def requeue(sched, st, front: bool) -> None:
    """Queue an unscheduled request again as "prompt + tokens so far" (the engine's soft reset)."""
    sched.add_waiting_request(st.create_equivalent_initial_request())
    if front:
        sched.waiting_requests_order.remove(st.request_id)
        sched.waiting_requests_order.appendleft(st.request_id)


def fail(engine, bp, st, message: str, code: str | None = None) -> None:
    """End one unscheduled request with ``message`` (its client gets the error; ``code`` names it for the API)."""
    h = engine.handles.get(st.request_id)
    if h is not None and code is not None:
        h.error_code = code
    bp.output_router.fail_and_deliver(st, RuntimeError(message))


def _keep(events: list, event: dict) -> None:
    events.append(event)
    del events[:-EVENTS_KEPT]


def on_oom(engine, manager, bp, error: BaseException) -> None:
    """An out-of-memory error inside a step: requeue its requests at the front, halve the step budget. A request
    is charged a retry only when it ran alone (companions are not to blame for a batch's size), and its count
    starts again once it produced a token (:func:`after_step`): it fails after ``MAX_OOM_RETRIES`` in a row. A
    batch that runs out of memory at the smallest budget is isolated (one request per step), so that one is found."""
    import torch
    sched = bp.scheduler
    requeued, failed = [], []
    states = step_states(bp)
    alone = len(states) == 1  # only a request that ran out of memory alone is charged for it
    for st in reversed(states):  # reversed: appendleft keeps the step's order at the front
        rid = st.request_id
        unschedule(sched, rid)
        h = engine.handles.get(rid)
        retries = ((h.retries + 1) if alone else h.retries) if h else MAX_OOM_RETRIES + 1
        if h:
            h.retries = retries
        if retries > MAX_OOM_RETRIES:
            fail(engine, bp, st, f"out of memory {retries} times while computing this request; the server's "
                                 "budget leaves too little room for it: send a shorter prompt or fewer max_tokens")
            failed.append(rid)
            continue
        requeue(sched, st, front=True)
        requeued.append(rid)
    old = bp.max_batch_tokens
    bp.max_batch_tokens = max(engine.pool.page_size, old // 2)
    if len(requeued) > 1 and old == bp.max_batch_tokens:  # the budget is at its floor: run them one at a time, so
        _isolate(engine, sched, requeued)                   # the one that cannot fit is found and charged alone
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    engine.oom_recoveries += 1
    engine._steps_since_oom = 0
    event = {"step": getattr(manager, "current_batch", None), "error": str(error).splitlines()[0][:200],
             "requeued": requeued[::-1], "failed": failed, "max_batch_tokens": [old, bp.max_batch_tokens]}
    _keep(engine.oom_events, event)
    log.warning("out of memory in step %s: %d request(s) requeued, %d failed; max_batch_tokens %d -> %d",
                event["step"], len(requeued), len(failed), old, bp.max_batch_tokens)
    if engine.metrics is not None:
        engine.metrics.oom_recoveries.inc()


def on_step_failure(engine, manager, bp, error: BaseException) -> None:
    """Any other error inside an iteration: fail the request that is to blame, or isolate the step's requests.
    A failure with requests in the step is theirs and never counts toward the engine's own fault; after
    ``MAX_FAILURES_IN_A_ROW`` such failures without a good step, a known-good request (:func:`add_probe`) is
    queued, and its failing alone is the engine's fault.

    Raises:
        the error itself when it recurs ``MAX_FAILURES_IN_A_ROW`` times with no request in the step, or when the
        known-good probe fails alone (a broken engine, not a request: the caller's fatal path takes it).
    """
    sched = bp.scheduler
    states = step_states(bp)
    if not states or (len(states) == 1 and states[0].request_id == engine._probe_id):
        engine._failures_in_a_row += 1
        if engine._failures_in_a_row > MAX_FAILURES_IN_A_ROW or states:
            raise error
    else:
        engine._charged_in_a_row += 1
        if engine._charged_in_a_row >= MAX_FAILURES_IN_A_ROW and engine._probe_id is None:
            add_probe(engine, manager)
    why = _first_line(error)
    probing = engine.probing  # read before the requests fail: the prober stops probing once its request ends
    if probing:
        engine.probe_error = why
    failed, requeued = [], []
    for st in reversed(states):
        rid = st.request_id
        h = engine.handles.get(rid)
        n = (h.step_failures + 1) if h else 1 if rid == engine._probe_id else MAX_STEP_FAILURES
        if h:
            h.step_failures = n
        unschedule(sched, rid)
        engine._suspects.discard(rid)
        if len(states) == 1 or n >= MAX_STEP_FAILURES:
            alone = "alone" if len(states) == 1 else f"in {n} failed steps"
            fail(engine, bp, st, f"the engine could not compute this request ({alone}): {why}; the other requests "
                                 "went on. Send it again with other sampling values, or report it with its body",
                 code="request_failed")
            failed.append(rid)
        else:
            requeue(sched, st, front=True)
            requeued.append(rid)
    if requeued:
        _isolate(engine, sched, requeued)
    elif not engine._suspects:
        _end_isolation(engine, sched)
    event = {"step": getattr(manager, "current_batch", None), "error": why, "failed": failed,
             "isolating": requeued[::-1]}
    _keep(engine.step_failure_events, event)
    # the start's probe failing says the engine cannot run the model: the caller reports that (refusal or fallback)
    log.log(logging.DEBUG if probing else logging.WARNING,
            "step %s failed (%s): %d request(s) failed, %d isolated to run one per step", event["step"], why,
            len(failed), len(requeued))
    if engine.metrics is not None:
        engine.metrics.step_failures.inc()


def _isolate(engine, sched, suspects: list[str]) -> None:
    """One request per step, suspects first. Active requests that were not in the failed step are soft-reset
    behind them (they keep their tokens), so that no running request takes the single slot before the suspects."""
    if engine._batch_limit is None:
        engine._batch_limit = sched.max_requests_per_batch
    engine._suspects.update(suspects)
    sched.max_requests_per_batch = 1
    for rid, st in list(sched.active_requests.items()):
        if rid not in engine._suspects:
            unschedule(sched, rid)
            requeue(sched, st, front=False)


def _end_isolation(engine, sched) -> None:
    if engine._batch_limit is not None:
        sched.max_requests_per_batch = engine._batch_limit
        engine._batch_limit = None
        log.info("isolation over: %d request(s) per step again", sched.max_requests_per_batch)


PROBE_PROMPT_TOKENS = 2  # the probe is the start's check request: two tokens of id 1, one greedy new token


def add_probe(engine, manager) -> None:
    """Queue the known-good request (the two-token greedy request every engine ran at its start) to tell a
    broken engine from a run of bad requests: it fails alone only when the engine itself is broken. No client
    waits for it: its one output goes to the manager's own queue."""
    engine._probe_id = f"vg-probe-{next(_PROBES)}"
    engine.probes += 1
    manager.add_request([min(1, engine.vocab_size - 1)] * PROBE_PROMPT_TOKENS, request_id=engine._probe_id,
                        max_new_tokens=1, streaming=False)
    log.warning("%d failed steps in a row, each charged to its requests: a known-good request is queued to check "
                "the engine", engine._charged_in_a_row)


def after_step(engine, bp) -> None:
    """After a good iteration: reset the failure counts; while isolating, clear each suspect that produced a
    token alone (queued again behind the others, so the next suspect runs), and end isolation when none is left.
    The probe is over once it produced its token."""
    engine._failures_in_a_row = 0
    in_batch = list(getattr(bp.inputs_and_outputs, "requests_in_batch", []))
    if in_batch:
        engine._charged_in_a_row = 0
    for fs in in_batch:  # failures count in a row: a request that made progress starts again (it computed a step,
        h = engine.handles.get(fs.state.request_id)  # so the failed steps it shared were not its values' fault)
        if h is not None and fs.has_new_token:
            h.retries = h.step_failures = 0
    if engine._probe_id is not None and any(fs.state.request_id == engine._probe_id and fs.has_new_token
                                            for fs in in_batch):
        engine._probe_id = None
    if not engine._suspects:
        return
    sched = bp.scheduler
    for fs in in_batch:
        rid = fs.state.request_id
        if rid in engine._suspects and fs.has_new_token:
            engine._suspects.discard(rid)
            st = sched.active_requests.get(rid)
            if st is not None and engine._suspects:
                unschedule(sched, rid)
                requeue(sched, st, front=False)
    engine._suspects.intersection_update(set(sched.active_requests) | set(sched.waiting_requests))
    if not engine._suspects:
        _end_isolation(engine, sched)
