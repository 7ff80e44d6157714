"""The one exception type for problems a user can fix.

``UserError`` is raised for bad inputs and settings: a data row without ``prompt``, a
truncated weights file, a reward function that fails on every row. Its message is one line
that names the file, row or setting, and what to change. The ``grpo`` CLI prints it as
``grpo: error: <message>`` and exits with code 2, without a traceback (flows/errors.py);
in a notebook it is an ordinary ``ValueError``.
"""

from __future__ import annotations


class UserError(ValueError):
    """A problem with the user's inputs or settings; the message names the culprit and the fix."""


class RewardUnavailable(RuntimeError):
    """A reward function that must not run here at all (e.g. the code sandbox cannot isolate
    untrusted programs on this machine). ``score_completions`` lets it through instead of
    recording it as a per-row error, so the batch stops with the message."""
