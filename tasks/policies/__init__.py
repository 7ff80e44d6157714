"""The policies of a run: a policy as a value (``version.py``), the trainer a stage opens,
which gives a task its policy and makes an iteration's policy again (``trainer.py``), how
they load (``loading.py``), an iteration's record without weights on disk (``ref.py``), and a
policy this process does not load (``files.py``)."""
