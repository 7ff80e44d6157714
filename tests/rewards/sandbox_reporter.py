"""Hostile programs that attack the verdict's reporter (tests/rewards/test_sandbox.py): what a
program could reach when it shared the harness's interpreter (frames, gc, a signal handler's
frame, other threads' frames, a trace function), a numpy-like object array that equals
anything, a nested user namespace, a second process. Each must score 0."""

import textwrap

# calls every function reachable that could report a verdict, as the harness's would be called
FORGE = (
    "def forge(objs):\n"
    "                for fn in objs:\n"
    "                    if callable(fn) and getattr(fn, '__name__', '') in ('emit', 'check', '_grpo_check', 'wire_send', 'send'):\n"
    "                        for args in [('assert', f'a{i}.0', True) for i in range(3)] + [('done', '', True), ('a0.0', lambda: True)]:\n"
    "                            try:\n"
    "                                fn(*args)\n"
    "                            except BaseException:\n"
    "                                pass"
)


def _prog(src: str) -> str:
    return textwrap.dedent(src).strip() + "\n"


def reporter_attacks() -> dict[str, str]:
    prog = _prog
    return {
        # the reporter's own process (what the candidate could reach when it shared the
        # harness's interpreter): frames, gc, a signal handler's frame, other threads' frames,
        # a trace function rewriting the check's locals
        "frame_emit": prog(f"""
        import sys
        {FORGE}
        def add(a, b):
            f = sys._getframe()
            while f is not None:
                forge(list(f.f_locals.values()) + list(f.f_globals.values()))
                f = f.f_back
            return 0
    """),
        "gc_emit": prog(f"""
        import gc
        {FORGE}
        def add(a, b):
            forge(gc.get_objects())
            return 0
    """),
        "signal_frame_emit": prog(f"""
        import signal, time
        {FORGE}
        def handler(sig, frame):
            while frame is not None:
                forge(list(frame.f_locals.values()) + list(frame.f_globals.values()))
                frame = frame.f_back
        signal.signal(signal.SIGALRM, handler)
        signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)
        def add(a, b):
            time.sleep(0.01)
            return 0
    """),
        "thread_frames_emit": prog(f"""
        import sys, threading, time
        {FORGE}
        def spy():
            for _ in range(200):
                for frame in list(sys._current_frames().values()):
                    while frame is not None:
                        forge(list(frame.f_locals.values()))
                        frame = frame.f_back
                time.sleep(0.001)
        threading.Thread(target=spy, daemon=True).start()
        def add(a, b):
            time.sleep(0.02)
            return 0
    """),
        "settrace_locals": prog("""
        import sys
        def tracer(frame, event, arg):
            if event == "return":
                for k, v in list(frame.f_locals.items()):
                    if v is False:
                        frame.f_locals[k] = True
            return tracer
        sys.settrace(tracer)
        def add(a, b):
            sys.settrace(tracer)
            return 0
    """),
        "numpy_object_array": prog("""
        class Y:
            def __eq__(self, other):
                return True
            def __sub__(self, other):
                return 0
            def __abs__(self):
                return 0
        class dtype:
            kind = "O"
        class ndarray(list):  # what np.array([Y()], dtype=object) looks like
            __module__ = "numpy"
            dtype = dtype()
            def tolist(self):
                return [Y()]
        def add(a, b):
            return ndarray([Y()])
    """),
        "nested_user_namespace": prog("""
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        inside = libc.unshare(0x10000000) == 0  # CLONE_NEWUSER
        def add(a, b):
            return a + b if inside else 0  # only a sandbox that allows it passes
    """),
        "second_process": prog("""
        import subprocess, sys
        try:
            out = subprocess.run([sys.executable, "-c", "print(3)"], capture_output=True)
            spawned = out.returncode == 0
        except OSError:
            spawned = False
        def add(a, b):
            return a + b if spawned else 0  # only a sandbox that allows processes passes
    """),
    }
