"""The end of a ``vramguard plan`` process: once the plan is printed nothing is left to do, so the process ends without
the interpreter's teardown (about a second once torch and transformers are imported), its output whole and its exit
code kept; a caller that goes on after ``main()`` (a test, a script) gets its ordinary ``SystemExit``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the command run as its process's program (python -m vramguard), with an exit handler of the interpreter's
RUN = ("import atexit, runpy, sys; atexit.register(lambda: print('torn down', file=sys.stderr)); "
       "sys.argv = ['vramguard', 'plan', *sys.argv[1:]]; runpy.run_module('vramguard', run_name='__main__', "
       "alter_sys=True)")
# the same command line from a script that calls main() and goes on
CALL = ("import atexit, sys; atexit.register(lambda: print('torn down', file=sys.stderr)); "
        "from vramguard.cli import main; sys.argv = ['vramguard', 'plan', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit as e:\n    print('exit', e.code, file=sys.stderr)")


def _plan(tmp_path, code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VRAMGUARD_CACHE_DIR": str(tmp_path), "COLUMNS": "100"}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_a_plan_process_ends_without_teardown_with_its_output_and_exit_code(tmp_path):
    args = ("llama-3.1-70b", "--vram", "24GiB", "--format", "json", "--exit-code")  # fits no card: exit 1
    ran = _plan(tmp_path, RUN, *args)
    assert ran.returncode == 1 and "torn down" not in ran.stderr, ran.stderr
    called = _plan(tmp_path, CALL, *args)
    assert called.returncode == 0 and "exit 1" in called.stderr and "torn down" in called.stderr
    plan = json.loads(ran.stdout)
    assert ran.stdout == called.stdout and plan["cards"][0]["fits"] is False and plan["cards"][0]["need_bytes"] > 0


def test_a_plan_process_into_a_closed_pipe_still_ends_quietly_with_141(tmp_path):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first write
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VRAMGUARD_CACHE_DIR": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "vramguard", "plan", "llama-3.1-8b", "--vram", "24GiB", "--attn", "sdpa"],
                       stdout=write, stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    os.close(write)
    assert (p.returncode, p.stderr) == (141, "")


def test_a_plan_is_made_with_the_collector_paused_then_restored(monkeypatch):
    """Importing torch and transformers leaves hundreds of thousands of objects for each pass of the cyclic
    collector to walk, to free nothing: the plan is made with it paused, and it runs again after."""
    import gc

    from conftest import run_cli

    from vramguard.cli import plan as cli_plan
    seen = []
    build = cli_plan._build
    monkeypatch.setattr(cli_plan, "_build", lambda *a: seen.append(gc.isenabled()) or build(*a))
    r = run_cli("plan", "llama-3.1-8b", "--vram", "24GiB", "--attn", "sdpa", "--format", "json")
    assert r.returncode == 0 and json.loads(r.stdout)["cards"][0]["fits"] is True
    assert seen == [False] and gc.isenabled()
