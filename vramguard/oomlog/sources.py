"""Where the kernel log comes from: a file or stdin, ``dmesg``, ``journalctl -k``, /var/log/kern.log, syslog or
messages, and in containers the cgroup's oom_kill counters. Each source says why it could not be read."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from vramguard.units import plural

LOG_FILES = ("/var/log/kern.log", "/var/log/syslog", "/var/log/messages")
CGROUP_EVENTS = ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control")
PERMISSION_HELP = ("the kernel log is restricted (kernel.dmesg_restrict=1 needs CAP_SYSLOG, i.e. root); "
                   "alternatives: `sudo vramguard oom-log`, `journalctl -k` as a member of the systemd-journal or adm "
                   "group, `vramguard oom-log --file /var/log/kern.log`, or `sudo dmesg > log.txt` then "
                   "`vramguard oom-log --file log.txt`")
SOURCE_OVERRIDE = None  # tests set a callable returning a LogSource


@dataclass
class LogSource:
    """Lines read and from where; ``attempts`` says what was tried and why each failed."""

    name: str | None
    lines: list[str]
    attempts: list[str] = field(default_factory=list)
    permission_denied: bool = False
    cgroup_oom_kills: dict[str, int] = field(default_factory=dict)


def _run(cmd: list[str]) -> tuple[list[str] | None, str, bool]:
    if shutil.which(cmd[0]) is None:
        return None, f"{cmd[0]}: not installed", False
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, errors="replace")
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{' '.join(cmd)}: {type(e).__name__}: {e}", False
    err = (r.stderr or "").strip()
    denied = "not permitted" in err.lower() or "permission denied" in err.lower() or "no journal files" in err.lower()
    if r.returncode != 0:
        return None, f"{' '.join(cmd)}: exit {r.returncode}: {err[:200]}", denied
    lines = r.stdout.splitlines()
    if not lines and err:
        return None, f"{' '.join(cmd)}: {err[:200]}", denied
    return lines, f"{' '.join(cmd)}: {plural(len(lines), 'line')}", False


def cgroup_counters() -> dict[str, int]:
    """oom / oom_kill counters of this process's memory cgroup (v2 memory.events, v1 memory.oom_control)."""
    out: dict[str, int] = {}
    for path in CGROUP_EVENTS:
        try:
            for line in Path(path).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k in ("oom", "oom_kill") and v.strip().isdigit():
                    out[f"{path}:{k}"] = int(v)
        except OSError:
            continue
    return out


def read_source(file: str | None = None) -> LogSource:
    """The kernel log lines: ``file`` (``-`` = stdin), else the first readable system source."""
    if SOURCE_OVERRIDE is not None:
        return SOURCE_OVERRIDE()
    counters = cgroup_counters() if not file else {}  # this machine's counters say nothing about a saved log
    if file == "-":
        return LogSource("stdin", sys.stdin.read().splitlines(), ["stdin"], cgroup_oom_kills=counters)
    if file:
        p = Path(file)
        try:
            return LogSource(str(p), p.read_text(errors="replace").splitlines(), [str(p)], cgroup_oom_kills=counters)
        except PermissionError as e:
            return LogSource(None, [], [f"{p}: {e}"], True, counters)
        except OSError as e:
            return LogSource(None, [], [f"{p}: {e.strerror or e}"], False, counters)
    attempts, denied = [], False
    for cmd in (["dmesg", "--kernel"], ["journalctl", "-k", "-b", "-o", "short-iso", "--no-pager"]):
        lines, why, d = _run(cmd)
        attempts.append(why)
        denied |= d
        if lines:
            return LogSource(" ".join(cmd), lines, attempts, cgroup_oom_kills=counters)
    for path in LOG_FILES:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
            attempts.append(f"{path}: {plural(len(lines), 'line')}")
            return LogSource(path, lines, attempts, cgroup_oom_kills=counters)
        except PermissionError as e:
            attempts.append(f"{path}: {e}")
            denied = True
        except OSError as e:
            attempts.append(f"{path}: {type(e).__name__}")
    return LogSource(None, [], attempts, denied, counters)


def boot_time() -> float | None:
    """The machine's boot time (seconds since the epoch), to turn dmesg's seconds since boot into wall time."""
    try:
        import psutil
        return float(psutil.boot_time())
    except Exception:
        try:
            up = float(Path("/proc/uptime").read_text().split()[0])
            import time
            return time.time() - up
        except (OSError, ValueError, IndexError):
            return None


def cmdline_of(pid: int, name: str) -> str | None:
    """The command line of ``pid`` if a process of that pid and name still runs (pids are reused)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        if comm != name[:15]:
            return None
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace").strip() or None
    except OSError:
        return None


def is_container() -> bool:
    return os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv")
