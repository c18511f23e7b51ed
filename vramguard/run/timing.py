"""Where a ``run`` spends its wall time, and why its generation ended; knows nothing about how tokens are made.

The split follows what a person waits for: importing torch and transformers, reading the tokenizer and config
(``prepare``), loading the weights, planning the strategy, one-time work (the Triton kernels' check, with their
compilation the first time, the eager warm-up steps before a CUDA graph capture, the capture: all before the
prefill), the prefill (time to first token, TTFT) and the decode steps. ``decode_ms_per_token`` is decode time over
decode steps, the first token to the last, so it is the rate a person watching the stream sees; one-time work has
its own line, and ``first_token_s`` / ``command_first_token_s`` say when the first token came.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RunTimings:
    """Seconds per phase of one run (None: not measured by the caller, e.g. ``import_s`` outside the CLI).

    ``generate_s`` is the wall time inside :func:`vramguard.run.generate.generate` after planning;
    ``one_time_s + prefill_s + decode_s + other_s == generate_s``, ``other_s`` being what no phase names (prefills
    that continue after an out-of-memory error, the last token's streaming). ``first_token_s`` runs from the call of
    ``generate`` (planning included) to the first token; ``command_first_token_s`` and ``total_s`` from the start of
    the interpreter (CLI only). ``kernel_check`` says how the Triton kernels were checked: ``"full"`` (each kernel
    on the model's weights, compiled the first time), ``"kept"`` (the verdict kept on disk and a spot check), None
    (no kernels).
    """

    startup_s: float | None = None  # interpreter start to the command's first line (the CLI's own imports)
    import_s: float | None = None
    prepare_s: float | None = None  # tokenizer, prompt and context check before loading
    load_s: float | None = None
    plan_s: float | None = None
    prefill_s: float | None = None  # time to first token (TTFT): the prompt in, the first token out
    selftest_s: float = 0.0
    warmup_s: float = 0.0
    warmup_steps: int = 0
    capture_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_ms_per_token: float | None = None
    other_s: float = 0.0
    generate_s: float | None = None
    first_token_s: float | None = None
    command_first_token_s: float | None = None
    total_s: float | None = None
    kernel_check: str | None = None

    @property
    def one_time_s(self) -> float:
        """Kernel check (Triton compilation included), warm-up steps and graph capture, in seconds."""
        return self.selftest_s + self.warmup_s + self.capture_s

    @classmethod
    def of_attempts(cls, attempts, plan_s: float, generate_s: float, first_token_s: float | None) -> RunTimings:
        """The split of a generation from its attempts (:class:`vramguard.run.generate.Attempt`): the prefill is that
        of the attempt that produced the first token; decode and one-time work are summed over the attempts."""
        t = cls(plan_s=plan_s, generate_s=generate_s, first_token_s=first_token_s)
        t.prefill_s = next((a.ttft_s for a in attempts if a.new_tokens > 0 and a.ttft_s is not None), None)
        for a in attempts:
            t.decode_s += a.decode_s or 0.0
            t.decode_steps += a.decode_steps
            one = a.one_time or {}
            t.selftest_s += one.get("selftest_s") or 0.0
            t.warmup_s += one.get("warmup_s") or 0.0
            t.warmup_steps += one.get("warmup_steps") or 0
            t.capture_s += one.get("capture_s") or 0.0
            t.kernel_check = one.get("kernel_check") or t.kernel_check
        t.decode_ms_per_token = t.decode_s * 1000 / t.decode_steps if t.decode_steps else None
        t.other_s = max(generate_s - (t.prefill_s or 0.0) - t.one_time_s - t.decode_s, 0.0)
        return t

    def to_json(self) -> dict:
        """Every field and ``one_time_s``, for JSON (the CLI's ``to_jsonable`` calls it)."""
        out = dict(vars(self))
        out["one_time_s"] = self.one_time_s
        return out


STOP_EOS, STOP_LIMIT, STOP_INTERRUPTED = "eos", "max_new_tokens", "interrupted"


def stop_reason(generated: list[int], max_new_tokens: int, eos: list[int], ignore_eos: bool,
                tokenizer=None) -> tuple[str, str]:
    """Why a generation ended: (``"eos"`` or ``"max_new_tokens"``, the reason in words).

    ``"eos"`` when an end token (``eos``: the model's ``generation_config.eos_token_id``) is the last id and
    ``ignore_eos`` is off, as transformers' ``generate`` stops; else the token limit.

    >>> stop_reason([5, 2], 64, [2], False)
    ('eos', 'end of turn: the model generated its end token (id 2) after 2 tokens')
    >>> stop_reason([5, 6], 2, [2], True)[1]
    'the token limit: 2 of max_new_tokens 2 (ignore_eos: the end tokens were masked)'
    """
    n = len(generated)
    if not ignore_eos and generated and generated[-1] in eos:
        name = tokenizer.convert_ids_to_tokens(generated[-1]) if tokenizer is not None else None
        what = f"{name!r} (id {generated[-1]})" if name else f"its end token (id {generated[-1]})"
        return STOP_EOS, f"end of turn: the model generated {what} after {n:,} tokens"
    why = f"the token limit: {n:,} of max_new_tokens {max_new_tokens:,}"
    if ignore_eos:
        why += " (ignore_eos: the end tokens were masked)"
    elif not eos:
        why += " (the model's generation_config has no eos_token_id)"
    return STOP_LIMIT, why


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: ``/proc/self/stat``'s start time against ``/proc/uptime``, both
    since boot, per proc(5)); None where they cannot be read. The CLI's interpreter start and imports before the
    command runs are this much."""
    import os
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 (starttime); 3 is fields[0]
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class DecodeResult:
    """One request's tokens and how they were produced.

    ``mode`` is ``"cuda_graph"`` when the decode steps came from a graph replay, else ``"eager"`` (or the label of a
    test's capture override); ``reason`` says why. Times are seconds, rates ms per generated token. One-time work runs
    before the prefill, on a dummy token, so that every step after the first token is decode: ``selftest_s`` (the
    kernels' check on the model's own weights, with their Triton compilation the first time, or a spot check of the
    verdict kept on disk: ``kernel_check`` says which), ``warmup_s`` (``warmup_steps`` eager steps before a capture)
    and ``capture_s``. ``ttft_s`` is the prefill (the prompt in, the first token out); ``decode_s`` spans the first
    token to the last over ``decode_steps`` steps, so ``decode_ms_per_token`` is what a person watching the stream
    sees. ``eager_steps`` and ``replay_steps`` split the decode steps; ``replay_ms_per_token`` is set when every
    step was replayed.
    """

    token_ids: list[int]
    mode: str
    reason: str
    stop: str  # "eos" or "max_new_tokens"
    prompt_tokens: int
    max_cache_len: int
    ttft_s: float
    decode_s: float
    decode_ms_per_token: float | None
    eager_steps: int = 0  # decode steps run without the graph (all of them in eager mode)
    replay_steps: int = 0
    replay_ms_per_token: float | None = None
    capture_s: float | None = None
    decode_steps: int = 0  # the steps decode_s covers: every token after the first
    warmup_s: float = 0.0  # eager steps on a dummy token before the capture
    warmup_steps: int = 0
    selftest_s: float = 0.0
    sdpa_note: str | None = None
    kernels: str | None = None  # which Triton kernels ran in the decode steps (None: none), or why none did
    kernel_check: str | None = None  # "full" (every kernel checked) or "kept" (the verdict on disk + a spot check)

    @property
    def one_time_s(self) -> float:
        """Seconds of one-time work before the prefill: kernel check, warm-up steps, graph capture."""
        return self.selftest_s + self.warmup_s + (self.capture_s or 0.0)
