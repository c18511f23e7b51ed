"""CPU seconds of each test of the suite: a pytest plugin that writes one line per test (this process's CPU with its
threads, the CPU of the subprocesses it waited for, and the wall time), and a summary by module.

    python -m pytest -q -p benchmarks.cpu_test_profile          # the whole suite: one file per xdist worker
    python benchmarks/cpu_test_profile.py /tmp/cpu_test-*.tsv   # modules and tests by CPU seconds

``CPU_TEST_PROFILE`` names the files' prefix (default ``/tmp/cpu_test``). A test's module fixtures are charged to
the first test that uses them. Where the seconds of ``tests/conftest.py``'s ``SLOW_MODULES`` come from.
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import time

import pytest

_ROWS: list[tuple[str, float, float, float]] = []


def _cpu() -> tuple[float, float]:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, (own, children) = time.perf_counter(), _cpu()
    yield
    own_after, children_after = _cpu()
    _ROWS.append((item.nodeid, own_after - own, children_after - children, time.perf_counter() - wall))


def pytest_sessionfinish(session):
    worker = getattr(session.config, "workerinput", {}).get("workerid", "main")
    own, children = _cpu()
    with open(f"{os.environ.get('CPU_TEST_PROFILE', '/tmp/cpu_test')}-{worker}.tsv", "w") as f:
        f.write(f"#session\t{own:.2f}\t{children:.2f}\n")  # the whole process: collection included
        f.writelines(f"{nodeid}\t{a:.3f}\t{b:.3f}\t{c:.3f}\n" for nodeid, a, b, c in _ROWS)


def main(paths: list[str], top: int = 40) -> None:
    modules: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    tests = []
    for path in paths:
        for line in open(path):
            if line.startswith("#"):
                print(path, "process CPU s (own, subprocesses):", *line.split()[1:])
                continue
            nodeid, own, children, wall = line.rstrip("\n").split("\t")
            row = modules[nodeid.split("::")[0]]
            for i, value in enumerate((float(own), float(children), float(wall), 1)):
                row[i] += value
            tests.append((float(own) + float(children), float(wall), nodeid))
    print(f"tests: {sum(r[0] + r[1] for r in modules.values()):.1f} CPU s, {len(tests)} tests")
    print("CPU s (of it in subprocesses)  wall s  tests  module")
    for name, (own, children, wall, n) in sorted(modules.items(), key=lambda kv: -kv[1][0] - kv[1][1])[:top]:
        print(f"{own + children:7.1f} ({children:5.1f})  {wall:7.1f}  {n:5d}  {name}")
    print("CPU s  wall s  test")
    for cpu, wall, nodeid in sorted(tests, reverse=True)[:top]:
        print(f"{cpu:6.1f}  {wall:6.1f}  {nodeid}")


if __name__ == "__main__":
    main(sys.argv[1:])
