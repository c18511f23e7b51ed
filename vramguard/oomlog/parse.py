"""Parsing the kernel OOM killer's records, across kernel versions and log formats.

Line formats (timestamp prefixes), each handled by :func:`split_line`:

* raw ``dmesg``: ``[12345.678901] text`` (seconds since boot);
* ``dmesg -T``: ``[Mon Nov 30 17:04:05 2026] text``;
* ``journalctl -k`` short: ``Nov 30 17:04:05 host kernel: text``; short-iso: ``2026-11-30T17:04:05+0000 host
  kernel: text``; syslog / kern.log: the short form, often with the raw ``[seconds]`` after ``kernel:``;
* ``journalctl -k -o json``: one JSON object a line, ``MESSAGE`` and ``__REALTIME_TIMESTAMP`` (microseconds).

Record lines (mm/oom_kill.c, Linux 3.x to 6.x):

* ``NAME invoked oom-killer: gfp_mask=0x..(..), order=N, oom_score_adj=N`` (older: ``oom_adj=N, oom_score_adj=N``);
* the task table: ``[  pid  ]   uid  tgid total_vm      rss pgtables_bytes swapents oom_score_adj name`` (4.x:
  ``nr_ptes nr_pmds`` instead of ``pgtables_bytes``), values in pages;
* ``oom-kill:constraint=CONSTRAINT_NONE|CONSTRAINT_MEMCG|...,...,oom_memcg=..,task_memcg=..,task=..,pid=..,uid=..``;
* ``Out of memory: Killed process PID (NAME) total-vm:NkB, anon-rss:NkB, file-rss:NkB, shmem-rss:NkB, UID:N
  pgtables:NkB oom_score_adj:N`` and ``Memory cgroup out of memory: Killed process ...``;
* older: ``Out of memory: Kill process PID (NAME) score N or sacrifice child`` then ``Killed process PID (NAME)
  total-vm:NkB, anon-rss:NkB, file-rss:NkB[, shmem-rss:NkB]``;
* cgroup v1 accounting: ``memory: usage NkB, limit NkB, failcnt N``.

Nothing here raises on any input: a line that looks like part of a record but does not parse is counted in
``ParseResult.skipped_lines``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone

PAGE_BYTES = 4096  # the task table counts pages; x86-64 and most arm64 kernels use 4 KiB pages
KB = 1024  # "kB" in the kill line is kibibytes (K(x) in mm/oom_kill.c shifts by PAGE_SHIFT - 10)

_RAW = re.compile(r"^\s*\[\s*(\d+\.\d+)\]\s?(.*)$")
_HUMAN = re.compile(r"^\s*\[([A-Z][a-z]{2} [A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d \d{4})\]\s?(.*)$")
_SHORT = re.compile(r"^([A-Z][a-z]{2} +\d{1,2} \d\d:\d\d:\d\d) \S+ kernel: ?(.*)$")
_ISO = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:[+-]\d\d:?\d\d|Z)?) \S+ kernel: ?(.*)$")

_INVOKED = re.compile(r"^(?P<name>.+?) invoked oom-killer: gfp_mask=(?P<gfp>0x[0-9a-f]+)(?:\((?P<flags>[^)]*)\))?,"
                      r"(?: nodemask=\S+,)? order=(?P<order>-?\d+),(?: oom_adj=-?\d+,)? oom_score_adj=(?P<adj>-?\d+)")
_TABLE_HEAD = re.compile(r"^\[\s*pid\s*\]\s+uid\s+tgid\s+total_vm\s+rss\s+(?P<cols>.*)\bname\s*$")
_ROW = re.compile(r"^\[\s*(?P<pid>\d+)\]\s+(?P<rest>.*)$")
_CONSTRAINT = re.compile(r"^oom-kill:constraint=(?P<c>[A-Z_]+)(?P<rest>.*)$")
_KILLED = re.compile(r"^(?:(?P<memcg>Memory cgroup out of memory)|(?:Out of memory(?: \(oom_kill_allocating_task\))?)):"
                     r" Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)(?P<rest>.*)$")
_KILLED_OLD = re.compile(r"^Killed process (?P<pid>\d+) \((?P<name>[^)]*)\)(?P<rest>.*)$")
_KILL_SCORE = re.compile(r"^(?P<memcg>Memory cgroup out of memory|Out of memory): Kill process (?P<pid>\d+) "
                         r"\((?P<name>[^)]*)\) score (?P<score>\d+) or sacrifice child")
_KV_KB = re.compile(r"(total-vm|anon-rss|file-rss|shmem-rss|pgtables):(\d+)kB")
_CG_USAGE = re.compile(r"^memory: usage (\d+)kB, limit (\d+)kB, failcnt (\d+)")
_OOMISH = ("oom", "Killed process", "Kill process", "[  pid  ]", "invoked")
# a Call Trace frame, e.g. "oom_kill_process.cold+0xb/0x10": part of the dump, not a record line
_TRACE_FRAME = re.compile(r"^\s*(?:\? )?[\w.$]+\+0x[0-9a-f]+/0x[0-9a-f]+")


@dataclass
class TaskRow:
    """One task table row at the moment of the OOM: sizes in bytes."""

    pid: int
    uid: int
    name: str
    total_vm_bytes: int
    rss_bytes: int
    swap_bytes: int
    oom_score_adj: int


@dataclass
class OomRecord:
    """One OOM-killer event as parsed. Sizes are bytes; ``time`` is a datetime when the log gives wall time,
    ``uptime_s`` seconds since boot when it gives that."""

    time: datetime | None = None
    uptime_s: float | None = None
    invoked_by: str | None = None
    gfp_mask: str | None = None
    gfp_flags: str | None = None
    order: int | None = None
    invoker_oom_score_adj: int | None = None
    tasks: list[TaskRow] = field(default_factory=list)
    constraint: str | None = None
    oom_memcg: str | None = None
    task_memcg: str | None = None
    cgroup_usage_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    killed_pid: int | None = None
    killed_name: str | None = None
    total_vm_bytes: int | None = None
    anon_rss_bytes: int | None = None
    file_rss_bytes: int | None = None
    shmem_rss_bytes: int | None = None
    pgtables_bytes: int | None = None
    uid: int | None = None
    oom_score_adj: int | None = None
    score: int | None = None
    memcg_kill: bool = False
    complete: bool = False

    @property
    def rss_bytes(self) -> int | None:
        parts = [self.anon_rss_bytes, self.file_rss_bytes, self.shmem_rss_bytes]
        return sum(p or 0 for p in parts) if any(p is not None for p in parts) else None


@dataclass
class ParseResult:
    """All records (in log order), the lines read, and the OOM-looking lines that could not be parsed."""

    records: list[OomRecord]
    lines_read: int
    skipped_lines: int


def split_line(line: str, year: int | None = None) -> tuple[datetime | None, float | None, str]:
    """(wall time, seconds since boot, message) of one log line; the message alone when no prefix matches."""
    line = line.rstrip("\n")
    if line.startswith("{"):
        try:
            obj = json.loads(line)
            msg = str(obj.get("MESSAGE", ""))
            ts = obj.get("__REALTIME_TIMESTAMP")
            when = datetime.fromtimestamp(int(ts) / 1e6, tz=timezone.utc) if ts is not None else None
            mono = obj.get("_SOURCE_MONOTONIC_TIMESTAMP")
            return when, (int(mono) / 1e6 if mono is not None else None), msg
        except (ValueError, TypeError, AttributeError, OverflowError):
            return None, None, line
    when: datetime | None = None
    m = _ISO.match(line)
    if m:
        try:
            when = datetime.fromisoformat(m.group(1).replace("Z", "+00:00"))
        except ValueError:
            when = None
        line = m.group(2)
    else:
        m = _SHORT.match(line)
        if m:
            try:
                when = datetime.strptime(f"{year or datetime.now().year} {m.group(1)}", "%Y %b %d %H:%M:%S")
            except ValueError:
                when = None
            line = m.group(2)
    m = _HUMAN.match(line)
    if m:
        try:
            when = datetime.strptime(re.sub(" +", " ", m.group(1)), "%a %b %d %H:%M:%S %Y")
        except ValueError:
            pass
        return when, None, m.group(2)
    m = _RAW.match(line)
    if m:
        return when, float(m.group(1)), m.group(2)
    return when, None, line


def _kv(rest: str) -> dict[str, str]:
    out = {}
    for part in rest.split(","):
        if "=" in part:
            k, _, v = part.partition("=")
            out[k.strip()] = v.strip()
    return out


def _row(m: re.Match, cols: list[str]) -> TaskRow | None:
    parts = m.group("rest").split()
    # uid tgid total_vm rss <cols...> oom_score_adj name: at least 6 fields
    if len(parts) < 4 + len(cols) + 1:
        return None
    try:
        uid, _tgid, total_vm, rss = (int(x) for x in parts[:4])
        extra = dict(zip(cols, (int(x) for x in parts[4:4 + len(cols)])))
        name = " ".join(parts[4 + len(cols):]) or "?"
    except ValueError:
        return None
    return TaskRow(int(m.group("pid")), uid, name, total_vm * PAGE_BYTES, rss * PAGE_BYTES,
                   extra.get("swapents", 0) * PAGE_BYTES, extra.get("oom_score_adj", 0))


def parse_lines(lines, year: int | None = None) -> ParseResult:
    """Assemble OOM records from log lines (any iterable of str). Never raises."""
    st = _State()
    n = 0
    for raw in lines:
        n += 1
        try:
            when, up, msg = split_line(str(raw), year)
        except Exception:  # defensive: a line that breaks the splitter is skipped, never fatal
            st.skipped += 1
            continue
        _feed(st, msg.strip(), when, up)
    return ParseResult(st.records, n, st.skipped)


@dataclass
class _State:
    """What :func:`parse_lines` carries from line to line: the records so far, the one being assembled, the
    columns of the last task table header, and the count of OOM-looking lines that did not parse."""

    records: list[OomRecord] = field(default_factory=list)
    cur: OomRecord | None = None
    cols: list[str] = field(default_factory=list)
    skipped: int = 0

    def new(self, when, up) -> OomRecord:
        self.cur = OomRecord(time=when, uptime_s=up)
        self.records.append(self.cur)
        return self.cur

    def open_record(self, when, up) -> OomRecord:
        """The record being assembled while its kill line has not come, else a new one."""
        return self.cur if self.cur is not None and self.cur.killed_pid is None else self.new(when, up)


def _feed(st: _State, msg: str, when, up) -> None:
    """One message: the first record line format of :data:`_LINES` whose handler takes it, else counted as skipped
    when it looks like part of an unfinished record."""
    for pattern, handle in _LINES:
        m = pattern.match(msg)
        if m and handle(st, m, when, up):
            return
    cur = st.cur
    if cur is not None and not cur.complete and any(k in msg for k in _OOMISH) and "oom_reaper" not in msg \
            and "Tasks state" not in msg and "oom_score_adj" not in msg and not _TRACE_FRAME.match(msg):
        st.skipped += 1


def _on_invoked(st: _State, m: re.Match, when, up) -> bool:
    st.cur = OomRecord(time=when, uptime_s=up, invoked_by=m.group("name"), gfp_mask=m.group("gfp"),
                       gfp_flags=m.group("flags"), order=int(m.group("order")),
                       invoker_oom_score_adj=int(m.group("adj")))
    st.records.append(st.cur)
    st.cols = []
    return True


def _on_table_head(st: _State, m: re.Match, when, up) -> bool:
    st.cols = m.group("cols").split()  # e.g. pgtables_bytes swapents oom_score_adj (4.x: nr_ptes nr_pmds ...)
    return True


def _on_row(st: _State, m: re.Match, when, up) -> bool:
    """A task table row, once a header and a record are open (else the line is tried as the other formats)."""
    if not st.cols or st.cur is None:
        return False
    row = _row(m, st.cols)
    if row is None:
        st.skipped += 1
    else:
        st.cur.tasks.append(row)
    return True


def _on_constraint(st: _State, m: re.Match, when, up) -> bool:
    cur = st.cur = st.open_record(when, up)
    kv = _kv(m.group("rest"))
    cur.constraint = m.group("c")
    cur.oom_memcg = kv.get("oom_memcg")
    cur.task_memcg = kv.get("task_memcg")
    return True


def _on_cgroup_usage(st: _State, m: re.Match, when, up) -> bool:
    cur = st.cur = st.open_record(when, up)
    cur.cgroup_usage_bytes, cur.cgroup_limit_bytes = int(m.group(1)) * KB, int(m.group(2)) * KB
    return True


def _on_kill_score(st: _State, m: re.Match, when, up) -> bool:
    cur = st.cur = st.open_record(when, up)
    cur.killed_pid, cur.killed_name = int(m.group("pid")), m.group("name")
    cur.score = int(m.group("score"))
    cur.memcg_kill = m.group("memcg").startswith("Memory cgroup") or cur.memcg_kill
    cur.complete = False  # the "Killed process" line with the sizes follows
    return True


def _on_killed(st: _State, m: re.Match, when, up) -> bool:
    """The kill line with the sizes: it completes the record (a new one when the open record is complete or names
    another process with its sizes)."""
    pid = int(m.group("pid"))
    cur = st.cur
    if cur is None or (cur.complete or (cur.killed_pid is not None and cur.killed_pid != pid
                                        and cur.total_vm_bytes is not None)):
        cur = st.new(when, up)
    cur.killed_pid, cur.killed_name = pid, m.group("name")
    if "memcg" in m.groupdict() and m.group("memcg"):
        cur.memcg_kill = True
    if cur.time is None and cur.uptime_s is None:
        cur.time, cur.uptime_s = when, up
    sizes = {k: int(v) * KB for k, v in _KV_KB.findall(m.group("rest"))}
    if not sizes:
        st.skipped += 1
    cur.total_vm_bytes = sizes.get("total-vm")
    cur.anon_rss_bytes = sizes.get("anon-rss")
    cur.file_rss_bytes = sizes.get("file-rss")
    cur.shmem_rss_bytes = sizes.get("shmem-rss")
    cur.pgtables_bytes = sizes.get("pgtables")
    um = re.search(r"UID:(\d+)", m.group("rest"))
    am = re.search(r"oom_score_adj:(-?\d+)", m.group("rest"))
    cur.uid = int(um.group(1)) if um else cur.uid
    cur.oom_score_adj = int(am.group(1)) if am else cur.oom_score_adj
    cur.complete = True
    return True


# the record line formats of the module docstring, in the order they are tried
_LINES = ((_INVOKED, _on_invoked), (_TABLE_HEAD, _on_table_head), (_ROW, _on_row), (_CONSTRAINT, _on_constraint),
          (_CG_USAGE, _on_cgroup_usage), (_KILL_SCORE, _on_kill_score), (_KILLED, _on_killed),
          (_KILLED_OLD, _on_killed))
