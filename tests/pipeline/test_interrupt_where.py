"""The step an interrupt names (flows/interrupts.py: where), from the frames it stopped in.

A signal can land after Prefect has logged "Beginning subflow run 'demo/rl_2'" and before the
stage's own code runs (seen under load): the only frame of ours then is the recipe's
``timed(name, ...)`` call in flows/r1.py, and the line must still name rl_2."""

from pathlib import Path

from flows import interrupts

R1 = Path(interrupts.__file__).with_name("r1.py")
# the recipe's step runner (flows/r1.py: run_pipeline's ``timed``), compiled as that file's
# code so that its frames are what the real one leaves
TIMED = "def timed(name, fn, *a):\n    return fn(*a)\n"
STAGE = "def rl_stage(stage):\n    it = 3\n    raise KeyboardInterrupt\n"


def _where(step: str, stopped_in) -> str:
    """What the line names when ``timed(step, ...)`` is stopped in ``stopped_in`` (a
    function, or the name of one compiled as flows/r1.py's code)."""
    code: dict = {}
    exec(compile(TIMED + STAGE, str(R1), "exec"), code)
    fn = code.get(stopped_in, stopped_in)
    try:
        code["timed"](step, fn, step) if fn is code.get("rl_stage") else code["timed"](step, fn)
    except KeyboardInterrupt as exc:
        return interrupts.where(exc)
    raise AssertionError("no interrupt")


def _prefect_starting_the_subflow():
    raise KeyboardInterrupt


def test_a_signal_while_prefect_starts_the_stage_names_the_stage():
    assert _where("rl_2", _prefect_starting_the_subflow) == "rl_2"


def test_the_stage_code_names_the_iteration():
    assert _where("rl_2", "rl_stage") == "rl_2 iteration 3"
