"""The hostile and harmless programs of tests/rewards/test_sandbox.py and the helpers that
run them under each isolation mode this machine has (bwrap, namespaces, auto with bwrap
hidden from PATH) and find sandbox processes left behind; the sandbox tests' skips (an
isolation this machine lacks, no pid namespace for a PID 1 that does not reap)."""

import contextlib
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from grpo_core.sandbox import (
    Limits,
    SandboxUnavailable,
    detect_isolation,
)

from .sandbox_reporter import reporter_attacks

LIMITS = Limits(wall_seconds=4.0, cpu_seconds=1, memory_bytes=512 << 20, nproc=16)
TOKEN = secrets.token_hex(6)
SECRET = "s3cr3t-" + TOKEN
REPO = Path(__file__).resolve().parents[2]
OUTSIDE = [
    f"{tempfile.gettempdir()}/grpo-escape-{TOKEN}",
    f"/tmp/grpo-escape-{TOKEN}",
    f"{REPO}/grpo-escape-{TOKEN}",
    f"{Path.home()}/grpo-escape-{TOKEN}",
    f"/dev/shm/grpo-escape-{TOKEN}",
    f"{os.path.realpath(sys.base_prefix)}/grpo-escape-{TOKEN}",
]

ADD_TESTS = [
    "assert add(1, 2) == 3",
    "assert add(2, 2) == 4",
    "assert abs(add(5, 5) - 10) < 1e-9",  # patched builtins must not reach the tests
]
GOOD = "def add(a, b):\n    return a + b\n"


def prog(src: str) -> str:
    return textwrap.dedent(src).strip() + "\n"


def hostile(port: int) -> dict[str, str]:
    """The hostile program classes; ``port``: a port listening on the scorer's 127.0.0.1."""
    return {**_hostile(port), **reporter_attacks()}


def _hostile(port: int) -> dict[str, str]:
    return {
        # resource exhaustion
        "infinite_loop": prog("while True:\n    pass"),
        "sleep_forever": prog("import time\ntime.sleep(1000)"),
        "memory_bomb": prog("""
            blocks = []
            while True:
                blocks.append(bytearray(50 << 20))
        """),
        "huge_alloc": prog("x = bytearray(1 << 40)"),
        "fork_bomb": prog("""
            import os
            while True:
                try:
                    os.fork()
                except OSError:
                    pass
        """),
        "fork_bomb_setsid": prog("""
            import os, time
            for _ in range(10000):
                try:
                    if os.fork() == 0:
                        os.setsid()
                        time.sleep(1000)
                except OSError:
                    pass
            def add(a, b):
                return 0
        """),
        # the host
        "write_outside": prog(f"""
            for p in {OUTSIDE!r}:
                try:
                    with open(p, "w") as f:
                        f.write("pwned")
                except OSError:
                    pass
            def add(a, b):
                return 0
        """),
        "read_secret": prog(f"""
            import os
            leaked = os.environ.get("GRPO_SANDBOX_SECRET", "")
            for d in os.listdir("/proc"):
                if d.isdigit() or d == "self":
                    try:
                        leaked += open(f"/proc/{{d}}/environ", "rb").read().decode("latin-1")
                    except OSError:
                        pass
            for p in ["/proc/1/environ", "/proc/{os.getpid()}/environ", "/proc/{os.getppid()}/environ"]:
                try:
                    leaked += open(p, "rb").read().decode("latin-1")
                except OSError:
                    pass
            def add(a, b):
                return a + b if "{SECRET}" in leaked else 0  # only a leak passes
        """),
        # the kernel's shared state (issue 44): each passes only if the call succeeded
        "keyring": prog("""
            import ctypes, os
            libc = ctypes.CDLL(None, use_errno=True)
            keyctl = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine, -1)
            # KEYCTL_GET_KEYRING_ID (0) of the session keyring (-3), create: 0
            ring = libc.syscall(keyctl, 0, ctypes.c_long(-3), 0)
            def add(a, b):
                return a + b if ring >= 0 else 0
        """),
        "memfd_outside_the_cap": prog("""
            import ctypes, mmap, os
            libc = ctypes.CDLL(None, use_errno=True)
            nr = {"x86_64": 319, "aarch64": 279}.get(os.uname().machine, -1)
            fds, held, chunk = [], 0, b"x" * (1 << 20)
            for _ in range(48):  # 48 x 15 MiB (RLIMIT_FSIZE is 16), beyond the 512 MiB cap
                fd = libc.syscall(nr, b"x", 0)
                if fd < 0:
                    break
                try:
                    for _ in range(15):  # written, so the pages really exist
                        os.write(fd, chunk)
                    fds.append(fd)
                    held += 15 << 20
                except OSError:
                    break
            def add(a, b):
                return a + b if held > (512 << 20) else 0
        """),
        "io_uring": prog("""
            import ctypes
            libc = ctypes.CDLL(None, use_errno=True)
            params = ctypes.create_string_buffer(120)
            fd = libc.syscall(425, 8, params)  # io_uring_setup, the same number everywhere
            def add(a, b):
                return a + b if fd >= 0 else 0
        """),
        "read_repo": prog(f"""
            def add(a, b):
                try:
                    open("{REPO}/pyproject.toml").read()
                    return a + b  # only a sandbox that shows the host filesystem passes
                except OSError:
                    return None
        """),
        "network_localhost": prog(f"""
            import socket
            def add(a, b):
                try:
                    s = socket.create_connection(("127.0.0.1", {port}), timeout=1)
                    s.sendall(b"{TOKEN}")
                    s.close()
                    return a + b  # only a sandbox with the host's network passes
                except OSError:
                    return None
        """),
        "network_outside": prog("""
            import socket
            def add(a, b):
                try:
                    socket.create_connection(("1.1.1.1", 53), timeout=1).close()
                    return a + b
                except OSError:
                    return None
        """),
        "kill_parent": prog("""
            import os, signal
            for target in (os.getppid(), 1):
                try:
                    os.kill(target, signal.SIGKILL)
                except OSError:
                    pass
            try:
                os.kill(-1, signal.SIGKILL)
            except OSError:
                pass
            def add(a, b):
                return 0
        """),
        # early exits
        "sys_exit_module": prog("import sys\nsys.exit(0)\ndef add(a, b):\n    return 0"),
        "os_exit_module": prog("import os\nos._exit(0)"),
        "sys_exit_in_candidate": prog("import sys\ndef add(a, b):\n    sys.exit(0)"),
        "os_exit_in_candidate": prog("import os\ndef add(a, b):\n    os._exit(0)"),
        "atexit_exit0": prog("""
            import atexit, os
            atexit.register(os._exit, 0)
            def add(a, b):
                return 0
        """),
        "keyboard_interrupt": prog("def add(a, b):\n    raise KeyboardInterrupt"),
        "sigkill_self": prog(
            "import os, signal\ndef add(a, b):\n    os.kill(os.getpid(), signal.SIGKILL)"
        ),
        # the verdict
        "always_equal": prog("""
            class Yes:
                def __eq__(self, other):
                    return True
                def __ne__(self, other):
                    return False
                def __bool__(self):
                    return True
                def __sub__(self, other):
                    return 0
            def add(a, b):
                return Yes()
        """),
        "always_equal_spoofed": prog("""
            class Meta(type):
                def __eq__(cls, other):
                    return True
                __hash__ = type.__hash__
            class Yes(int, metaclass=Meta):
                __module__ = "numpy"
                def __eq__(self, other):
                    return True
                def __bool__(self):
                    return True
            def add(a, b):
                return Yes()
        """),
        "patched_builtins": prog("""
            import builtins
            builtins.abs = lambda x: 0
            builtins.bool = lambda x=False: True
            builtins.type = lambda *a: int
            builtins.isinstance = lambda *a: True
            builtins.exec = lambda *a, **k: None
            builtins.compile = lambda *a, **k: compile("pass", "x", "exec")
            def add(a, b):
                builtins.abs = lambda x: 0  # again, while the tests run
                return 0
        """),
        "patched_modules": prog("""
            import json, os, ast
            json._default_encoder = None
            json.dumps = lambda o, **k: '["", "assert", "a0.0", true, ""]'
            os.write = lambda fd, data: len(data)
            ast.parse = lambda *a, **k: ast.Module(body=[], type_ignores=[])
            def add(a, b):
                return 0
        """),
        "harness_globals": prog("""
            import __main__, gc, os
            found = [k for k in dir(__main__) if "NONCE" in k.upper() or k.startswith("_FD")]
            def add(a, b):
                g = globals()
                for k in list(g):  # swap the check function for one that always passes
                    if k.startswith("_grpo_"):
                        orig = g[k]
                        g[k] = lambda *a, orig=orig: orig(a[0], lambda: True)
                return 0
        """),
        "forge_records": prog("""
            import json, os, sys
            fake = "\\n".join(json.dumps([n, "assert", f"a{i}.0", True, ""]) for n in ["", "0" * 32] for i in range(3))
            for fd in range(1, 64):
                try:
                    os.write(fd, (fake + "\\n").encode())
                except OSError:
                    pass
            print(fake)
            def add(a, b):
                return 0
        """),
        "fork_then_pass": prog("""
            import os
            pid = os.fork()
            def add(a, b):
                return a + b if pid == 0 else 0  # only the forked child is correct
        """),
        "close_verdict_fds": prog("""
            import os
            os.closerange(3, 256)
            def add(a, b):
                return 0
        """),
    }


# the programs that cannot harm the host even without isolation (run under "none" too)
HARMLESS = [
    "sys_exit_module",
    "os_exit_module",
    "sys_exit_in_candidate",
    "os_exit_in_candidate",
    "atexit_exit0",
    "keyboard_interrupt",
    "sigkill_self",
    "always_equal",
    "always_equal_spoofed",
    "patched_builtins",
    "patched_modules",
    "harness_globals",
    "forge_records",
    "fork_then_pass",
    "close_verdict_fds",
    "frame_emit",
    "gc_emit",
    "signal_frame_emit",
    "thread_frames_emit",
    "settrace_locals",
    "numpy_object_array",
    "nested_user_namespace",
    "second_process",
]


@contextlib.contextmanager
def bwrap_hidden():
    """PATH without ``bwrap``: every other executable of PATH, linked into a temp folder."""
    old = os.environ.get("PATH", "")
    with tempfile.TemporaryDirectory(prefix="grpo-path-") as d:
        for folder in old.split(os.pathsep):
            with contextlib.suppress(OSError):
                for name in os.listdir(folder or "."):
                    if name != "bwrap" and not os.path.exists(os.path.join(d, name)):
                        os.symlink(os.path.join(folder, name), os.path.join(d, name))
        os.environ["PATH"] = d
        try:
            assert shutil.which("bwrap") is None
            yield
        finally:
            os.environ["PATH"] = old


def available(mode: str | None = None) -> bool:
    """Whether isolation ``mode`` runs here (``None``: the one this machine is set to use)."""
    try:
        detect_isolation(mode)
    except SandboxUnavailable:
        return False
    return True


def isolation_or_skip(mode: str | None = None):
    """The isolation ``mode`` gives on this machine (``None``: the strongest that works);
    skips the calling test, saying why, where it cannot run."""
    try:
        return detect_isolation(mode)
    except SandboxUnavailable as exc:
        pytest.skip(str(exc))


def run_as_pid_1(argv: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    """``argv`` run as PID 1 of a new pid namespace (``unshare --pid --fork --mount-proc``:
    a container's entry point, which reaps no orphan); skips the calling test where there is
    no ``unshare`` or the namespace cannot be made."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare here (util-linux)")
    cmd = ["unshare", "--pid", "--fork", "--mount-proc", *argv]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0 and proc.stderr.startswith("unshare"):
        pytest.skip(f"cannot make a pid namespace here: {proc.stderr.strip()[:200]}")
    return proc


def _modes() -> list:
    out = [
        pytest.param(
            m, id=m, marks=pytest.mark.skipif(not available(m), reason=f"no {m} on this machine")
        )
        for m in ("bwrap", "namespaces")
    ]
    out.append(
        pytest.param(
            "auto-without-bwrap",
            id="auto-without-bwrap",
            marks=pytest.mark.skipif(not available("namespaces"), reason="no namespaces here"),
        )
    )
    return out


MODES = _modes()


def _sandbox_pids() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                uid = d.stat().st_uid
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if 100_000 <= uid < 900_000 and state != "Z":
                out.append(int(d.name))
    return out


def sandbox_uids_alive(grace: float = 0.0) -> list[int]:
    """Live processes of sandbox uids, after up to ``grace`` s for the kernel to reap them."""
    deadline = time.monotonic() + grace
    while (pids := _sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids
