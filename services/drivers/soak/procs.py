"""RSS and open file descriptors of every process of the stack, sampled every few seconds.

The stack is the process tree under ``evolving up`` (its nats-server, services, engines and
gateway). Each process is named by its role, read from its command line (``recorder``,
``engine-n0``, ``gateway``, ``nats-server``, ``up``), so a child that ``up`` restarts keeps its
series and the restart is seen (a new pid under the same name). psutil when it is installed,
otherwise ``/proc`` (Linux): ``/proc/PID/statm`` (resident and resident shared pages: their
difference is the anonymous RSS), ``/proc/PID/fd`` and ``/proc/PID/stat`` (CPU time).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def role_of(cmdline: Sequence[str]) -> str | None:
    """The stack role a command line runs, or None (not ours)."""
    argv = list(cmdline)
    if not argv:
        return None
    exe = os.path.basename(argv[0])
    if exe.startswith("nats-server"):
        return "nats-server"
    if "services.drivers.serve" in argv:
        i = argv.index("services.drivers.serve")
        kind = argv[i + 1] if i + 1 < len(argv) else "service"
        if "--shadow" in argv:
            j = argv.index("--shadow")
            return f"shadow-{argv[j + 1]}" if j + 1 < len(argv) else "shadow"
        return kind
    if "engine.worker" in argv:
        node = argv[argv.index("--node") + 1] if "--node" in argv[:-1] else "?"
        return f"engine-{node}"
    if "engine.backends.sglang.fake" in argv:
        return "sglang-fake"
    if "services.drivers.gateway" in argv:
        return "gateway"
    if "up" in argv[1:] and any(a.endswith("evolving") or a == "services.drivers.cli" for a in argv[:3]):
        return "up"
    return None


def _proc_children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
        except OSError:
            continue
        # the command name is parenthesised and may hold spaces: fields follow the last ')'
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(name))
    return kids


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    try:
        import psutil  # lazy: optional dependency (the /proc walk below is the fallback)
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            p = psutil.Process(root)
            return [root, *(c.pid for c in p.children(recursive=True))]
        except psutil.Error:
            return []
    kids, out, todo = _proc_children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def read_proc(pid: int) -> tuple[list[str], int, int, int, float] | None:
    """(command line, RSS bytes, anonymous RSS bytes, open fds, CPU seconds used) of ``pid``, or
    None when it is gone. Anonymous RSS (``RssAnon``: heap, stacks, private mappings) is what a
    leak grows; the rest of RSS is file-backed pages (shared libraries, mapped files) that the
    kernel drops and reads back as it likes."""
    try:
        import psutil  # lazy: optional dependency (the /proc reads below are the fallback)
    except ImportError:
        psutil = None
    try:
        if psutil is not None:
            p = psutil.Process(pid)
            with p.oneshot():
                cpu, mem = p.cpu_times(), p.memory_info()
                return p.cmdline(), mem.rss, mem.rss - mem.shared, p.num_fds(), cpu.user + cpu.system
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        with open(f"/proc/{pid}/statm", "rb") as f:
            statm = f.read().split()
        rss, shared = int(statm[1]) * PAGE, int(statm[2]) * PAGE  # resident, resident file-backed + shmem
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().decode(errors="replace").rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime + stime (fields 14, 15 of stat)
        return argv, rss, rss - shared, len(os.listdir(f"/proc/{pid}/fd")), cpu
    except (OSError, ValueError, IndexError):
        return None
    except Exception as exc:  # psutil.Error (NoSuchProcess, AccessDenied): gone or not ours
        if psutil is not None and isinstance(exc, psutil.Error):
            return None
        raise


@dataclass
class Series:
    """One role's samples: times (s since the load started), RSS and anonymous RSS (bytes), open
    fds, CPU seconds used by the process so far, pid."""

    t_s: list[float] = field(default_factory=list)
    rss_bytes: list[int] = field(default_factory=list)
    anon_bytes: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)
    cpu_s: list[float] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)

    def restarts(self) -> int:
        return sum(1 for a, b in zip(self.pids, self.pids[1:], strict=False) if a != b)

    def cpu_share(self) -> float | None:
        """Mean share of one core used between the first and the last sample (one pid only)."""
        if len(self.t_s) < 2 or self.restarts() or self.t_s[-1] <= self.t_s[0]:
            return None
        return (self.cpu_s[-1] - self.cpu_s[0]) / (self.t_s[-1] - self.t_s[0])

    def to_dict(self) -> dict:
        share = self.cpu_share()
        return {"t_s": [round(t, 2) for t in self.t_s], "rss_mb": [round(r / 1e6, 2) for r in self.rss_bytes],
                "anon_mb": [round(r / 1e6, 2) for r in self.anon_bytes],
                "fds": self.fds, "cpu_s": [round(c, 2) for c in self.cpu_s], "pids": sorted(set(self.pids)),
                "cpu_share": None if share is None else round(share, 3)}


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has been busy (every core, every process: ``/proc/stat``)."""
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


class Sampler:
    """Samples the tree under ``root`` (and this process as ``soak``, the client)."""

    def __init__(self, root: int | None, extra: dict[str, int] | None = None) -> None:
        self.root = root
        self.extra = dict(extra or {})  # name -> pid sampled besides the tree (attach mode: up's children)
        self.series: dict[str, Series] = {}
        #: the machine: (t_s, busy CPU seconds of every process so far, 1-minute load average)
        self.machine: list[tuple[float, float, float]] = []

    def sample(self, t_s: float) -> None:
        try:
            with open("/proc/loadavg", "rb") as f:
                load1 = float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            load1 = 0.0
        self.machine.append((t_s, machine_cpu_s(), load1))
        pids = descendants(self.root) if self.root else []
        seen: dict[str, tuple[int, int, int, int, float]] = {}
        for pid in dict.fromkeys([*pids, *self.extra.values()]):
            got = read_proc(pid)
            if got is None:
                continue
            argv, *figures = got
            role = role_of(argv)
            if role is None or role in seen:  # not ours (a shell, `timeout`), or a second copy
                continue
            seen[role] = (pid, *figures)
        me = read_proc(os.getpid())
        if me is not None:
            seen["soak"] = (os.getpid(), *me[1:])
        for role, (pid, rss, anon, fds, cpu) in seen.items():
            s = self.series.setdefault(role, Series())
            s.t_s.append(t_s)
            s.rss_bytes.append(rss)
            s.anon_bytes.append(anon)
            s.fds.append(fds)
            s.cpu_s.append(cpu)
            s.pids.append(pid)

    def machine_dict(self) -> dict:
        """Per sample period: cores busy on the whole machine, of them the stack's and the
        soak client's, the rest (other work sharing the machine), and the load average."""
        t = [m[0] for m in self.machine]
        out: dict[str, list] = {"t_s": [], "busy_cores": [], "stack_cores": [], "other_cores": [], "load1": []}
        for i in range(1, len(t)):
            dt = t[i] - t[i - 1]
            if dt <= 0:
                continue
            busy = (self.machine[i][1] - self.machine[i - 1][1]) / dt
            ours = 0.0
            for s in self.series.values():
                if t[i - 1] in s.t_s and t[i] in s.t_s:
                    a, b = s.t_s.index(t[i - 1]), s.t_s.index(t[i])
                    if s.pids[a] == s.pids[b]:
                        ours += (s.cpu_s[b] - s.cpu_s[a]) / dt
            out["t_s"].append(round(t[i], 2))
            out["busy_cores"].append(round(busy, 3))
            out["stack_cores"].append(round(ours, 3))
            out["other_cores"].append(round(max(0.0, busy - ours), 3))
            out["load1"].append(self.machine[i][2])
        return out

    def restarts(self) -> list[str]:
        return [f"{name} ({s.restarts()} new pid(s))" for name, s in sorted(self.series.items()) if s.restarts()]

    def totals(self) -> tuple[float, int]:
        """Latest RSS (MB) and fds summed over the stack (the client excluded)."""
        last = [(s.rss_bytes[-1], s.fds[-1]) for n, s in self.series.items() if n != "soak" and s.t_s]
        return sum(r for r, _ in last) / 1e6, sum(f for _, f in last)
