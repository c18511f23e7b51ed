"""Print `plan --engine vllm` against the public vLLM startup logs of tests/data/vllm_public_logs.json as a markdown
table (the one in docs/engines.md), and the score: logs within 5% of the KV cache they printed (CPU, no vLLM, no
network).

    PYTHONPATH=$PWD python benchmarks/cpu_vllm_public_logs.py
"""

from __future__ import annotations


from benchmarks.common import load_test_module
from vramguard.errors import VramguardError

def _fmt(what: str, value: float) -> str:
    if what == "refusal":
        return "refused" if value else "starts"
    if what.startswith("tokens"):
        return f"{value:,.0f} tokens"
    return f"{value:.2f} GiB"


def rows(m) -> tuple[list[str], int, int]:
    """The table's rows, the logs within 5% and the logs in all."""
    out = ["| log | model | GPU x n | vLLM | compared | logged | planned | error | source |",
           "|---|---|---|---|---|---|---|---|---|"]
    good = 0
    for e in m.LOGS["logs"]:
        try:
            what, logged, planned = m.compare(e)
        except VramguardError as exc:  # the tool refuses the model or a setting: a miss, shown with its reason
            out.append(f"| {e['id']} | {e['model']} | {e.get('gpu') or 'not named'} | {e['vllm_version']} | - | - | "
                       f"**refused by vramguard**: {type(exc).__name__} | - | [source]({e['source']}) |")
            continue
        s = e["settings"]
        n = s.get("tensor_parallel_size", 1) * s.get("pipeline_parallel_size", 1)
        err = 0.0 if what == "refusal" else planned / logged - 1
        ok = abs(err) <= 0.05 and (what != "refusal" or planned)
        good += bool(ok)
        shown = ("refusal predicted" if planned else "**refusal missed**") if what == "refusal" else \
            (f"{100 * err:+.2f}%" if ok else f"**{100 * err:+.2f}%**")
        out.append(f"| {e['id']} | {e['model']} | {e.get('gpu') or 'not named'} x {n} | {e['vllm_version']} | {what} | "
                   f"{_fmt(what, logged)} | {_fmt(what, planned)} | {shown} | [source]({e['source']}) |")
    return out, good, len(m.LOGS["logs"])


if __name__ == "__main__":
    table, good, total = rows(load_test_module("test_vllm_public_logs"))
    print("\n".join(table))
    print(f"\n{good} of {total} within 5% of the logged KV cache (or refusals predicted)")
