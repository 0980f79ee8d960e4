"""Running model-written Python: in an operating-system sandbox, never in our process.

Code a model wrote (the toy suite's ``code`` family, HumanEval) is untrusted input. A Python-level
guard (blocking ``open`` or ``os.remove``) is no boundary: the code can re-import ``_io`` or
``posix``, or fork past it. So the boundary is the kernel's, through bubblewrap (``bwrap``,
Debian/Ubuntu package ``bubblewrap``):

* of the file system only the system directories (``/usr``, ``/etc``, ``/lib``, ...) and the
  interpreter's own, read-only: no ``/home``, ``/root``, ``/tmp``, ``/var`` or ``/run``, so none
  of the machine's files or unix sockets there; setuid bits ignored, no new privileges;
  ``/tmp`` (the working directory) a small private tmpfs, the one place it can write;
* on x86-64 and ARM64, a seccomp filter: no user namespace of its own (root there, it could
  mount a tmpfs past that cap) and no SysV shared memory;
* its own network namespace (no interfaces but an unconfigured loopback: no network at all),
  PID, IPC and UTS namespaces;
* run as root, it drops to ``nobody`` before the program starts, so it holds no capabilities;
* rlimits on CPU seconds, address space, file size (also what it can print), open files and
  processes; a wall-clock timeout then kills the sandbox's PID 1, which takes every process in
  the namespace with it (a child that left the process group or session included).

:func:`run_python` runs a program and returns its exit status and output. A pass/fail verdict
must not trust the exit status: the program could ``os._exit(0)`` before its tests ran. So
:func:`run_to_end` wraps the program in a harness that prints a fresh random token once the
program has run to its end, and only a run whose output ends with that token passes. (Code that
searches the interpreter's memory for the token could still forge a pass: tests that run in the
program's process can only be as trustworthy as that process. Scorers that can, compare results
outside, as the toy suite does. The sandbox is what keeps the machine safe.)

Without bubblewrap (or where it cannot create namespaces), model-written code is refused unless
the user opted in with ``--unsafe-exec`` (:func:`allow_unsafe_exec`): then it runs as a plain
child process with the same rlimits, throw-away directory and timeout, and no isolation.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import platform
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError

log = logging.getLogger("marslm.data.sandbox")

NOBODY = 65534
WORKERS = max(2, min(8, 2 * (os.cpu_count() or 1)))  # programs run at once by run_many_to_end
# What the sandbox sees of the machine, read-only, besides the interpreter's own directories: no
# /home, /root, /tmp, /var or /run, so none of the unix sockets that live there either.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


@dataclass(frozen=True)
class Limits:
    """rlimits of a sandboxed program (``processes`` counts every process of the sandbox's user,
    as RLIMIT_NPROC does: 1 means it can start none)."""

    cpu_seconds: int = 2
    memory_bytes: int = 512 * 2**20
    file_bytes: int = 8 * 2**20  # any file it writes, and what it prints
    open_files: int = 64
    processes: int = 1
    tmpfs_bytes: int = 32 * 2**20  # its writable /tmp


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class RunResult:
    returncode: int  # 0: it ended normally (bwrap reports a signal as 128 + its number)
    stdout: str
    stderr: str
    timed_out: bool
    isolated: bool  # False only under --unsafe-exec without bubblewrap


class SandboxUnavailable(UserError):
    """No isolation here, and the user did not pass --unsafe-exec."""


# ------------------------------------------------------------------------------- policy
_unsafe_allowed = False
_probe_lock = threading.Lock()
_probe: list[str | None] = []  # [] not probed yet; [None] works; [reason] does not


def allow_unsafe_exec(allowed: bool = True) -> None:
    """Let model-written code run without isolation when bubblewrap is unavailable (``--unsafe-exec``)."""
    global _unsafe_allowed
    _unsafe_allowed = allowed


def isolation_problem() -> str | None:
    """Why programs cannot run isolated here (None: they can). Probed once per process."""
    with _probe_lock:
        if not _probe:
            _probe.append(_probe_isolation())
        return _probe[0]


def _probe_isolation() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    result = _run("print('ok')", 30.0, "", DEFAULT_LIMITS, isolated=True)
    if result.returncode != 0 or result.stdout.strip() != "ok":
        last = (result.stderr.strip().splitlines() or [f"exit status {result.returncode}"])[-1]
        return f"bwrap cannot create a sandbox here ({last})"
    return None


def require_isolation() -> None:
    """Raise :class:`SandboxUnavailable` unless programs run isolated or ``--unsafe-exec`` was given.

    Commands that will score code call this before any slow work, so the refusal comes first.
    """
    problem = isolation_problem()
    if problem is not None and not _unsafe_allowed:
        raise SandboxUnavailable(
            f"model-written code needs a sandbox, and {problem}. Install bubblewrap (Debian/Ubuntu: "
            "apt-get install bubblewrap), or pass --unsafe-exec to run that code without isolation"
        )


# ----------------------------------------------------------------------------------- runs
def run_python(source: str, timeout: float = 5.0, *, stdin: str = "", limits: Limits = DEFAULT_LIMITS) -> RunResult:
    """Run ``source`` as ``__main__`` of a fresh ``python -I -S`` in the sandbox; never raises for
    what the program does. ``timed_out``: it ran past ``timeout`` wall-clock seconds and was killed.
    Raises :class:`SandboxUnavailable` when there is no isolation and no ``--unsafe-exec``."""
    require_isolation()
    isolated = isolation_problem() is None
    if not isolated:
        _warn_unsafe_once()
    return _run(source, timeout, stdin, limits, isolated)


def run_to_end(program: str, timeout: float = 5.0, *, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """What ``program`` printed, if it ran to its end (no exception, no exit of its own, within
    ``timeout``); None otherwise. The verdict is a token the harness prints after the program."""
    token = secrets.token_hex(16)
    result = run_python(_HARNESS.format(program=program), timeout, stdin=token + "\n", limits=limits)
    out, _, last = result.stdout.rstrip("\n").rpartition("\n")
    if result.timed_out or result.returncode != 0 or last != token:
        return None
    return out[:-1] if out.endswith("\n") else out  # the newline the harness put before the token


def run_many_to_end(
    programs: Sequence[str], timeout: float = 5.0, *, limits: Limits = DEFAULT_LIMITS
) -> list[str | None]:
    """:func:`run_to_end` for each program, ``WORKERS`` at a time (each waits mostly on its child)."""
    if not programs:
        return []
    require_isolation()
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(lambda program: run_to_end(program, timeout, limits=limits), programs))


# Takes the token from stdin, a pipe (:func:`_run`), before the program runs, and puts /dev/null
# in its place: a pipe read is gone, so neither rewinding fd 0 nor reopening /proc/self/fd/0 gives
# the token back. Keeps the functions it needs afterwards, so the program replacing them cannot
# fake the ending. The program is not __main__ (as in HumanEval's own harness): its
# `if __name__ == "__main__":` demo code stays out.
_HARNESS = r"""
import os as _os, sys as _sys
_token = _sys.stdin.readline().strip()
_sys.stdin.close()
_null = _os.open(_os.devnull, _os.O_RDONLY)
_os.dup2(_null, 0)
_os.close(_null)
_exit, _write, _flush = _os._exit, _os.write, _sys.stdout.flush
try:
    exec(compile({program!r}, "<program>", "exec"), {{"__name__": "program"}})
    _flush()
    _write(1, ("\n" + _token + "\n").encode())
except BaseException:
    _exit(1)
_exit(0)
"""

# Runs first in the child: limits, then (as root, inside bwrap) no more root, then the program.
_BOOTSTRAP = rf"""
import json, os, resource, sys
limits, drop_root, path = json.loads(sys.argv[1]), sys.argv[2] == "1", sys.argv[3]
if drop_root and os.getuid() == 0:
    os.setgroups([])
    os.setgid({NOBODY})
    os.setuid({NOBODY})
for name, value in limits.items():
    hard = resource.getrlimit(getattr(resource, name))[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(getattr(resource, name), (value, value))
sys.argv = [path]
with open(path, encoding="utf-8") as f:
    code = compile(f.read(), path, "exec")
del json, os, resource, f, limits, drop_root
exec(code, {{"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}})
"""

_RLIMITS = {
    "RLIMIT_CPU": "cpu_seconds",
    "RLIMIT_AS": "memory_bytes",
    "RLIMIT_FSIZE": "file_bytes",
    "RLIMIT_NOFILE": "open_files",
    "RLIMIT_NPROC": "processes",
    "RLIMIT_CORE": None,
    "RLIMIT_MSGQUEUE": None,  # POSIX message queues: memory, and it needs none
}


def _run(source: str, timeout: float, stdin: str, limits: Limits, isolated: bool) -> RunResult:
    values = {name: (getattr(limits, field) if field else 0) for name, field in _RLIMITS.items()}
    interpreter = os.path.realpath(sys.executable)
    with tempfile.TemporaryDirectory(prefix="marslm-sandbox-") as host:
        program = Path(host, "main.py")
        program.write_text(source, encoding="utf-8")
        inner_path = "/tmp/main.py" if isolated else str(program)
        argv = [interpreter, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(values), "1" if isolated else "0", inner_path]
        info_read, child_fds = None, []  # child_fds: bwrap's, closed here once it has them
        if isolated:
            info_read, info_write = os.pipe()
            seccomp_fd = _seccomp_fd()
            child_fds = [info_write] + ([seccomp_fd] if seccomp_fd is not None else [])
            argv = _bwrap_argv(program, interpreter, limits, info_write, seccomp_fd) + argv
        try:
            # stdin is a pipe, not a file: what the program reads from it cannot be read again
            with open(Path(host, "stdout"), "wb") as f_out, open(Path(host, "stderr"), "wb") as f_err:
                process = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=f_out,
                    stderr=f_err,
                    env={},
                    cwd="/" if isolated else host,
                    start_new_session=True,
                    pass_fds=tuple(child_fds),
                )
                while child_fds:
                    os.close(child_fds.pop())
                try:
                    process.communicate(stdin.encode("utf-8"), timeout=timeout)
                    returncode, timed_out = process.returncode, False
                except subprocess.TimeoutExpired:
                    returncode, timed_out = _kill(process, info_read), True
                finally:
                    process.stdin.close()
        finally:
            for fd in [info_read, *child_fds]:
                if fd is not None:
                    os.close(fd)
        return RunResult(
            returncode, _read(Path(host, "stdout"), limits), _read(Path(host, "stderr"), limits), timed_out, isolated
        )


def _bwrap_argv(program: Path, interpreter: str, limits: Limits, info_fd: int, seccomp_fd: int | None) -> list[str]:
    argv = ["bwrap"]
    for path in SYSTEM_PATHS:
        if os.path.islink(path):  # /bin -> usr/bin where /usr is merged
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # The interpreter and its standard library may live elsewhere (pyenv in /root, a conda prefix).
    needed = {os.path.realpath(sys.base_prefix), os.path.dirname(interpreter)}
    for path in sorted(needed):
        if path not in SYSTEM_PATHS and not any(path.startswith(q + "/") for q in (*SYSTEM_PATHS, *needed)):
            for parent in reversed(Path(path).parents[:-1]):  # bwrap would make them 0700
                argv += ["--perms", "0755", "--dir", str(parent)]
            argv += ["--ro-bind", path, path]
    argv += [
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--perms",
        "1777",
        "--size",
        str(limits.tmpfs_bytes),
        "--tmpfs",
        "/tmp",
        "--ro-bind",
        str(program),
        "/tmp/main.py",
        # bwrap's own root and /dev are memory too: read-only, so /tmp (capped) is the one place to write
        "--remount-ro",
        "/dev",
        "--remount-ro",
        "/",
        "--chdir",
        "/tmp",
        "--unshare-net",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--info-fd",
        str(info_fd),
    ]
    if seccomp_fd is not None:
        argv += ["--seccomp", str(seccomp_fd)]
    if os.geteuid() == 0:  # bwrap run by root keeps root's capabilities unless told otherwise
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return argv


# ------------------------------------------------------------------------------- seccomp
# What the program may not do although its mounts and rlimits would let it, as a classic BPF
# filter that bwrap installs before the program starts (--seccomp):
#   * a user namespace of its own (unshare or clone with CLONE_NEWUSER): it is root there, and
#     can mount a tmpfs of its own, past the cap of /tmp, and reach more of the kernel;
#   * clone3, whose flags lie in memory a filter cannot read: ENOSYS, and libc falls back to clone;
#   * SysV shared memory (shmget): a segment outlives its mapping, outside RLIMIT_AS;
#   * any other system call ABI (i386, x32), where these numbers mean other calls.
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYSCALLS = {
    "x86_64": {"clone": 56, "unshare": 272, "clone3": 435, "shmget": 29},
    "aarch64": {"clone": 220, "unshare": 97, "clone3": 435, "shmget": 194},
}
_X32_BIT = 0x40000000
CLONE_NEWUSER = 0x10000000
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|op|K, BPF_RET|K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000


def seccomp_filter(machine: str) -> bytes | None:
    """The filter for ``machine`` (``platform.machine()``), as bwrap reads it; None where there is
    none (the program then runs without one)."""
    if machine not in _SYSCALLS:
        return None
    nr = _SYSCALLS[machine]
    first_arg = 16 if sys.byteorder == "little" else 20  # the low half of seccomp_data.args[0]
    steps = [
        (_LD, 4),  # seccomp_data.arch
        (_JEQ, _AUDIT_ARCH[machine], None, "enosys"),
        (_LD, 0),  # seccomp_data.nr
        (_JGE, _X32_BIT, "enosys", None),
        (_JEQ, nr["clone3"], "enosys", None),
        (_JEQ, nr["shmget"], "eperm", None),
        (_JEQ, nr["unshare"], "flags", None),
        (_JEQ, nr["clone"], "flags", None),
        (_RET, _ALLOW),
        "flags",
        (_LD, first_arg),
        (_JSET, CLONE_NEWUSER, "eperm", None),
        (_RET, _ALLOW),
        "eperm",
        (_RET, _ERRNO | errno.EPERM),
        "enosys",
        (_RET, _ERRNO | errno.ENOSYS),
    ]
    instructions = [step for step in steps if not isinstance(step, str)]
    labels, at = {}, 0
    for step in steps:
        if isinstance(step, str):
            labels[step] = at
        else:
            at += 1
    code = b""
    for i, (op, k, *jumps) in enumerate(instructions):
        jt, jf = (labels[target] - i - 1 if target else 0 for target in (jumps or (None, None)))
        code += struct.pack("=HBBI", op, jt, jf, k)  # struct sock_filter
    return code


def _seccomp_fd() -> int | None:
    """The read end of a pipe holding :func:`seccomp_filter` for this machine, for bwrap."""
    code = seccomp_filter(platform.machine())
    if code is None:
        return None
    read, write = os.pipe()
    os.write(write, code)  # a few hundred bytes: far below a pipe's capacity
    os.close(write)
    return read


def _kill(process: subprocess.Popen, info_fd: int | None) -> int:
    """Kill everything the run started; returns the exit status.

    Killing the sandbox's PID 1 makes the kernel kill every process of its PID namespace before
    PID 1 is reaped, and bwrap exits once it is: when ``wait`` returns, nothing is left. Without
    bwrap (``--unsafe-exec``) the best there is: the child's process group."""
    pid = _sandbox_pid(info_fd) if info_fd is not None else None
    try:
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        else:
            os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        return process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # bwrap did not notice: kill it (--die-with-parent does the rest)
        os.killpg(process.pid, signal.SIGKILL)
        return process.wait()


def _sandbox_pid(info_fd: int) -> int | None:
    """The host PID of the sandbox's PID 1, from bwrap's --info-fd JSON (written at start-up)."""
    ready, _, _ = select.select([info_fd], [], [], 1.0)
    if not ready:
        return None
    try:
        return int(json.loads(os.read(info_fd, 65536).decode())["child-pid"])
    except (ValueError, KeyError, OSError):
        return None


def _read(path: Path, limits: Limits) -> str:
    with open(path, "rb") as f:
        return f.read(limits.file_bytes).decode("utf-8", errors="replace")


_warned = []


def _warn_unsafe_once() -> None:
    if not _warned:
        _warned.append(True)
        log.warning("running model-written code WITHOUT isolation (--unsafe-exec): %s", isolation_problem())
