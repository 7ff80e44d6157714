"""Plain values across the sandbox's process boundary. Stdlib only: its text is prepended to
``_harness.py`` and ``_candidate.py``.

Only builtin values of exact builtin types cross: ``None``, ``bool``, ``int``, ``float``,
``str``, ``bytes``, ``complex``, and ``list``/``tuple``/``dict``/``set``/``frozenset`` of those
(nested at most ``_MAX_DEPTH`` deep). numpy's numeric scalars and arrays are converted by
value (``.item()`` / ``.tolist()``); object arrays, subclasses of builtins and every other
object are refused with :class:`WireError`. On the wire a value is JSON: the JSON types as
themselves, the others as one-key tags (``{"tuple": [...]}``, ``{"bytes": "<hex>"}``, ...).

The harness decodes what the candidate process sends with :func:`wire_decode`, which builds
only those builtin values from JSON's own: whatever the program does to its side of the
encoder, the harness gets data, never an object with methods of the program's.
"""

import json
import os

_MAX_DEPTH = 100
_MAX_LINE = 64 << 20  # one message; a larger one is an error, not a memory blow-up


class WireError(Exception):
    pass


def _numpy_value(value, depth):
    """numpy scalars and arrays by value (the candidate's side: numpy may be imported there)."""
    t = type(value)
    if getattr(t, "__module__", None) != "numpy":
        raise WireError(f"a {t.__name__}, not a plain value (builtins only cross the sandbox)")
    dtype = getattr(value, "dtype", None)
    if getattr(dtype, "kind", "O") in "OV":  # object / void (structured) values: refused
        raise WireError(f"a numpy {t.__name__} of dtype {dtype}: only numeric values cross")
    plain = value.tolist() if t.__name__ == "ndarray" else value.item()
    if getattr(type(plain), "__module__", None) == "numpy":
        raise WireError(f"a numpy {t.__name__} that does not convert to builtins")
    return wire_encode(plain, depth)


def _is_json_scalar(value):
    """``None``, ``bool``, ``int``, ``float``, ``str`` of the exact type: on the wire as
    themselves."""
    t = type(value)
    return value is None or t is bool or t is int or t is float or t is str


def _inner_depth(depth):
    """The depth of the values inside a container at ``depth``; too deep is an error."""
    if depth >= _MAX_DEPTH:
        raise WireError(f"a value nested more than {_MAX_DEPTH} deep")
    return depth + 1


def wire_encode(value, depth=0):
    if _is_json_scalar(value):
        return value
    d = _inner_depth(depth)
    t = type(value)
    if t is list:
        return [wire_encode(v, d) for v in value]
    if t is tuple:
        return {"tuple": [wire_encode(v, d) for v in value]}
    if t is dict:
        if all(type(k) is str for k in value):
            return {"dict": {k: wire_encode(v, d) for k, v in value.items()}}
        return {"pairs": [[wire_encode(k, d), wire_encode(v, d)] for k, v in value.items()]}
    if t is set or t is frozenset:
        return {t.__name__: [wire_encode(v, d) for v in value]}
    if t is bytes:
        return {"bytes": value.hex()}
    if t is complex:
        return {"complex": [value.real, value.imag]}
    return _numpy_value(value, depth)


_TAGS = {"tuple": tuple, "set": set, "frozenset": frozenset}


def wire_decode(obj, depth=0):
    if _is_json_scalar(obj):
        return obj
    d = _inner_depth(depth)
    t = type(obj)
    if t is list:
        return [wire_decode(v, d) for v in obj]
    if t is not dict or len(obj) != 1:
        raise WireError("not a value of the wire format")
    ((tag, raw),) = obj.items()
    if tag in _TAGS and type(raw) is list:
        return _TAGS[tag](wire_decode(v, d) for v in raw)
    if tag == "dict" and type(raw) is dict:
        return {k: wire_decode(v, d) for k, v in raw.items()}
    if tag == "pairs" and type(raw) is list:
        return {wire_decode(p[0], d): wire_decode(p[1], d) for p in raw if _pair(p)}
    if tag == "bytes" and type(raw) is str:
        return bytes.fromhex(raw)
    if tag == "complex" and type(raw) is list and len(raw) == 2:
        return complex(float(raw[0]), float(raw[1]))
    raise WireError(f"not a value of the wire format (tag {tag!r})")


def _pair(p):
    if type(p) is list and len(p) == 2:
        return True
    raise WireError("a dict entry that is not a [key, value] pair")


def wire_send(fd, message):
    data = (json.dumps(message, separators=(",", ":")) + "\n").encode("utf-8", "replace")
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class WireReader:
    """Newline-framed JSON messages from a pipe; ``None`` at end of file."""

    def __init__(self, fd):
        self.file = os.fdopen(fd, "rb", buffering=65536)

    def read(self):
        line = self.file.readline(_MAX_LINE + 1)
        if not line:
            return None
        if len(line) > _MAX_LINE or not line.endswith(b"\n"):
            raise WireError(f"a message over {_MAX_LINE >> 20} MiB")
        return json.loads(line)
