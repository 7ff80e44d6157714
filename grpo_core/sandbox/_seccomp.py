"""A seccomp filter for the sandbox's processes. Stdlib only: its text is prepended to
``_harness.py`` and ``_candidate.py``, which run as ``python -I -B -c <text>``.

``seccomp_lock(processes)`` installs, for the calling process and everything it starts later
(``seccomp_locker(processes)`` prepares it once for processes forked later):

- no new namespaces of any kind: ``unshare`` and ``setns`` fail (EPERM), and so does a
  ``clone`` with a ``CLONE_NEW*`` flag; ``clone3`` answers ENOSYS (glibc then falls back to
  ``clone``, whose flags a classic filter can read). A program cannot make a nested user
  namespace (where it would hold every capability) whatever the host's sysctls say;
- no tracing or reading of another process: ``ptrace``, ``process_vm_readv``/``writev``;
- no kernel keyring (``add_key``, ``request_key``, ``keyctl``): the sandbox would share the
  scorer's session keyring; no ``memfd_create`` (memory in anonymous files escapes
  ``RLIMIT_AS``); no ``io_uring`` (its own route to files and sockets); no SysV IPC
  (``shmget``/``shmat``, ``msgget``/``msgsnd``, ``semget``: kernel memory outside
  ``RLIMIT_AS``), no POSIX message queue (``mq_open``: it outlives the process in the IPC
  namespace, which a warm tool sandbox keeps across calls);
- no larger socket or pipe buffers: ``setsockopt(SOL_SOCKET, SO_SNDBUF / SO_RCVBUF / their
  FORCE variants)`` and ``fcntl(F_SETPIPE_SZ)`` fail (EPERM). Buffers are kernel memory
  outside ``RLIMIT_AS``: 30 socket pairs raised to the host's ``wmem_max`` and filled held
  470 MiB past a 512 MiB cap; at the defaults, ``RLIMIT_NOFILE`` (64) bounds them to about
  13 MiB;
- no change of the parent-death signal (``prctl(PR_SET_PDEATHSIG)``), so a candidate process
  always dies with its harness;
- with ``processes=False``: no new process at all (``fork``, ``vfork``, a ``clone`` without
  ``CLONE_THREAD``), threads still allowed. The program then has exactly one process, whose
  ``RLIMIT_AS`` caps the memory of all it runs (threads share the address space).

Syscalls of another ABI than the interpreter's (i386 ``int 0x80``, x32) are refused. Raises
``OSError`` where the kernel has no seccomp or the architecture is not known (x86_64,
aarch64): the sandbox then fails closed.
"""

import ctypes
import errno
import os

_ARCHES = {  # machine: (AUDIT_ARCH, syscall numbers)
    "x86_64": (
        0xC000003E,
        {
            "clone": 56,
            "clone3": 435,
            "fork": 57,
            "vfork": 58,
            "unshare": 272,
            "setns": 308,
            "ptrace": 101,
            "process_vm_readv": 310,
            "process_vm_writev": 311,
            "prctl": 157,
            "add_key": 248,
            "request_key": 249,
            "keyctl": 250,
            "memfd_create": 319,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "shmget": 29,
            "shmat": 30,
            "semget": 64,
            "msgget": 68,
            "msgsnd": 69,
            "mq_open": 240,
            "setsockopt": 54,
            "fcntl": 72,
        },
    ),  # fmt: skip
    "aarch64": (
        0xC00000B7,
        {
            "clone": 220,
            "clone3": 435,
            "unshare": 97,
            "setns": 268,
            "ptrace": 117,
            "process_vm_readv": 270,
            "process_vm_writev": 271,
            "prctl": 167,
            "add_key": 217,
            "request_key": 218,
            "keyctl": 219,
            "memfd_create": 279,
            "io_uring_setup": 425,
            "io_uring_enter": 426,
            "io_uring_register": 427,
            "msgget": 186,
            "msgsnd": 189,
            "semget": 190,
            "shmget": 194,
            "shmat": 196,
            "mq_open": 180,
            "setsockopt": 208,
            "fcntl": 25,
        },
    ),  # fmt: skip
}
_CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
_CLONE_NEW |= 0x40000000  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_CLONE_THREAD = 0x00010000
_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 1, 38, 22, 2
_LD, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_{LD|W|ABS, JMP|K, RET|K}
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_SOL_SOCKET, _BUFFER_OPTS = 1, (7, 8, 32, 33)  # SO_SNDBUF, SO_RCVBUF, SO_{SND,RCV}BUFFORCE
_F_SETPIPE_SZ = 1031


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte)]
    _fields_ += [("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def _assemble(lines):
    """``lines``: ``(label, code, k, jump_if_true, jump_if_false)`` with jumps as labels or
    None (the next instruction); returns the classic BPF program."""
    where = {line[0]: i for i, line in enumerate(lines) if line[0]}
    out = []
    for i, (_, code, k, jt, jf) in enumerate(lines):
        off = [0 if j is None else where[j] - i - 1 for j in (jt, jf)]
        out.append(_Filter(code, off[0], off[1], k))
    return out


def seccomp_program(machine, processes):
    arch, nr = _ARCHES[machine]
    deny = ["unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev"]
    deny += ["add_key", "request_key", "keyctl"]  # the scorer's session keyring
    deny += ["memfd_create"]  # anonymous files: memory outside RLIMIT_AS
    deny += ["io_uring_setup", "io_uring_enter", "io_uring_register"]
    # SysV IPC: shared memory segments and message queues live in the kernel, outside
    # RLIMIT_AS (5 x 300 MiB of shm held past a 512 MiB cap; 32,000 queues, 488 MiB)
    deny += ["shmget", "shmat", "semget", "msgget", "msgsnd"]
    # POSIX message queues: kernel objects of the IPC namespace that outlive the process (a
    # warm tool sandbox keeps its namespace across calls: one call must leave nothing there)
    deny += ["mq_open"]
    if not processes:
        deny += [n for n in ("fork", "vfork") if n in nr]
    lines = [
        (None, _LD, 4, None, None),  # seccomp_data.arch
        (None, _JEQ, arch, None, "eperm"),
        (None, _LD, 0, None, None),  # seccomp_data.nr
        (None, _JGE, 0x40000000, "eperm", None),  # the x32 ABI
        (None, _JEQ, nr["clone"], "clone", None),
        (None, _JEQ, nr["clone3"], "enosys", None),
        (None, _JEQ, nr["prctl"], "prctl", None),
        (None, _JEQ, nr["setsockopt"], "setsockopt", None),
        (None, _JEQ, nr["fcntl"], "fcntl", None),
    ]
    lines += [(None, _JEQ, nr[name], "eperm", None) for name in deny]
    lines += [
        (None, _RET, _ALLOW, None, None),
        ("clone", _LD, 16, None, None),  # the low 32 bits of args[0]: the clone flags
        (None, _JSET, _CLONE_NEW, "eperm", None),
        (None, _JSET, 0 if processes else _CLONE_THREAD, "allow", None),
        (None, _RET, _ALLOW if processes else _ERRNO | errno.EPERM, None, None),
        ("prctl", _LD, 16, None, None),
        (None, _JEQ, _PR_SET_PDEATHSIG, "eperm", None),
        (None, _RET, _ALLOW, None, None),
        ("setsockopt", _LD, 24, None, None),  # args[1]: the level
        (None, _JEQ, _SOL_SOCKET, None, "allow"),
        (None, _LD, 32, None, None),  # args[2]: the option
        *[(None, _JEQ, opt, "eperm", None) for opt in _BUFFER_OPTS],
        (None, _RET, _ALLOW, None, None),
        ("fcntl", _LD, 24, None, None),  # args[1]: the command
        (None, _JEQ, _F_SETPIPE_SZ, "eperm", None),
        ("allow", _RET, _ALLOW, None, None),
        ("eperm", _RET, _ERRNO | errno.EPERM, None, None),
        ("enosys", _RET, _ERRNO | errno.ENOSYS, None, None),
    ]
    return _assemble(lines)


def seccomp_locker(processes):
    """A function that installs the filter in the process that calls it: the program built
    and the libc calls set up now, so that a process forked later (a warm tool call) only
    makes the two ``prctl`` calls."""
    machine = os.uname().machine
    if machine not in _ARCHES:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {machine}")
    filters = seccomp_program(machine, processes)
    array = (_Filter * len(filters))(*filters)
    prog = _Prog(len(filters), array)
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong]
    prctl.argtypes += [ctypes.c_ulong]
    where = ctypes.addressof(prog)

    def lock():
        if prctl(_PR_SET_NO_NEW_PRIVS, 1, None, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, where, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")

    lock.program = (array, prog)  # alive as long as the function
    return lock


def seccomp_lock(processes):
    seccomp_locker(processes)()


def set_pdeathsig_kill():
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")


def set_not_dumpable():
    """Nobody of the same uid may trace this process or open its /proc files (mem, fd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE)")
