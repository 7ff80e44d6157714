"""The policy store: policies kept in memory between tasks (``memo.py``), an iteration's record
without weights on disk (``ref.py``), and a policy this process does not load (``files.py``)."""
