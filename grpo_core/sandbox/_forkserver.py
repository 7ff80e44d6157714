"""The warm tool sandbox's server: runs INSIDE a sandbox (bwrap or namespaces, started by
``forkserver.py``) as ``python -s -P -B -c <_GRPO_NO_SERVE = True + _seccomp.py + _wire.py +
_candidate.py + this file's text> <control fd>``. Stdlib only.

It starts once, imports the stdlib modules tool calls use, and then serves one call at a time
on its control socket (a ``SOCK_SEQPACKET`` the scorer holds the other end of). A request is
the call's limits as JSON plus two file descriptors passed with it (``SCM_RIGHTS``): a pipe
holding the program and a pipe for the call's reply. The server never reads either: the
program and what it prints go from the scorer to the call process and back without passing
through this process's memory, so nothing of one call is in what the next call is forked
from. Per call:

1. fork the call process. It reads the program, keeps only the reply pipe (fd 3; stdin,
   stdout and stderr on /dev/null, every other descriptor closed, the control socket
   included), starts its own session, sets the call's rlimits, becomes a fresh random uid
   (when the server may: the scorer is root) with no capability left (checked), dies with the
   server, locks itself with the candidate's seccomp filter (no process, no namespace, no
   tracing) and runs the program as ``_candidate.py`` runs a tool call: same namespace,
   capture and reply. Its exit status is the verdict (0: ran without raising), read here;
2. wait for it up to the call's wall clock, then SIGKILL every process of the sandbox but pid
   1 and this one (``kill(-1)``; this process holds ``CAP_KILL`` for it) and reap until none
   is left (the server is a child subreaper: orphans come back to it);
3. wipe ``/tmp`` (the call's working directory), as the call's uid, in a process of its own;
4. answer ``{"rc", "timeout", "clean"}``: the exit status, whether the wall clock ran out,
   and whether ``/tmp`` is empty again. Not clean: the server exits (the scorer starts a
   fresh one).

When the scorer is root the server itself runs as another random uid, with ``CAP_SETUID``,
``CAP_SETGID`` and ``CAP_KILL`` only (the rest dropped from every set, the bounding set
included), not dumpable: a call process (another uid, no capability, seccomp) can neither
signal, trace nor read it. Otherwise (user namespace of one uid) it holds no capability and
a call runs as the same uid: it could kill or stop the server, which the scorer sees (the
call fails, the server is replaced), but not trace or read it (not dumpable, seccomp).
"""

import ctypes
import json
import resource
import select
import shutil
import socket
import sys

_PRELOAD = ("math", "cmath", "decimal", "fractions", "statistics", "random", "re", "string",
            "itertools", "functools", "collections", "datetime", "heapq", "bisect", "operator",
            "textwrap", "copy")  # fmt: skip
_KEEP = (5, 6, 7)  # CAP_KILL, CAP_SETGID, CAP_SETUID
_PR_CAPBSET_DROP, _PR_SET_KEEPCAPS, _PR_SET_CHILD_SUBREAPER = 24, 8, 36
_PR_CAP_AMBIENT, _AMBIENT_CLEAR_ALL = 47, 4
_LIBC = ctypes.CDLL(None, use_errno=True)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]  # fmt: skip


def _capset(caps):
    bits = sum(1 << c for c in caps)
    data = (_CapData * 2)()
    for i in (0, 1):
        data[i].effective = data[i].permitted = (bits >> (32 * i)) & 0xFFFFFFFF
    if _LIBC.capset(ctypes.byref(_CapHeader(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def _caps_now():
    """This process's permitted and effective capability sets (``capget``)."""
    data = (_CapData * 2)()
    if _LIBC.capget(ctypes.byref(_CapHeader(0x20080522, 0)), data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    return [
        data[0].permitted | data[1].permitted << 32,
        data[0].effective | data[1].effective << 32,
    ]


def _random_uid(low, span):
    return low + int.from_bytes(os.urandom(4), "little") % span  # noqa: F821 (_seccomp's os)


def _become_server():
    """Root: become a random uid holding only ``_KEEP``; else drop every capability."""
    if os.getuid() != 0:  # noqa: F821
        _capset(())
        return False
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in _KEEP:
            _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    _LIBC.prctl(_PR_CAP_AMBIENT, _AMBIENT_CLEAR_ALL, 0, 0, 0)
    _LIBC.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)
    uid = _random_uid(950_000, 50_000)
    os.setgroups([])  # noqa: F821
    os.setresgid(uid, uid, uid)  # noqa: F821
    os.setresuid(uid, uid, uid)  # noqa: F821
    _LIBC.prctl(_PR_SET_KEEPCAPS, 0, 0, 0, 0)
    _capset(_KEEP)
    if _caps_now() != [sum(1 << c for c in _KEEP)] * 2:
        raise OSError(1, "the server's capabilities")
    return True


def _call_process(req, prog_fd, out_fd, uid, server, lock):
    """The forked call process (never returns). ``lock``: the prepared seccomp filter."""
    try:
        raw = b""
        while chunk := os.read(prog_fd, 1 << 16):  # noqa: F821
            raw += chunk
        program = json.loads(raw)
        del raw
        null = os.open("/dev/null", os.O_RDWR)  # noqa: F821
        for fd in (0, 1, 2):
            os.dup2(null, fd)  # noqa: F821
        os.dup2(out_fd, 3)  # noqa: F821
        os.closerange(4, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # noqa: F821
        os.setsid()  # noqa: F821
        for name, value in req["rlimits"].items():
            resource.setrlimit(getattr(resource, name), tuple(value))
        if uid is not None:
            os.setgroups([])  # noqa: F821
            os.setresgid(uid, uid, uid)  # noqa: F821
            os.setresuid(uid, uid, uid)  # noqa: F821
        _capset(())
        if _caps_now() != [0, 0]:
            os._exit(125)  # noqa: F821
        _LIBC.prctl(4, 1, 0, 0, 0)  # PR_SET_DUMPABLE: its own /proc/self, as a fresh candidate
        set_pdeathsig_kill()  # noqa: F821 (_seccomp.py)
        if os.getppid() != server:  # noqa: F821
            os._exit(125)  # noqa: F821
        lock()
        os.chdir("/tmp")  # noqa: F821
    except BaseException:
        os._exit(125)  # noqa: F821
    exit_now = os._exit  # noqa: F821 (taken before the program can patch it)
    capture = _Capture(int(req["output_chars"]))  # noqa: F821 (_candidate.py)
    ok, error, _ = _exec_program({"program": program}, True, capture)  # noqa: F821
    del program
    try:
        wire_send(3, {"ok": ok, "error": error, "output": capture.value()})  # noqa: F821
    except BaseException:  # the candidate ends here with a traceback: exit status 1
        exit_now(1)
    exit_now(0 if ok else 1)


def _wipe(uid):
    """Empty /tmp, as the call's uid (the owner of what is there), in a process of its own;
    True when /tmp is empty afterwards."""
    if not os.listdir("/tmp"):  # noqa: F821
        return True
    pid = os.fork()  # noqa: F821
    if pid == 0:
        try:
            if uid is not None:
                os.setresgid(uid, uid, uid)  # noqa: F821
                os.setresuid(uid, uid, uid)  # noqa: F821
            for top, dirs, _ in os.walk("/tmp"):  # noqa: F821
                for d in dirs:  # its own folders, whatever their modes: open them up first
                    try:  # noqa: SIM105
                        os.chmod(os.path.join(top, d), 0o700)  # noqa: F821
                    except OSError:
                        pass
            for name in os.listdir("/tmp"):  # noqa: F821
                path = "/tmp/" + name
                if os.path.isdir(path) and not os.path.islink(path):  # noqa: F821
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    try:  # noqa: SIM105
                        os.unlink(path)  # noqa: F821
                    except OSError:
                        pass
        finally:
            os._exit(0)  # noqa: F821
    os.waitpid(pid, 0)  # noqa: F821
    return not os.listdir("/tmp")  # noqa: F821


def _call(req, fds, root, lock):
    uid = _random_uid(100_000, 800_000) if root else None
    server = os.getpid()  # noqa: F821
    pid = os.fork()  # noqa: F821
    if pid == 0:
        _call_process(req, fds[0], fds[1], uid, server, lock)
    for fd in fds:
        os.close(fd)  # noqa: F821
    pidfd = os.pidfd_open(pid)  # noqa: F821
    timeout = not select.select([pidfd], [], [], float(req["wall"]))[0]
    os.close(pidfd)  # noqa: F821
    try:  # noqa: SIM105
        os.kill(-1, 9)  # noqa: F821 (every process here but pid 1 and this one)
    except OSError:
        pass
    rc = None
    while True:  # reap the call process and anything that came back to this subreaper
        try:
            done, status = os.waitpid(-1, 0)  # noqa: F821
        except ChildProcessError:
            break
        if done == pid:
            rc = os.waitstatus_to_exitcode(status)  # noqa: F821
    return {"rc": rc, "timeout": timeout, "clean": _wipe(uid)}


def _server():
    ctl = socket.socket(fileno=int(sys.argv[1]))
    root = _become_server()
    set_not_dumpable()  # noqa: F821 (_seccomp.py)
    if _LIBC.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_CHILD_SUBREAPER")
    for name in _PRELOAD:
        __import__(name)
    # Python's first compile() in a process sets up the parser (~1.5 ms here): done once here,
    # not in every call process. Compiled, never run.
    compile("print(sum([1, 2.5]) / 3)\n", "<program>", "exec")
    lock = seccomp_locker(processes=False)  # noqa: F821 (_seccomp.py): built once, here
    ctl.send(b'{"ready": true}')
    while True:
        try:
            msg, fds, _, _ = socket.recv_fds(ctl, 65536, 2)
        except OSError:
            os._exit(0)  # noqa: F821
        if not msg or len(fds) != 2:
            os._exit(0)  # noqa: F821 (the scorer closed the socket, or a bad request)
        reply = _call(json.loads(msg), fds, root, lock)
        ctl.send(json.dumps(reply).encode())
        if not reply["clean"]:
            os._exit(3)  # noqa: F821


_server()
