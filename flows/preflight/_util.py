"""Small helpers shared by the pre-flight checks."""

from __future__ import annotations

from typing import Any


def first_line(e: Any) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
