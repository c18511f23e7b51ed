"""The settings of one server process (:class:`ServeConfig`), checked when it is made: plain values, no import of
the HTTP stack, so the CLI builds and checks one before anything heavy is loaded."""

from __future__ import annotations

from dataclasses import dataclass

from vramguard.errors import InvalidValue
from vramguard.run.generate import check_seed

ENGINES = ("auto", "continuous", "generate")  # the serve engines a user may choose ("auto": continuous when it runs)
BODY_TIMEOUT_S = 10.0  # the whole request body must arrive within this many seconds of the headers
MAX_COUNT = 1 << 20  # requests, tokens per step or per block beyond this are no serving setting


@dataclass(frozen=True)
class ServeConfig:
    """What :func:`vramguard.serve.server.build` loads and serves with.

    Attributes:
        vram_budget: bytes PyTorch may use (None: what is free after loading; on the CPU, 2 GiB of host memory).
        max_queue, max_running: requests that may wait beyond those running; requests computed in one step.
        max_batch_tokens, page_size: tokens computed in one step; tokens per KV block.
        max_kv_blocks: a cap on the KV pool below what the budget allows (None: no cap).
        api_key: the bearer token every route but /health requires (None: none, loopback or ``allowed_hosts``).
        quant, dtype, attn, trust_remote_code, allow_pickle, verify: as
            :func:`vramguard.runtime.load.load_model` takes them (``quant`` None: the caller chooses before build).
        seed: the engine's sampling seed. greedy: every request decoded greedily (temperature > 0 refused).
        served_name: the name clients send and see (default: the folder's last part for a local folder, never
            its path; else the model id).
        n_max, default_max_tokens: the largest ``n``; ``max_tokens`` of a request that gives none.
        max_body_bytes, body_timeout_s: the largest request body (413 beyond); seconds a body may take to arrive
            after its headers (408 beyond).
        hard_cap: on a CUDA device with a budget, cap this process's memory at it.
        deterministic: the continuous engine computes one request per step, so a request's text does not depend
            on the others in the batch (its cost: benchmarks/README.md).
        engine_choice: "continuous" (transformers' continuous batching with a paged KV pool), "generate" (the
            model's own generate, one request at a time: :mod:`vramguard.serve.generate_engine`) or "auto"
            (continuous where it runs the model).
        warm_up: on a CUDA device the continuous engine runs the load it is sized for once before serving.
        allowed_hosts: without ``api_key``, the names (``.suffix`` for a domain, ``*`` for any) that ``Host`` and
            ``Origin`` may carry beyond loopback (:class:`~vramguard.serve.browsers.BrowserGuard`).

    Raises:
        InvalidValue: on construction, an unknown engine, a bad seed, a count outside its range, or a body
            timeout <= 0.
    """

    vram_budget: int | None = None
    max_queue: int = 64
    max_running: int = 64
    max_batch_tokens: int = 2048
    page_size: int = 256
    max_kv_blocks: int | None = None
    api_key: str | None = None
    quant: str | None = "nf4"
    dtype: str | None = None
    attn: str = "auto"
    trust_remote_code: bool = False
    allow_pickle: bool = False
    verify: bool = True
    seed: int = 0
    greedy: bool = False
    served_name: str | None = None
    n_max: int = 4
    default_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = BODY_TIMEOUT_S
    hard_cap: bool = False
    deterministic: bool = False
    engine_choice: str = "auto"
    warm_up: bool = True
    allowed_hosts: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.engine_choice not in ENGINES:
            raise InvalidValue("engine", self.engine_choice, " | ".join(ENGINES),
                               "pass one of: " + ", ".join(ENGINES))
        check_seed(self.seed)
        _check_limits(self.body_timeout_s, max_queue=(self.max_queue, 0), max_running=(self.max_running, 1),
                      max_batch_tokens=(self.max_batch_tokens, 16), page_size=(self.page_size, 4),
                      n_max=(self.n_max, 1), default_max_tokens=(self.default_max_tokens, 1))
        if self.max_kv_blocks is not None and self.max_kv_blocks < 1:
            raise InvalidValue("max_kv_blocks", self.max_kv_blocks, "an integer >= 1", "pass max_kv_blocks=1 or more")
        object.__setattr__(self, "allowed_hosts", tuple(self.allowed_hosts))


def _check_limits(body_timeout_s: float, **counts: tuple[int, int]) -> None:
    """Raise :class:`InvalidValue` for a body timeout <= 0 or a count outside ``[lo, MAX_COUNT]``
    (``name=(value, lo)``)."""
    if not body_timeout_s > 0:
        raise InvalidValue("body_timeout_s", body_timeout_s, "a number of seconds > 0", "pass e.g. 10")
    for name, (value, lo) in counts.items():
        if value < lo:
            raise InvalidValue(name, value, f"an integer >= {lo}", f"pass {lo} or more")
        if value > MAX_COUNT:
            raise InvalidValue(name, value, f"an integer from {lo} to {MAX_COUNT:,}", f"pass at most {MAX_COUNT:,}")
