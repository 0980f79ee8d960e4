"""marslm.data.sandbox: model-written code cannot change the machine, reach the network, outlive its
timeout or forge a pass. The attacks are the ones a probe of the earlier Python-level guard
found to work, and the later probes' (the verdict token read back, a host unix socket, a user
namespace of its own). Every test first checks that the attack would have worked without the
sandbox (run without it, the program writes the file, reaches the socket, spawns the child, ...),
so none passes for a trivial reason."""

from __future__ import annotations

import secrets
import socket
from pathlib import Path

import pytest

from marslm import cli
from marslm.data import humaneval, sandbox, toy

MANY_PROCESSES = sandbox.Limits(processes=10**5)  # forks allowed: only the sandbox contains them


def test_this_machine_has_isolation():
    # CI installs bubblewrap (scripts/ensure-bubblewrap.sh): every code-scoring test runs isolated.
    assert sandbox.isolation_problem() is None


@pytest.fixture
def precious(outside_dir) -> Path:
    path = outside_dir / "precious.txt"
    path.write_text("precious")
    path.chmod(0o666)  # only the sandbox stands between the program and the file
    return path


@pytest.fixture
def unsandboxed(monkeypatch):
    """``unsandboxed(program, **kwargs)``: ``run_python`` as --unsafe-exec runs it where there is
    no sandbox, to check that an attack would work without one."""

    def run(program: str, **kwargs) -> sandbox.RunResult:
        with monkeypatch.context() as patch:
            patch.setattr(sandbox, "_probe", ["no sandbox (the test's control run)"])
            patch.setattr(sandbox, "_unsafe_allowed", True)
            return sandbox.run_python(program, **kwargs)

    return run


def test_reimported_io_cannot_write_outside(precious, unsandboxed):
    program = f"""
import _io
for mode in ("w", "a", "r+"):
    try:
        _io.open({str(precious)!r}, mode).write("pwned")
    except OSError as exc:
        print(mode, exc.errno)
"""
    assert unsandboxed(program).returncode == 0 and precious.read_text().startswith("pwned")
    precious.write_text("precious")
    result = sandbox.run_python(program)
    assert result.isolated and result.stdout, result.stderr
    assert precious.read_text() == "precious"


def test_reimported_posix_cannot_delete_and_forks_stay_inside(precious, unsandboxed):
    program = f"""
import posix
try:
    posix.unlink({str(precious)!r})
except OSError as exc:
    print("unlink", exc.errno)
pid = posix.fork()
if pid == 0:
    try:
        posix.unlink({str(precious)!r})
    finally:
        posix._exit(0)
posix.waitpid(pid, 0)
print("forked")
"""
    assert "forked" in unsandboxed(program, limits=MANY_PROCESSES).stdout and not precious.exists()
    precious.write_text("precious")
    result = sandbox.run_python(program, limits=MANY_PROCESSES)
    assert "forked" in result.stdout, result.stderr
    assert precious.read_text() == "precious"
    # by default it may not start a process at all
    refused = sandbox.run_python("import posix\nposix.fork()")
    assert refused.returncode != 0 and "BlockingIOError" in refused.stderr


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_a_new_session_child_does_not_outlive_the_timeout():
    marker = "marslm-sleeper-" + secrets.token_hex(8)
    program = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}], start_new_session=True,
                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print("spawned", flush=True)
time.sleep(60)
"""
    result = sandbox.run_python(program, timeout=3.0, limits=MANY_PROCESSES)
    assert result.timed_out and "spawned" in result.stdout, result.stderr
    assert _processes_with(marker) == []


def test_no_network_not_even_localhost():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    program = f"""
import _socket
s = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
try:
    s.connect(("127.0.0.1", {port}))
    s.send(b"exfiltrated")
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
"""
    try:
        result = sandbox.run_python(program)
        assert result.stdout.startswith("refused"), result.stdout + result.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


def test_no_unix_socket_of_the_machine(outside_dir, unsandboxed):
    path = outside_dir / "service.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    path.chmod(0o777)  # a world-writable socket: anyone on the machine may connect
    listener.listen(1)
    listener.settimeout(0.5)
    program = f"""
import _socket
s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
try:
    s.connect({str(path)!r})
    s.send(b"exfiltrated")
    print("connected")
except OSError as exc:
    print("refused", exc.errno)
"""
    try:
        assert unsandboxed(program).stdout.startswith("connected")
        listener.accept()[0].close()
        result = sandbox.run_python(program)
        assert result.isolated and result.stdout.startswith("refused"), result.stdout + result.stderr
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()


# A user namespace of its own, where the program is root, a tmpfs of its own mounted there, and
# 42 MiB written to it in files under the file-size limit: past the 32 MiB of its /tmp.
OWN_TMPFS = """
import ctypes, os
CLONE_NEWUSER, CLONE_NEWNS, PR_SET_DUMPABLE = 0x10000000, 0x00020000, 4
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.getuid(), os.getgid()
libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its /proc/self/*_map are its own again after a drop from root
if libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
    print("unshare refused", ctypes.get_errno())
    raise SystemExit
for name, text in (("uid_map", f"0 {uid} 1"), ("setgroups", "deny"), ("gid_map", f"0 {gid} 1")):
    with open(f"/proc/self/{name}", "w") as f:
        f.write(text)
if libc.mount(b"none", b"/tmp", b"tmpfs", 0, b"size=1g") != 0:
    print("mount refused", ctypes.get_errno())
    raise SystemExit
"""
FILL_TMP = """
for i in range(6):
    with open(f"/tmp/big{i}", "wb") as f:
        f.write(b"x" * (7 * 2**20))
print("wrote", sum(os.path.getsize(f"/tmp/big{i}") for i in range(6)))
"""


def test_no_user_namespace_and_no_memory_past_the_cap(unsandboxed):
    control = unsandboxed(OWN_TMPFS + FILL_TMP)
    if "unshare refused" not in control.stdout:  # where this machine gives anyone a user namespace
        assert control.stdout.startswith("wrote 44040192"), control.stdout + control.stderr
    result = sandbox.run_python(OWN_TMPFS + FILL_TMP)
    assert result.isolated and result.stdout.startswith("unshare refused"), result.stdout + result.stderr
    full = sandbox.run_python("import os\n" + FILL_TMP)  # the cap it tried to get around
    assert full.returncode != 0 and "No space left on device" in full.stderr
    for directory in ("/", "/dev", "/dev/shm"):  # memory-backed too, where they are the sandbox's own
        attempt = sandbox.run_python(f"open({directory + '/x'!r}, 'wb').write(b'x')")
        assert attempt.returncode != 0 and "Error" in attempt.stderr, (directory, attempt.stderr)


def test_limits_and_timeout():
    assert sandbox.run_python("x = bytearray(2 * 10**9)").returncode != 0  # address space
    assert sandbox.run_python("open('big', 'wb').write(b'x' * (9 * 2**20))").returncode != 0  # file size
    spin = sandbox.run_python("while True: pass", timeout=30)  # CPU seconds
    assert spin.returncode != 0 and not spin.timed_out
    sleeper = sandbox.run_python("import time; time.sleep(30)", timeout=1)  # wall clock
    assert sleeper.timed_out
    work = sandbox.run_python("import os\nopen('note', 'w').write('hi')\nprint(sorted(os.listdir('.')), os.getcwd())")
    assert work.stdout.strip() == "['main.py', 'note'] /tmp"  # a private work dir
    hidden = sandbox.run_python("import os\nprint(os.listdir('/tmp'))")
    assert hidden.stdout.strip() == "['main.py']"  # not the machine's /tmp


# The verdict token read back from where it came in, printed, then an early exit.
TOKEN_READ_BACK = (
    "import os\nos.lseek(0, 0, os.SEEK_SET)\nprint(os.read(0, 100).decode().strip(), flush=True)\nos._exit(0)",
    "import os\nprint(open('/proc/self/fd/0').read().strip(), flush=True)\nos._exit(0)",
)


@pytest.mark.parametrize(
    "forgery",
    [
        "import os\nos._exit(0)",
        "import sys\nsys.modules['__main__']._exit(0)",
        "import posix\nposix._exit(0)",
        "raise SystemExit(0)",
        "import os\nos._exit = lambda code: None\nraise ValueError",
        "import sys\nsys.stdin.read()\nprint('token?')\nimport os\nos._exit(0)",
        *TOKEN_READ_BACK,
    ],
)
def test_an_early_exit_is_not_a_pass(forgery):
    assert sandbox.run_to_end("print('fine')") == "fine"
    assert sandbox.run_to_end(forgery) is None
    assert sandbox.run_to_end("import time; time.sleep(30)", timeout=1) is None


def test_scorers_use_the_harness_verdict():
    add = {
        "task_id": "T/0",
        "entry_point": "add",
        "prompt": "def add(a, b):\n",
        "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n",
    }
    forged = [
        "    import os\n    os._exit(0)\n",
        "    return 0\nimport os\nos._exit(0)\n",
        "    return 0\nimport sys\nsys.modules['__main__']._exit(0)\n",
    ]
    assert humaneval.run_checks([add] * 4, ["    return a + b\n", *forged]) == [True, False, False, False]
    example = next(ex for ex in toy.make_split("test", 40, families=["code"]))
    assert toy.score(example, example.answer)
    assert not toy.score(example, example.answer + "\nimport os\nos._exit(0)")


def test_without_isolation_code_is_refused_unless_unsafe_exec(monkeypatch, capsys):
    monkeypatch.setattr(sandbox, "_probe", ["bubblewrap (bwrap) is not installed"])
    monkeypatch.setattr(sandbox, "_unsafe_allowed", False)
    with pytest.raises(sandbox.SandboxUnavailable, match="--unsafe-exec"):
        sandbox.run_python("print(1)")
    with pytest.raises(sandbox.SandboxUnavailable):
        toy.score(toy.make_split("test", 4, families=["code"])[0], "def f(): pass")

    # the CLI refuses before loading anything (the model path does not even exist)
    assert cli.main(["eval", "--model", "no/such-model-dir", "--data", "toy", "--n", "4"]) == 2
    assert "--unsafe-exec" in capsys.readouterr().err

    sandbox.allow_unsafe_exec()
    result = sandbox.run_python("print(1)")
    assert result.stdout == "1\n" and not result.isolated
    assert sandbox.run_to_end("import os\nos._exit(0)") is None  # the verdict still holds
    assert all(sandbox.run_to_end(forgery) is None for forgery in TOKEN_READ_BACK)


def test_unsafe_exec_still_has_the_timeout(monkeypatch):
    monkeypatch.setattr(sandbox, "_probe", ["bubblewrap (bwrap) is not installed"])
    monkeypatch.setattr(sandbox, "_unsafe_allowed", True)
    result = sandbox.run_python("import time; time.sleep(30)", timeout=1)
    assert result.timed_out and not result.isolated
