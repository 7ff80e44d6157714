"""The policies of a run: which one a task gets and how an iteration's policy is made again
(``lineage.py``), how they load (``loading.py``), an iteration's record without weights on disk
(``ref.py``), and a policy this process does not load (``files.py``)."""
