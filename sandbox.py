"""Where the python tool runs the programs a model writes (PLUMBING): code the run did not write.

    reply = run_program("print(2 ** 10)")                            # a bubblewrap jail (the default)
    reply = run_program(code, sandbox="http://sandbox:8080")          # a SandboxFusion server (verl's choice)
    reply = run_program(code, sandbox="process", limits={"seconds": 5})  # a plain subprocess: weaker, on request
    problem = sandbox_problem("bwrap")                               # None, or one line: the cause and the fix

Returns what the program printed (stdout, then stderr), cut to `output_chars`; a program that runs
past `seconds` raises TimeoutError; a sandbox service that does not answer raises ConnectionError.

What the jail holds (`bwrap`), and why each part: the boundary is the kernel's, set up by bubblewrap
(what Flatpak uses), never a check inside the program's own interpreter, which the program can undo.
- Its own user, pid, network, ipc, uts and cgroup namespaces, uid/gid 65534 inside, no capabilities,
  no further user namespaces: the trainer's processes, /proc entries, signals, sockets and abstract
  sockets do not exist in there; there is no network but a loopback of its own.
- A file system of read-only binds (the system's libraries, this Python and its packages) and two
  size-capped tmpfs, /tmp (the work folder) and /dev/shm: nothing of the host is writable, nothing is
  left on the host's disk, and the work folder goes with the mount namespace, whatever its modes.
  /proc/sys, /proc/sysrq-trigger and the like are read-only: the jail's uid is the trainer's outside,
  and where that is root, the kernel checks writes to them by uid alone (host-wide sysctls).
- A seccomp filter (libseccomp through pyseccomp) refusing what no program here needs and what
  widens the kernel's surface: ptrace, other processes' memory, pidfds, namespaces and mounts, bpf,
  io_uring, keyrings, modules, kexec, perf, userfaultfd, vsock (a VM's host side, which network
  namespaces don't separate), files in memory (outside the disk cap), SysV shared memory, message
  queues and semaphores and POSIX message queues (kernel memory outside every rlimit, a per-uid quota),
  TCP sockets (no network in there, and over its own loopback TCP autotunes its buffers to ~36 MiB a
  connection), a socket's buffer size (its default, 208 KiB, not 8 MiB), extended attributes (kernel
  memory a tmpfs's size does not count), a pipe's size, inotify, fanotify, flock and fcntl's record
  locks (a per-uid quota, a whole file: one call starving or signalling the others). Int arguments
  are compared on their low 32 bits, as the kernel reads them.
- Limits: rlimits set before the program runs (address space, CPU, file size, processes, 64 open
  files, 64 queued signals, no POSIX message queue bytes; a program can lower them, never raise them),
  and where this process may make cgroups, one
  per call capping the memory (tmpfs, sockets, inodes included) and processes of the whole jail.
  Without one, `memory_bound` says at start what a call can hold: its processes x RLIMIT_AS, and kernel
  memory no rlimit counts (socket and pipe buffers, a tmpfs's files: its size counts blocks).
- The user outside: run as root, bwrap runs as a host uid of each call's own (`outside_user`) where it can read
  this Python (a system, /opt or /usr/local Python; not one under root's 0700 home). Where it can't,
  the jail's uid is root's to the kernel, without capabilities: /proc's root-only files are masked,
  and the kernel waives RLIMIT_NPROC for root, so only a cgroup caps processes there.
- On the trainer's side: output read with a deadline, each stream's first `output_chars` bytes kept
  and the rest discarded; at the deadline the jail's processes are killed by their host pids, pid 1
  (bwrap's own init) first, and its pid namespace takes every descendant with it, a daemon or a new
  session included, with or without a cgroup; then the call returns. A trainer killed mid-call takes
  its jails with it (bwrap's init holds a parent-death signal no program in the jail can clear), and
  the next start removes what it left (sweep_leftovers: work folders, cgroups).
- CPU: where there are cgroups, this process's calls share one process's CPU weight (`trainer_group`).
What it does not hold: kernel bugs (a jail shares the kernel; SandboxFusion's service puts programs
on other machines), CPU time taken from the trainer within `seconds` where there is no cgroup (each
call weighs as a process), and whatever a user's own tool does (tools.py: those run in a thread).
"""

import atexit
import contextlib
import functools
import itertools
import json
import math
import os
import re
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

LIMITS = {"seconds": 10.0, "memory_mb": 1024, "file_mb": 16, "disk_mb": 64, "processes": 32, "output_chars": 4000}
OPEN_FILES = 64  # RLIMIT_NOFILE of each process in the jail: a descriptor can hold a socket's buffers, kernel memory
SERVICE_GRACE_S = 5.0  # a sandbox service's answer may take this long past `seconds` (queueing, start-up)
SERVICE_MAX_BYTES = 4 << 20  # a sandbox service's answer is read up to this size

# Runs first in the program's interpreter: the limits, then the program. The audit hook (PEP 578) is
# not a boundary (the program can undo it): it only tells the model at once what the jail would refuse
# anyway. argv: work folder, memory MB, CPU s, file MB, processes, open files.
_BOOTSTRAP = r"""
import ctypes, os, resource, sys
root, memory_mb, cpu_s, file_mb, processes, open_files = sys.argv[1], *map(int, sys.argv[2:7])
for limit, value in ((resource.RLIMIT_AS, memory_mb << 20), (resource.RLIMIT_CORE, 0),
                     (resource.RLIMIT_FSIZE, file_mb << 20), (resource.RLIMIT_NPROC, processes),
                     (resource.RLIMIT_NOFILE, open_files), (resource.RLIMIT_SIGPENDING, 64),
                     (resource.RLIMIT_MSGQUEUE, 0)):
    resource.setrlimit(limit, (value, value))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU, then SIGKILL (soft = hard: SIGKILL only)
for flags in (0x40000000, 0x10000000 | 0x40000000):  # --python-sandbox process: no network where the kernel allows
    if ctypes.CDLL(None, use_errno=True).unshare(flags) == 0:  # CLONE_NEWNET (as a user, with CLONE_NEWUSER)
        break
def hook(event, args):
    if event == "socket.connect" and not str(args[1]).startswith(("('127.", "('::1'", "('localhost'")):
        raise PermissionError("sandbox: this program has no network")
    if event == "open" and isinstance(args[0], str) and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
        if not os.path.abspath(args[0]).startswith((root + os.sep, "/dev/")):
            raise PermissionError(f"sandbox: write files in the current folder ({root}), not {args[0]}")
sys.addaudithook(hook)
sys.argv = ["main.py"]
exec(compile(open("main.py").read(), "main.py", "exec"), {"__name__": "__main__"})
"""

# Refused with EPERM inside the jail (see the module docstring); clone3 answers ENOSYS so that the C
# library falls back to clone, whose flags the filter can read (a new user namespace is refused there).
DENIED_SYSCALLS = (
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    "kcmp",
    "setns",
    "unshare",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "bpf",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "perf_event_open",
    "userfaultfd",
    "open_by_handle_at",
    "name_to_handle_at",
    "swapon",
    "swapoff",
    "reboot",
    "syslog",
    "acct",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "uselib",
    "vhangup",
    "memfd_create",
    "memfd_secret",  # files in memory: outside the disk cap
    "shmget",
    "msgget",
    "semget",  # SysV shared memory, message queues and semaphores: kernel memory outside every rlimit (3 GiB a process)
    "mq_open",  # POSIX message queues: bytes of a per-host-uid quota (RLIMIT_MSGQUEUE), one call draining the others'
    "setxattr",
    "lsetxattr",
    "fsetxattr",  # user xattrs on the jail's tmpfs: kernel memory its size cap does not count (2.6 GB in 6 s)
    "inotify_init",
    "inotify_init1",
    "fanotify_init",
    "fanotify_mark",  # file activity on the shared read-only binds; groups of a per-host-uid quota
    "flock",
)  # per host uid (128 instances) or a whole file: one call starving others
# fcntl's record locks (F_GETLK, F_SETLK, F_SETLKW and their OFD forms): a read-only file shared by every call is
# flock's channel between calls again; F_SETPIPE_SZ: a pipe past its default 16 pages draws on a per-host-uid quota
DENIED_FCNTL = (5, 6, 7, 36, 37, 38, 1031, 1024, 1025, 1026)
# ... and F_SETLEASE/F_GETLEASE (a lease on a shared file holds its writers 45 s) and F_NOTIFY (dnotify: inotify's
# older twin, the file activity of the shared read-only binds)
# socket(AF_INET or AF_INET6, SOCK_STREAM): the jail has no network, and TCP over its own loopback autotunes its
# buffers past SO_SNDBUF's refusal (~36 MiB a connection: 1.2 GB in 4.5 s from 4 processes, outside a v1 cgroup)
DENIED_STREAMS = (2, 10)


def run_program(code: str, *, sandbox: str = "bwrap", limits: dict | None = None) -> str:
    """Run `code` where `sandbox` says ('bwrap', 'process', or a SandboxFusion URL), with `limits`
    over LIMITS. Never waits past `seconds` + 1 s (a service: + SERVICE_GRACE_S)."""
    lim = {**LIMITS, **(limits or {})}
    if sandbox.startswith(("http://", "https://")):
        return run_on_service(code, sandbox, lim)
    with tempfile.TemporaryDirectory(prefix=f"sandbox-{os.getpid()}-", ignore_cleanup_errors=True) as host_dir:  # whose
        cpu_s = math.ceil(lim["seconds"]) + 1  # a busy loop meets the wall-clock limit first
        if sandbox == "bwrap":
            files = [_memfd("main.py", code.encode()), _memfd("seccomp", seccomp_filter())]
            cmd, root = jail_command(code_fd=files[0], seccomp_fd=files[1], lim=lim), "/tmp"
            env = JAIL_ENV  # none of the trainer's variables (its keys) in any process of the jail
        else:
            files, root = [], os.path.realpath(host_dir)
            with open(os.path.join(root, "main.py"), "w") as f:
                f.write(code)
            cmd, env = [sys.executable, "-I", "-c", _BOOTSTRAP], {**JAIL_ENV, "HOME": root, "TMPDIR": root}
        cmd += bootstrap_args(root, lim, memory_mb=lim["memory_mb"], cpu_s=cpu_s)
        groups = make_cgroups(lim)
        if sandbox == "bwrap":
            cmd = outside_user(next(_jails)) + cmd
        proc = start_jail(cmd, groups=groups, files=files, env=env, cwd=host_dir, stdin=subprocess.DEVNULL)
        try:
            out, err, dropped, finished = read_bounded(proc, seconds=lim["seconds"], keep=lim["output_chars"])
        finally:
            stop_jail(proc, groups)
    if not finished:
        raise TimeoutError(f"the program ran longer than {lim['seconds']:g} s and was stopped")
    return reply_text(
        out.decode(errors="replace"),
        err.decode(errors="replace"),
        dropped=dropped,
        note=end_note(proc.returncode, sandbox=sandbox, memory_mb=lim["memory_mb"], cpu_s=cpu_s),
        cut=lim["output_chars"],
    )


def bootstrap_args(root: str, lim: dict, *, memory_mb: int, cpu_s: int) -> list[str]:
    """_BOOTSTRAP's argv after the command: the work folder, then the limits it sets before the program runs."""
    return [root, str(memory_mb), str(cpu_s), str(lim["file_mb"]), str(lim["processes"]), str(OPEN_FILES)]


def start_jail(cmd: list[str], *, groups: list[str], files: list[int], env: dict, cwd=None, stdin=None):
    """Popen of a jail's command in a session of its own, its `groups` (make_cgroups) joined first, with `files` (the
    memfds it is handed) passed and then closed here; stdout and stderr are pipes."""
    if groups:  # the shell joins the cgroups (as this process's user), then becomes the command
        procs = " ".join(os.path.join(g, "cgroup.procs") for g in groups)
        cmd = ["/bin/sh", "-c", 'for p in $0; do echo $$ > "$p"; done; exec "$@"', procs, *cmd]
    try:
        return subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=files,
            start_new_session=True,
        )
    finally:
        for fd in files:
            os.close(fd)


def stop_jail(proc, groups: list[str]):
    """Kill a jail started by start_jail and reap it. The jail's pid 1 by its host pid first: it may have cleared the
    parent-death signal bwrap gave it, and outlive bwrap with its children where no cgroup holds them. Its death ends
    every process of its pid namespace. Then bwrap, or the process sandbox's group (start_new_session); then whatever
    its cgroups still hold, and the cgroups."""
    for pid in descendants(proc.pid):
        kill(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    remove_cgroups(groups)


def end_note(returncode: int, *, sandbox: str, memory_mb: int, cpu_s: int) -> str:
    """What the model reads after the output of a program killed by a signal ('' for an exit): which signal, and the
    likely limit. bwrap exits 128 + n for a program killed by signal n, and the same for one that exits 128 + n
    itself: from bwrap the note says both and asks (a program's own CPU time, which would tell RLIMIT_CPU's kill,
    needs a waiter in the jail: a fork of its interpreter, 1.35x the call's CPU. Measured, not taken)."""
    signum = -returncode if returncode < 0 else returncode - 128 if sandbox == "bwrap" and returncode > 128 else 0
    if not signum:
        return ""
    name = signal.strsignal(signum) or str(signum)  # SIGSYS: a refused ABI
    why = {signal.SIGKILL: f", over its {memory_mb} MB of memory", signal.SIGXCPU: f", over its {cpu_s} s of CPU time"}
    if returncode < 0:
        return f"(killed by {name}{why.get(signum, '')}{'?' * (signum in why)})"
    return f"(exit code {returncode}: killed by {name}{why.get(signum, '')}?)"


def memory_bound(workers: int, limits: dict | None = None) -> str:
    """The most memory the python tool's programs can hold, `workers` calls at once, as one start-up line."""
    lim, ram_gib = {**LIMITS, **(limits or {})}, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    if any(f in ("memory.max", "memory.limit_in_bytes") for _, files in cgroup_parents() for f in files):
        per_call, how = lim["memory_mb"], "a memory cgroup holds each call's jail: tmpfs, sockets, inodes included"
    else:  # RLIMIT_AS is per process; the kernel's own memory for a call's sockets, pipes and files has no rlimit
        socket_kib = int(_read("/proc/sys/net/core/wmem_default") or 212992) >> 10
        pipes_mib = int(_read("/proc/sys/fs/pipe-user-pages-soft") or 16384) / 256  # a user's pipes past 4 KiB each
        buffers = lim["processes"] * OPEN_FILES * socket_kib / 1024 + pipes_mib
        inodes = os.sysconf("SC_PHYS_PAGES") // 2  # a tmpfs's files, whatever its size (~1 KiB each)
        per_call = lim["processes"] * lim["memory_mb"] + 2 * lim["disk_mb"] + buffers + 2 * inodes / 1024
        how = (
            f"no memory cgroup here (root or a delegated cgroup makes one): {lim['memory_mb']} MiB caps each process, "
            f"not the call: {lim['processes']} processes, two tmpfs of {lim['disk_mb']} MiB, and kernel memory "
            f"no rlimit counts: {buffers / 1024:.1f} GiB of socket and pipe buffers ({OPEN_FILES} descriptors "
            f"a process, {socket_kib} KiB each), {2 * inodes / 2**20:.1f} GiB of tmpfs inodes ({inodes} files a tmpfs)"
        )
    return (
        f"python tool: at most {per_call / 1024:.1f} GiB a call ({how}), {workers} calls at once (--tool-workers): "
        f"{workers * per_call / 1024:.1f} GiB of host memory at worst, on a machine of {ram_gib:.1f} GiB"
    )


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid`, parents before children (/proc/PID/task/*/children)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
        except OSError:  # it exited
            continue
        for task in tasks:
            for child in map(int, _read(f"/proc/{parent}/task/{task}/children").split()):
                found.append(child)
                todo.append(child)
    return found


def kill(pid: int):
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone; or no longer ours (its pid taken again)
        pass


def reply_text(out: str, err: str, *, dropped: int, note: str, cut: int) -> str:
    """What the model reads: stdout, then stderr, then a note, cut to `cut` characters."""
    text = out + (("\n" if out else "") + "stderr:\n" + err.strip() if err else "") + ("\n" + note if note else "")
    more = max(len(text) - cut, 0) + dropped
    return text[:cut] + f"\n... ({more} more characters cut)" if more else text


JAIL_ENV = {
    "PATH": "/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",  # thread pools reserve memory that RLIMIT_AS counts
    "SANDBOX_OWNER": str(os.getpid()),
}  # whose jail a process is (ps, tests; several trainers on a host)


def jail_command(*, code_fd: int, seccomp_fd: int, lim: dict, binds: list[str] = ()) -> list[str]:
    """bwrap's command line: the namespaces, the read-only system and Python (and `binds`, read-only, at their own
    paths), /tmp and /dev/shm as size-capped tmpfs, the program copied in as /tmp/main.py, the seccomp filter, then
    this Python."""
    cmd = [
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        "65534",
        "--gid",
        "65534",
        "--cap-drop",
        "ALL",
        "--die-with-parent",  # bwrap's own init is pid 1: its parent-death signal is one a program can't clear
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
    ]
    for name, value in {**JAIL_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
        cmd += ["--setenv", name, value]
    cmd += ["--ro-bind", "/usr", "/usr", "--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # on a merged /usr these are links into it
        cmd += ["--symlink", os.readlink(path), path] if os.path.islink(path) else ["--ro-bind-try", path, path]
    cmd += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys"]  # as root the jail's uid is root's: read-only
    for path in ("/proc/sysrq-trigger", "/proc/irq", "/proc/bus", "/proc/fs"):  # sysctls, sysrq, devices
        cmd += ["--ro-bind-try", path, path]
    for path in closed_proc_entries():  # as root the jail's uid is root's: it could read them
        cmd += ["--tmpfs", path, "--remount-ro", path] if os.path.isdir(path) else ["--ro-bind", "/dev/null", path]
    cmd += [
        "--dev",
        "/dev",
        "--size",
        str(lim["disk_mb"] << 20),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(lim["disk_mb"] << 20),
        "--tmpfs",
        "/tmp",
    ]
    for prefix in [*python_prefixes(), *binds]:  # read-only
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--remount-ro", "/dev", "--remount-ro", "/"]  # bwrap's own root and /dev are tmpfs too: not writable
    return cmd + [
        "--file",
        str(code_fd),
        "/tmp/main.py",
        "--chdir",
        "/tmp",
        "--seccomp",
        str(seccomp_fd),
        sys.executable,
        "-I",
        "-c",
        _BOOTSTRAP,
    ]


def python_prefixes() -> list[str]:
    """This Python's folders outside /usr: a venv, a Python of its own (pyenv, uv, conda)."""
    found = {sys.prefix, sys.base_prefix, os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))}
    return sorted(p for p in found if p != "/usr" and not p.startswith("/usr/"))


@functools.cache
def closed_proc_entries() -> tuple[str, ...]:
    """What of /proc only root may read (kernel log, page flags, slab and vmalloc layout, timers, tty drivers, the
    root-only sysctls of /proc/sys), but the processes' own folders and /proc/sys/net (per network namespace: the
    jail's own): masked in the jail (empty), whose uid may be root's outside."""
    found = []
    for folder, dirs, files in os.walk("/proc"):
        dirs[:] = [d for d in dirs if folder != "/proc" or not (d.isdigit() or d in ("self", "thread-self"))]
        dirs[:] = [d for d in dirs if os.path.join(folder, d) != "/proc/sys/net"]  # the jail's own network's
        for name in dirs + files:
            mode = os.lstat(os.path.join(folder, name)).st_mode
            if not (stat.S_ISLNK(mode) or mode & stat.S_IROTH):
                found.append(os.path.join(folder, name))
        dirs[:] = [d for d in dirs if os.path.join(folder, d) not in found]
    return tuple(found)


_jails = itertools.count()  # this process's bwrap calls: each its own host uid, as root (outside_user)
HOST_UIDS = 1 << 20  # the host uids calls take, as root: 2^20 + (this process's pid % 2048) x 1024 + call % 1024


def outside_user(call: int) -> list[str]:
    """What bwrap's command starts with: as root, setpriv to a host uid of this call's own outside the jail too (the
    jail's uid inside is 65534 either way), if such a user can run bwrap and read this Python. Then the jail's
    processes are nobody's to the kernel, not root's: it enforces RLIMIT_NPROC (waived for root), root-only files in
    /proc stay closed, a process that got out would be nobody, and the kernel's per-uid quotas (processes, pipe pages,
    descriptors in flight, queued signals, inotify and fanotify groups) are each call's own: one call can't drain them
    for the others. Else [] (this process's own user: as root, the jail's uid is root's outside). Not Popen's `user=`:
    with it Python forks the whole trainer instead of vfork, ~0.7 s a call in a GRPO run."""
    if not can_drop_root():
        return []
    uid = HOST_UIDS + (os.getpid() % 2048) * 1024 + call % 1024  # calls at once: --tool-workers, far below 1024
    return [shutil.which("setpriv"), "--reuid", str(uid), "--regid", str(uid), "--clear-groups", "--"]


@functools.cache
def can_drop_root() -> bool:
    """As root: whether another user can run bwrap and read this Python (others may search every folder on the way
    and read it: a system, /opt or /usr/local Python; not one under root's 0700 home), and setpriv is there."""

    def usable(path: str, bit: int) -> bool:  # by others: every folder on the way searchable, then `bit` (o+r, o+x)
        parts = [path[:i] or "/" for i in range(len(path) + 1) if i == len(path) or path[i] == "/"]
        return all(os.stat(p).st_mode & 0o001 for p in parts[:-1]) and bool(os.stat(path).st_mode & bit)

    bwrap = os.path.realpath(shutil.which("bwrap") or "/")
    return bool(
        os.geteuid() == 0
        and shutil.which("setpriv")
        and usable(bwrap, 0o001)
        and all(usable(p, 0o005) for p in python_prefixes())
    )


@functools.cache
def seccomp_filter() -> bytes:
    """DENIED_SYSCALLS as a BPF program for bwrap --seccomp (built once per process)."""
    import pyseccomp  # lazy: only the jail needs it

    f = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        f.add_rule(pyseccomp.ERRNO(1), name)  # EPERM
    f.add_rule(pyseccomp.ERRNO(38), "clone3")  # ENOSYS: use clone
    f.add_rule(
        pyseccomp.ERRNO(1), "clone", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0x10000000, 0x10000000)
    )  # CLONE_NEWUSER
    # AF_VSOCK (network namespaces don't hold it). socket's domain is an int: the kernel reads the low 32 bits of the
    # 64-bit argument, so the rule compares those alone, or (1 << 32) | 40 would pass it and open a vsock
    f.add_rule(pyseccomp.ERRNO(1), "socket", pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0xFFFFFFFF, 40))
    for domain in DENIED_STREAMS:  # the type's low 4 bits (SOCK_NONBLOCK and SOCK_CLOEXEC above them)
        family, stream = (
            pyseccomp.Arg(0, pyseccomp.MASKED_EQ, 0xFFFFFFFF, domain),
            pyseccomp.Arg(1, pyseccomp.MASKED_EQ, 0xF, 1),
        )
        f.add_rule(pyseccomp.ERRNO(1), "socket", family, stream)
    for command in DENIED_FCNTL:
        f.add_rule(pyseccomp.ERRNO(1), "fcntl", pyseccomp.Arg(1, pyseccomp.MASKED_EQ, 0xFFFFFFFF, command))
    for option in (7, 8):  # SOL_SOCKET's SO_SNDBUF, SO_RCVBUF: a socket queues its default (208 KiB), not 8 MiB
        level, name = (pyseccomp.Arg(i, pyseccomp.MASKED_EQ, 0xFFFFFFFF, value) for i, value in ((1, 1), (2, option)))
        f.add_rule(pyseccomp.ERRNO(1), "setsockopt", level, name)
    fd = _memfd("seccomp", b"")
    with os.fdopen(fd, "w+b") as file:
        f.export_bpf(file)
        file.seek(0)
        return file.read()


def _memfd(name: str, data: bytes) -> int:
    """A file in memory holding `data`, read from its start: how bwrap is handed the program and the filter."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def read_bounded(proc, *, seconds: float, keep: int) -> tuple[bytes, bytes, int, bool]:
    """Read `proc`'s stdout and stderr until it exits and both close, or `seconds` pass: (the first `keep`
    bytes of each, how many bytes were discarded, whether it exited in time). One thread, a deadline,
    nothing buffered past `keep`: a runaway print costs the trainer no memory, and a descendant that
    holds the pipes open after the program exits costs it 0.2 s. `proc` is left unreaped (its process
    group can still be killed safely)."""
    deadline, exited = time.monotonic() + seconds, False
    kept, dropped = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}, 0
    pidfd = os.pidfd_open(proc.pid)  # readable once the program exits; waits on it without reaping it
    with selectors.DefaultSelector() as selector:
        for fd in (*kept, pidfd):
            os.set_blocking(fd, False)
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                if key.fd == pidfd:
                    exited, deadline = True, min(deadline, time.monotonic() + 0.2)
                    selector.unregister(pidfd)
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fd)
                room = max(keep - len(kept[key.fd]), 0)
                kept[key.fd] += chunk[:room]
                dropped += max(len(chunk) - room, 0)
    os.close(pidfd)
    return bytes(kept[proc.stdout.fileno()]), bytes(kept[proc.stderr.fileno()]), dropped, exited


# ----------------------------------------------------------------------------------------------
# cgroups: memory, processes and CPU share of the whole jail, where this process may make them


@functools.cache
def cgroup_parents() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The cgroup folders this process may make children in, each with its limit files: this process's
    own cgroup in a v2 hierarchy whose children get memory and pids (and cpu), or in v1's memory, pids, cpu."""
    parents, own = [], {}
    for line in open("/proc/self/cgroup").read().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else ["(v2)"]:
            own[c] = path
    for line in open("/proc/self/mountinfo").read().splitlines():
        fields, (fstype, _, options) = line.split(" - ")[0].split(), line.split(" - ")[1].split()
        mount_root, mount_point = fields[3], fields[4]
        found = [c for c in ("memory", "pids", "cpu") if fstype == "cgroup" and c in options.split(",")]
        if fstype == "cgroup2":
            found = ["(v2)"]
        for c in found:
            if c not in own or not (own[c] + "/").startswith(mount_root.rstrip("/") + "/"):
                continue
            where = os.path.join(mount_point, own[c][len(mount_root.rstrip("/")) :].lstrip("/"))
            if c == "(v2)":
                enabled = _read(os.path.join(where, "cgroup.subtree_control")).split()
                files = ("memory.max", "memory.swap.max", "pids.max") if {"memory", "pids"} <= set(enabled) else ()
                files += ("cpu.weight",) if files and "cpu" in enabled else ()
            else:
                files = {"memory": ("memory.limit_in_bytes",), "pids": ("pids.max",), "cpu": ("cpu.shares",)}[c]
            if files and os.access(where, os.W_OK):
                parents.append((where, files))
    return tuple(parents)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


_calls = itertools.count()


def make_cgroups(lim: dict) -> list[str]:
    """A fresh cgroup per call in this process's group of each parent (trainer_group), with the call's limits;
    [] where none can be made."""
    made, call = [], str(next(_calls))
    values = {
        "memory.max": lim["memory_mb"] << 20,
        "memory.limit_in_bytes": lim["memory_mb"] << 20,
        "memory.swap.max": 0,
        "pids.max": lim["processes"],
    }
    values.update({"cpu.shares": 1024, "cpu.weight": 100})  # v1's and v2's default: the calls weigh alike
    for parent, files in cgroup_parents():
        path = os.path.join(parent, f"sandbox-{os.getpid()}", call)
        try:
            trainer_group(os.path.dirname(path))
            os.mkdir(path)
            made.append(path)
            for name in files:
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(values[name]))
        except OSError as e:
            remove_cgroups(made)
            raise RuntimeError(f"could not set up the sandbox's cgroup {path}: {e}") from None
    return made


@functools.cache
def trainer_group(path: str) -> str:
    """This process's cgroup (`path`: <parent>/sandbox-<pid>), made at its first call, removed at exit: its calls'
    go in it and share its CPU weight, a new group's default, one process's at nice 0, however many run. 16 busy
    calls slowed the trainer's own thread 6.6x on 2 cores, each call weighing as a process; now 1.5x, and a lone call
    beside busy processes is not starved as a small weight per call would be (bench/results/sandbox_cpu.json)."""
    os.makedirs(path, exist_ok=True)
    enabled = _read(os.path.join(os.path.dirname(path), "cgroup.subtree_control")).split()  # v2: pass them on
    if enabled:
        with open(os.path.join(path, "cgroup.subtree_control"), "w") as f:
            f.write(" ".join("+" + c for c in ("memory", "pids", "cpu") if c in enabled))
    atexit.register(remove_cgroups, [path])
    return path


def sweep_leftovers() -> list[str]:
    """What trainers killed mid-call left behind (SIGKILL, the OOM killer, a second Ctrl-C's os._exit): their calls'
    work folders (<tmp>/sandbox-<pid>-*) and cgroups (sandbox-<pid>/<call>), where no process <pid> runs any more.
    Their jails died with them (bwrap's own init, the jail's pid 1, keeps the parent-death signal; a cgroup's
    leftovers are killed here). Called at start (tools.select_tools). Returns what it removed."""
    removed, tmp = [], tempfile.gettempdir()

    def dead(name: str, pattern: str) -> bool:
        m = re.fullmatch(pattern, name)
        return bool(m) and not os.path.exists(f"/proc/{m.group(1)}")

    for name in os.listdir(tmp):
        if dead(name, r"sandbox-(\d+)-\w+"):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            removed.append(os.path.join(tmp, name))
    for parent, _ in cgroup_parents():
        for name in os.listdir(parent):
            if dead(name, r"sandbox-(\d+)"):
                group = os.path.join(parent, name)
                calls = [os.path.join(group, c) for c in os.listdir(group) if os.path.isdir(os.path.join(group, c))]
                remove_cgroups(calls + [group])
                removed.append(group)
    return removed


def remove_cgroups(paths: list[str]):
    """Kill whatever is left in the call's cgroups (the process sandbox's escaped descendants), then remove them."""
    for path in paths:
        for _ in range(200):  # a killed process leaves its cgroup a moment later
            pids = _read(os.path.join(path, "cgroup.procs")).split()
            for pid in pids:
                kill(int(pid))
            try:
                os.rmdir(path)
                break
            except OSError:
                time.sleep(0.005)


# ----------------------------------------------------------------------------------------------
# A SandboxFusion server (github.com/bytedance/SandboxFusion): POST /run_code


def run_on_service(code: str, url: str, lim: dict) -> str:
    """The program run by a SandboxFusion server: its `run_timeout` and `memory_limit_MB` are ours, the
    answer is read up to SERVICE_MAX_BYTES and cut as a local run's is."""
    body = json.dumps(
        {"code": code, "language": "python", "run_timeout": lim["seconds"], "memory_limit_MB": lim["memory_mb"]}
    ).encode()
    request = urllib.request.Request(
        url.rstrip("/") + "/run_code", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=lim["seconds"] + SERVICE_GRACE_S) as answer:
            raw = answer.read(SERVICE_MAX_BYTES + 1)
        if len(raw) > SERVICE_MAX_BYTES:
            raise ValueError(f"its answer is over {SERVICE_MAX_BYTES >> 20} MiB")
        result = json.loads(raw)
    except urllib.error.HTTPError as e:
        raise ConnectionError(
            f"the sandbox service at {url} answered HTTP {e.code}: {e.read(500).decode(errors='replace')}"
        ) from None
    except (OSError, ValueError) as e:  # refused, unreachable, timed out, not JSON
        raise ConnectionError(f"the sandbox service at {url} did not answer: {e}") from None
    run = result.get("run_result") or {}
    if result.get("status") == "SandboxError" or run.get("status") == "Error":
        raise ConnectionError(
            f"the sandbox service at {url} failed to run the program: {result.get('message', '')[:500]}"
        )
    if run.get("status") == "TimeLimitExceeded":
        raise TimeoutError(f"the program ran longer than {lim['seconds']:g} s and was stopped")
    out, err = str(run.get("stdout") or ""), str(run.get("stderr") or "")
    cut = lim["output_chars"]
    return reply_text(out[:cut], err[:cut], dropped=max(len(out) - cut, 0) + max(len(err) - cut, 0), note="", cut=cut)


# ----------------------------------------------------------------------------------------------
# Fail closed: before anything loads


def missing_jail_parts(jail: str, fixes: str) -> str | None:
    """None if bubblewrap and the seccomp filter are here, else one line: what `jail` lacks, how to install it, `fixes`
    (the way on without it)."""
    if shutil.which("bwrap") is None:
        return f"{jail} needs bubblewrap, which is not installed: apt-get install bubblewrap" + fixes
    try:
        seccomp_filter()
    except (ImportError, OSError, RuntimeError) as e:
        return (
            f"{jail} needs libseccomp and pyseccomp ({e}): pip install pyseccomp, apt-get install libseccomp2" + fixes
        )
    return None


def sandbox_problem(sandbox: str) -> str | None:
    """None if programs can run in `sandbox`, else one line: what is wrong and how to fix it. Runs a
    one-line program the way every call will."""
    fixes = "; or pass --python-sandbox process to accept a plain subprocess's weaker isolation (docs/tools.md: the python tool)"
    if sandbox == "process":
        return None
    if sandbox == "bwrap":
        if missing := missing_jail_parts("the python tool's jail", fixes):
            return missing
    elif not sandbox.startswith(("http://", "https://")):
        return f"--python-sandbox {sandbox} must be bwrap, process or a SandboxFusion server's http(s):// URL"
    try:
        reply = run_program("print(6 * 7)", sandbox=sandbox, limits={"seconds": 30.0})
    except (ConnectionError, TimeoutError, OSError, RuntimeError) as e:
        return f"--python-sandbox {sandbox}: {e}" + (
            "" if sandbox == "bwrap" else ": start the service, or fix the URL" + fixes
        )
    if reply.strip() == "42":
        return None
    if sandbox != "bwrap":
        return f"--python-sandbox {sandbox}: a test program printed {reply.strip()[:300]!r}, not 42" + fixes
    return (
        f"bubblewrap could not make the python tool's jail: {reply.strip()[:300]!r}. The kernel or the container refuses "
        "user namespaces: allow them (sysctl kernel.unprivileged_userns_clone=1 and user.max_user_namespaces > 0; in "
        "Docker, --security-opt seccomp=unconfined --security-opt apparmor=unconfined, or --privileged)" + fixes
    )
