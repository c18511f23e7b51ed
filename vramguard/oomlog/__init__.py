"""``oom-log``: the kernel OOM killer's records turned into a diagnosis.

:func:`oom_log` reads the log (:mod:`.sources`), parses the records (:mod:`.parse`) and explains each kill:
when, which process and its memory at death, global or cgroup (and which cgroup), the largest other memory users
at that moment, and the likely cause with the fix. Kills are listed newest first.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone

from vramguard.errors import InvalidValue
from vramguard.oomlog.parse import OomRecord, parse_lines, split_line
from vramguard.oomlog.sources import PERMISSION_HELP, boot_time, cmdline_of, read_source
from vramguard.units import fmt_bytes, plural

PYTHON_LIKE = re.compile(r"python|pt_main_thread|torchrun|accelerate|uvicorn|jupyter|ipykernel", re.I)
BIG_LOADER_BYTES = 2**30  # a Python process above 1 GiB RSS counts as a model loader
TOP_OTHERS = 5


@dataclass
class OomKill:
    """One kill, newest first in :class:`OomLogReport`. Sizes in bytes; ``time`` ISO 8601 when known."""

    time: str | None
    uptime_s: float | None
    pid: int | None
    name: str | None
    cmdline: str | None
    rss_bytes: int | None
    anon_rss_bytes: int | None
    file_rss_bytes: int | None
    shmem_rss_bytes: int | None
    total_vm_bytes: int | None
    pgtables_bytes: int | None
    uid: int | None
    oom_score_adj: int | None
    constraint: str
    cgroup: str | None
    task_cgroup: str | None
    cgroup_limit_bytes: int | None
    invoked_by: str | None
    gfp_mask: str | None
    order: int | None
    top_others: list[dict]
    cause: str
    fix: str
    complete: bool


@dataclass
class OomLogReport:
    """What was read, the kills found (newest first), and a plain message when there is nothing to show."""

    source: str | None
    attempts: list[str]
    kills: list[OomKill]
    lines_read: int
    skipped_lines: int
    permission_denied: bool
    message: str
    cgroup_oom_kills: dict[str, int] = field(default_factory=dict)


EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)  # no kernel log record is older than the Unix epoch
SINCE_FORMS = "30m, 2h, 1d, boot, or a date/time such as 2026-11-30T17:00"


def parse_since(text: str | None, now: datetime | None = None) -> datetime | None:
    """``--since``: ``30m``, ``2h``, ``1d``, ``boot``, or an ISO date/time (``2026-11-30 17:00``; without a zone,
    local time); the result lies between the Unix epoch (1970-01-01 UTC) and ``now``.

    Raises:
        InvalidValue: any other form, a duration reaching back before 1970-01-01, or a time after ``now``.
    """
    if text is None:
        return None
    now = now or datetime.now(timezone.utc)
    t = text.strip()
    m = re.fullmatch(r"(\d+)\s*([smhd])", t)
    if m:
        unit_s = {"s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
        most = int((now - EPOCH).total_seconds()) // unit_s
        if int(m.group(1)) > most:
            raise InvalidValue("since", text, f"a duration back to 1970-01-01 at most ({most:,}{m.group(2)} from "
                               "now)", "pass a shorter duration such as 30d, or leave it out for every record")
        return now - timedelta(seconds=int(m.group(1)) * unit_s)
    if t == "boot":
        bt = boot_time()
        return datetime.fromtimestamp(bt, tz=timezone.utc) if bt else None
    try:
        dt = datetime.fromisoformat(t)
    except ValueError:
        raise InvalidValue("since", text, SINCE_FORMS, "pass one of those forms") from None
    try:
        dt = dt if dt.tzinfo else dt.astimezone()
    except (ValueError, OverflowError):  # year 1 in a zone east of UTC: before any kernel log anyway
        dt = None
    if dt is None or not EPOCH <= dt <= now:
        raise InvalidValue("since", text, f"a time from 1970-01-01 to now ({now.isoformat(timespec='minutes')})",
                           "pass a time in the past, e.g. 1d for the last day, or leave it out for every record")
    return dt


def _diagnose(r: OomRecord) -> tuple[str, str]:
    name = r.killed_name or "?"
    rss = fmt_bytes(r.rss_bytes) if r.rss_bytes is not None else "an unknown amount"
    cgroup = r.constraint == "CONSTRAINT_MEMCG" or r.memcg_kill
    loaders = [t for t in r.tasks if PYTHON_LIKE.search(t.name) and t.rss_bytes >= BIG_LOADER_BYTES]
    if cgroup:
        limit = f" of {fmt_bytes(r.cgroup_limit_bytes)}" if r.cgroup_limit_bytes else ""
        return (f"the memory cgroup {r.oom_memcg or r.task_memcg or '?'} reached its limit{limit}; {name} held {rss}",
                "raise the container's memory limit (docker --memory, Kubernetes resources.limits.memory), or load "
                "with less RAM: shards smaller than the limit, device_map={'': 0} so weights go straight to the GPU")
    if len(loaders) >= 2:
        total = sum(t.rss_bytes for t in loaders)
        return (f"{len(loaders)} Python processes held {fmt_bytes(total)} together: several loaders at once "
                f"(workers, or one process per GPU each reading the checkpoint)",
                "load one model at a time, or serve one model to every client instead of loading it per worker")
    if PYTHON_LIKE.search(name):
        return (f"{name} held {rss} of RAM: loading a model reads each checkpoint shard whole into RAM, and a "
                "device_map that offloads layers keeps them in CPU RAM",
                "`vramguard check MODEL` compares the largest shard with free RAM and finds CPU offload; re-shard "
                "smaller (save_pretrained(max_shard_size='2GB')), load with device_map={'': 0}, or add swap")
    return (f"the kernel chose {name} ({rss}), the process with the highest OOM score",
            "see the largest other memory users at the time below")


def _kill(r: OomRecord, boot: float | None) -> OomKill:
    when = r.time
    if when is None and r.uptime_s is not None and boot is not None:
        when = datetime.fromtimestamp(boot + r.uptime_s, tz=timezone.utc)
    others = sorted((t for t in r.tasks if t.pid != r.killed_pid), key=lambda t: -t.rss_bytes)[:TOP_OTHERS]
    cause, fix = _diagnose(r)
    constraint = {"CONSTRAINT_MEMCG": "cgroup", "CONSTRAINT_NONE": "global", "CONSTRAINT_CPUSET": "cpuset",
                  "CONSTRAINT_MEMORY_POLICY": "memory policy"}.get(r.constraint or "",
                                                                    "cgroup" if r.memcg_kill else "global")
    if r.killed_pid is None:
        cause = (f"the OOM killer was invoked by {r.invoked_by or '?'} but the record ends before the kill line "
                 "(truncated log)")
        fix = "read the full log (journalctl -k, /var/log/kern.log) around that time"
    return OomKill(
        time=when.isoformat() if when else None, uptime_s=r.uptime_s, pid=r.killed_pid, name=r.killed_name,
        cmdline=cmdline_of(r.killed_pid, r.killed_name) if r.killed_pid and r.killed_name else None,
        rss_bytes=r.rss_bytes, anon_rss_bytes=r.anon_rss_bytes, file_rss_bytes=r.file_rss_bytes,
        shmem_rss_bytes=r.shmem_rss_bytes, total_vm_bytes=r.total_vm_bytes, pgtables_bytes=r.pgtables_bytes,
        uid=r.uid, oom_score_adj=r.oom_score_adj, constraint=constraint, cgroup=r.oom_memcg,
        task_cgroup=r.task_memcg, cgroup_limit_bytes=r.cgroup_limit_bytes, invoked_by=r.invoked_by,
        gfp_mask=r.gfp_mask, order=r.order,
        top_others=[{"pid": t.pid, "name": t.name, "rss_bytes": t.rss_bytes} for t in others],
        cause=cause, fix=fix, complete=r.complete)


def _sort_key(k: OomKill) -> tuple:
    return (k.time or "", k.uptime_s or 0.0)


def lines_in_window(lines: list[str], cutoff: datetime, year: int | None = None) -> tuple[int, int]:
    """(lines dated at or after ``cutoff``, lines that carry no wall-clock time) of a kernel log: what a report
    "since" a time has read in its window. A time without a zone is local, as the kills' times are read."""
    inside = undated = 0
    for line in lines:
        when = split_line(line, year)[0]
        if when is None:
            undated += 1
        elif when.astimezone() >= cutoff:
            inside += 1
    return inside, undated


def _window(lines: list[str], cutoff: datetime, year: int | None, read: int) -> str:
    """``3 lines since then, of 12 read`` (and how many carry no date)."""
    inside, undated = lines_in_window(lines, cutoff, year)
    text = f"{plural(inside, 'line')} since then, of {read:,} read"
    return text + (f"; {plural(undated, 'line')} without a date" if undated else "")


def _undated_text(undated: list[OomKill]) -> str:
    """What a report ``since`` a time says of the kills it could not date, which it lists rather than drop: those
    with seconds since boot only (a saved raw dmesg, whose boot time is unknown) and those with no time at all
    (``dmesg -t``, a log without timestamps)."""
    uptime = sum(1 for k in undated if k.uptime_s is not None)
    parts = ([f"{uptime} with seconds since boot only, from a saved raw dmesg"] if uptime else []) + (
        [f"{len(undated) - uptime} with no time at all"] if len(undated) > uptime else [])
    one = len(undated) == 1
    return (f"{plural(len(undated), 'record')} {'has' if one else 'have'} no date ({'; '.join(parts)}): since= "
            f"cannot filter {'it' if one else 'them'}, so {'it is' if one else 'they are'} listed")


def oom_log(file: str | None = None, since: str | None = None, year: int | None = None) -> OomLogReport:
    """Read the kernel log (``file``, ``-`` for stdin, or the system's) and explain every OOM kill.

    Raises:
        InvalidValue: a malformed ``since``.
    """
    cutoff = parse_since(since)
    if year is not None and not 1970 <= year <= 9999:
        raise InvalidValue("year", year, "a year from 1970 to 9999", "give the year of the log's timestamps")
    src = read_source(file)
    if file and src.name is None:
        raise InvalidValue("file", file, "a readable log file, or - for stdin",
                           ("; ".join(src.attempts) + ": check the path, or pipe the log into file='-'")
                           + (f". {PERMISSION_HELP}" if src.permission_denied else ""))
    if file and not src.lines:
        raise InvalidValue("file", file, "a kernel log with at least one line",
                           "pass the output of dmesg, journalctl -k or /var/log/kern.log")
    parsed = parse_lines(src.lines, year)
    boot = boot_time() if src.name and not file else None  # raw dmesg seconds are this boot's only when live
    kills = [_kill(r, boot) for r in parsed.records]
    undated = [k for k in kills if k.time is None] if cutoff is not None else []
    if cutoff is not None:
        kills = [k for k in kills if k.time is None or datetime.fromisoformat(k.time).astimezone() >= cutoff]
    kills.sort(key=_sort_key, reverse=True)
    if src.name is None:
        msg = (PERMISSION_HELP if src.permission_denied else "no kernel log could be read: " + "; ".join(src.attempts))
    elif not kills:
        msg = f"no OOM-killer record in {src.name} ({plural(parsed.lines_read, 'line')})"
        if cutoff is not None:
            window = _window(src.lines, cutoff, year, parsed.lines_read)
            msg = f"no OOM-killer record in {src.name} since {cutoff.isoformat(timespec='minutes')} ({window})"
        counted = {k: v for k, v in src.cgroup_oom_kills.items() if k.endswith("oom_kill") and v}
        if counted:
            msg += "; but this container's cgroup counted OOM kills: " + ", ".join(f"{k}={v}" for k, v in
                                                                              counted.items())
    else:
        msg = f"{len(kills)} OOM kill(s) in {src.name}"
    if undated:
        msg += "; " + _undated_text(undated)
    return OomLogReport(src.name, src.attempts, kills, parsed.lines_read, parsed.skipped_lines,
                        src.permission_denied, msg, src.cgroup_oom_kills)
