"""MLflow for the stage tasks: who starts and ends runs (``runs.py``), what a stage logs
(``stages.py``), keys MLflow accepts (``keys.py``), where curves sit (``charts.py``), safe
store calls (``store.py``) and the runs left open (``run_states.py``)."""
