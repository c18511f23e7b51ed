"""The serve fuzz test (tests/test_serve_fuzz.py) run longer: a real server (uvicorn on a socket, built as
``vramguard serve`` builds it) on a tiny random Llama on the CPU, ``--examples`` hypothesis examples of 1-3 concurrent requests each. Writes OUTDIR/result.json
(the command, the number of requests sent, the answers by status and error code, the server's counters after the
run) and OUTDIR/pytest.txt.

    python benchmarks/cpu_serve_fuzz.py benchmarks/results/cpu_serve_fuzz --examples 1500
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default="/tmp/serve_fuzz")
    ap.add_argument("--examples", type=int, default=1500)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    report = os.path.abspath(os.path.join(args.out, "result.json"))
    env = {**os.environ, "VRAMGUARD_FUZZ_EXAMPLES": str(args.examples), "VRAMGUARD_FUZZ_REPORT": report}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_serve_fuzz.py"],
                       cwd=root, env=env, capture_output=True, text=True)
    with open(os.path.join(args.out, "pytest.txt"), "w") as f:
        f.write(r.stdout[-20000:] + r.stderr[-5000:])
    result = json.load(open(report)) if os.path.exists(report) and r.returncode == 0 else {}
    result.update(command=f"python benchmarks/cpu_serve_fuzz.py {args.out} --examples {args.examples}",
                  passed=r.returncode == 0, wall_s=round(time.perf_counter() - t0, 1))
    with open(report, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result))
    sys.exit(r.returncode)


if __name__ == "__main__":
    main()
