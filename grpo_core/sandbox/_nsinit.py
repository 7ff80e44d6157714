"""The ``namespaces`` isolation, with no external tool: started by the scorer, as its user, as
``python -I -B -c <this file's text + _harness.py's text> <config json>``. Stdlib only.

1. ``unshare`` new mount, pid, net, ipc and uts namespaces (and a user namespace when the
   scorer is not root, mapping only its own uid), then fork: the child is pid 1 of the new pid
   namespace (the "init"); this process only waits for it and relays its exit status.
2. The init builds a new root on a tmpfs at ``root`` (a fresh empty directory the scorer made;
   the mount is private, the host never sees it): ``/usr`` and the Python installation bound
   read-only at their own paths (the parent folders created 0755, so a Python under
   ``/root`` is readable by the sandbox uid), ``/bin``-style links, ``/proc`` of the new pid
   namespace (``hidepid=2``), ``/dev/{null,zero,full,random,urandom}``, a size-limited tmpfs at
   ``/tmp`` (the working directory); the root itself is then made read-only and moved over
   ``/`` (``chroot``). Nothing else of the host is visible; the network namespace has only
   a loopback interface, down.
3. The init forks the harness process, which drops to ``uid`` (random, unprivileged; when the
   scorer is root), sets ``no_new_privs`` and the rlimits, and returns from this prelude to
   run the harness in the same interpreter (one Python start per program, not two). The init stays
   root (or holds the user namespace's capabilities), is not dumpable, and is pid 1: the
   program can neither signal nor trace it. It reaps orphans until the harness ends, then
   exits, and the kernel kills every process left in the pid namespace (a double-forked
   ``setsid`` daemon included) before the launcher sees the exit. If the launcher dies
   (the scorer died, or ``deadline`` passed), the init gets SIGKILL (parent-death signal), and
   with it the whole namespace; an init whose launcher ended before it set that signal (a
   pidfd on the launcher says so) exits at once. The launcher writes the init's pid to
   stdout: the scorer kills the init through a pidfd at its timeout and waits for its exit,
   which the kernel signals only once the namespace is empty.

A failed setup step exits 125 with ``sandbox setup failed: <step>: <errno>`` on stderr.
"""

import ctypes
import json
import os
import resource
import select
import signal
import sys

CFG = json.loads(sys.argv[1])
LIBC = ctypes.CDLL(None, use_errno=True)
CLONE = {"ns": 0x20000, "uts": 0x4000000, "ipc": 0x8000000, "user": 0x10000000}
CLONE.update({"pid": 0x20000000, "net": 0x40000000})
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, MOVE, REC = 1, 2, 4, 8, 32, 4096, 8192, 16384
PRIVATE = 1 << 18
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 1, 4, 38
# statvfs flag -> mount flag, for the flags a remount must keep (locked in a user namespace)
KEEP = {2: NOSUID, 4: NODEV, 8: NOEXEC, 1024: 1024, 2048: 2048, 4096: 1 << 21}


def fail(step, err=None):
    err = ctypes.get_errno() if err is None else err
    os.write(2, f"sandbox setup failed: {step}: {os.strerror(err)}\n".encode())
    os._exit(125)


def mount(src, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    ret = LIBC.mount(enc(src), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    if ret != 0:
        fail(f"mount {target}")


def bind_ro(src, dst):
    mount(src, dst, None, BIND)
    kept = os.statvfs(dst).f_flag
    flags = REMOUNT | BIND | RDONLY | NOSUID | NODEV
    for st, ms in KEEP.items():
        if kept & st:
            flags |= ms
    mount(None, dst, None, flags)


def write(path, text):
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def status_code(status):
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def build_root(new):
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", new, "tmpfs", NOSUID | NODEV, "size=1m,nr_inodes=4096,mode=755")
    os.mkdir(new + "/usr", 0o755)
    bind_ro("/usr", new + "/usr")
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), new + host)
        elif os.path.isdir(host):  # not a merged-/usr system
            os.mkdir(new + host, 0o755)
            bind_ro(host, new + host)
    os.mkdir(new + "/tmp", 0o1777)  # before the roots: one under /tmp (a venv there) stays seen
    mount("tmpfs", new + "/tmp", "tmpfs", NOSUID | NODEV, f"size={CFG['tmp_bytes']},mode=1777")
    for root in CFG["roots"]:  # the Python installation(s), at their own paths
        os.makedirs(new + root, mode=0o755, exist_ok=True)
        bind_ro(root, new + root)
    os.mkdir(new + "/proc", 0o555)
    proc = (b"proc", (new + "/proc").encode(), b"proc", ctypes.c_ulong(NOSUID | NODEV | NOEXEC))
    if LIBC.mount(*proc, b"hidepid=2") != 0:  # other uids' processes (the init) hidden
        mount("proc", new + "/proc", "proc", NOSUID | NODEV | NOEXEC)
    os.mkdir(new + "/dev", 0o755)
    for name in ("null", "zero", "full", "random", "urandom"):
        os.close(os.open(new + "/dev/" + name, os.O_CREAT | os.O_WRONLY, 0o666))
        mount("/dev/" + name, new + "/dev/" + name, None, BIND)
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", new + "/dev/" + name)
    os.symlink("/proc/self/fd", new + "/dev/fd")
    mount(None, new, None, REMOUNT | BIND | RDONLY | NOSUID | NODEV)
    os.chdir(new)
    mount(new, "/", None, MOVE)
    os.chroot(".")
    os.chdir("/")


def become_harness():
    """In the harness process: drop privileges and limit it, then return to run the harness
    (``_harness.py``, appended to this file's text) in this same interpreter."""
    uid = CFG["uid"]
    if os.getuid() == 0 and uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    if LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        fail("no_new_privs")
    LIBC.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # its own /proc/self, as any process
    for name, value in CFG["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    os.chdir("/tmp")
    sys.argv[1:] = [str(CFG["fd"])]


def init(launcher):
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    # the launcher ended before that: no signal will come. (getppid() cannot tell: it is 0
    # here, the parent being outside the new pid namespace)
    if select.select([launcher], [], [], 0)[0]:
        os._exit(125)
    os.close(launcher)
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    null = os.open("/dev/null", os.O_WRONLY)
    os.dup2(null, 1)  # stdout is the launcher's pid report to the scorer: not ours to hold
    os.close(null)
    os.umask(0o022)
    build_root(CFG["root"])
    LIBC.sethostname(b"sandbox", 7)
    harness = os.fork()
    if harness == 0:
        try:
            become_harness()
        except OSError as exc:
            fail("harness", exc.errno or 0)
        return
    os.close(CFG["fd"])
    os.close(0)
    while True:  # reap orphans until the harness ends; then the namespace dies with us
        try:
            pid, status = os.wait()
        except ChildProcessError:
            os._exit(125)
        if pid == harness:
            os._exit(status_code(status))


def setup():
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the scorer died: so do we
    if os.getppid() != CFG["parent"]:
        fail("scorer gone", 0)
    signal.alarm(CFG["deadline"])  # last resort if the scorer hangs: dies, and the init too
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE["ns"] | CLONE["pid"] | CLONE["net"] | CLONE["ipc"] | CLONE["uts"]
    if uid != 0:
        flags |= CLONE["user"]
    if LIBC.unshare(flags) != 0:
        fail("unshare")
    if uid != 0:  # our own uid only: no other uid exists inside, setgroups denied
        try:
            write("/proc/self/setgroups", "deny")
            write("/proc/self/uid_map", f"{uid} {uid} 1")
            write("/proc/self/gid_map", f"{gid} {gid} 1")
        except OSError as exc:
            fail("user namespace map", exc.errno or 0)
    launcher = os.pidfd_open(os.getpid())  # readable in the init once this process ended
    child = os.fork()
    if child == 0:
        try:
            init(launcher)  # returns only in the harness process
        except OSError as exc:
            fail("init", exc.errno or 0)
        return
    os.close(launcher)
    os.close(CFG["fd"])
    os.close(0)
    os.write(1, str(child).encode())  # the init's host pid: the scorer holds a pidfd on it
    os.close(1)
    _, status = os.waitpid(child, 0)
    os._exit(status_code(status))


setup()  # returns only in the harness process: _harness.py's text follows
