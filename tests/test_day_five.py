"""A researcher's day five (session 61, Part D): a day in a notebook.

The models of days one to four driven through a real IPython shell, cell by cell, as a
Jupyter user writes them without reading the library's code: a class redefined by a re-run
cell, a user error in a cell, what a cell ending in ``sm.export(...)``, ``sm.timeit(...)``,
``sm.verify(...)`` or ``train(...)`` shows, the stop button during a first call.

Each cheap test is a stumble of that walk: it failed before its fix.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import run_cell as run

import symjax_mlp as sm

IPython = pytest.importorskip("IPython")


def frames_in(shown: str, package: str) -> int:
    """How many frames of ``package``'s files a shown traceback has."""
    return sum(line.startswith("File ") and f"/{package}/" in line for line in shown.splitlines())


MODEL_CELL = """
class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        y = nn.Dense(8)(x)
        if y.sum() > 0:  # a Python if on a traced value
            y = -y
        return nn.Dense(2)(y)

x = jnp.ones((3, 4))
net = MLP()
h = sm.hybridize(net, net.init(jax.random.key(0), x))
"""


@pytest.mark.slow  # an IPython shell and a first trace and compile: seconds
def test_a_user_error_in_a_cell_shows_its_line_and_message_not_our_frames(shell):
    """A wrong input in a cell showed a traceback through seven of symjax_mlp's frames
    (traced.py, linen_module.py, ...) before the message: a user error read as a bug of ours
    to step through. The cell's line and the message are shown, the frames hidden and counted,
    and ``%xmode Verbose`` shows them all."""
    run(shell, MODEL_CELL)
    error, shown = run(shell, "h(jnp.ones((3, 5)))")
    assert isinstance(error, sm.SignatureError)
    assert "----> 1 h(jnp.ones((3, 5)))" in shown and "do not fit the params" in shown
    assert frames_in(shown, "symjax_mlp") == 0 and "%xmode Verbose shows them" in shown
    run(shell, "%xmode Verbose")
    try:
        _, verbose = run(shell, "h(jnp.ones((3, 5)))")
    finally:
        run(shell, "%xmode Context")
    assert frames_in(verbose, "symjax_mlp") > 3  # nothing lost for whoever wants it


@pytest.mark.slow  # an IPython shell and a first trace and compile: seconds
def test_control_flow_in_a_cells_model_points_at_its_if_line(shell):
    """A Python ``if`` on a traced value in a model defined in an earlier cell: the line of
    that ``if`` (in JAX's error it was raised from) is shown with the fix, without the
    thirteen frames of symjax_mlp, Flax and JAX around it."""
    run(shell, MODEL_CELL)
    error, shown = run(shell, "h(x)")
    assert isinstance(error, sm.ControlFlowError)
    assert "----> 5     if y.sum() > 0:" in shown and "jnp.where(x > 0, a, b)" in shown
    assert "The above exception was the direct cause" in shown
    assert frames_in(shown, "symjax_mlp") == frames_in(shown, "flax") == 0


@pytest.mark.slow  # an IPython shell: a second
def test_an_error_raised_from_one_of_pythons_own_is_shown_once(shell, tmp_path):
    """A corrupted manifest: the ArtifactError quotes the JSONDecodeError it was raised from;
    that error's traceback, all in symjax_mlp and the json module, was shown above it too."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "manifest.json").write_text("{")
    shell.user_ns["where"] = str(tmp_path / "a")
    error, shown = run(shell, "sm.load(where)")
    assert isinstance(error, sm.ArtifactError) and "is not valid JSON (Expecting" in shown
    assert "JSONDecodeError" not in shown.replace("(Expecting", "").split("ArtifactError")[0]
    assert "direct cause" not in shown


@pytest.mark.slow  # an IPython shell and a first trace and compile: seconds
def test_an_error_raised_by_hand_in_a_cell_is_shown_whole(shell):
    """Nothing of ours to hide: a user's own ``raise sm.ConfigError(...)`` is shown as
    IPython shows any exception."""
    error, shown = run(shell, "raise sm.ConfigError('mine')")
    assert isinstance(error, sm.ConfigError)
    assert "----> 1 raise sm.ConfigError('mine')" in shown and "hidden" not in shown


STOPPED_CELL = """
stop = []
class Stopped(nn.Module):
    @nn.compact
    def __call__(self, x):
        if stop:
            stop.pop()
            raise KeyboardInterrupt  # the stop button, mid-trace
        return nn.Dense(2)(x)

s = Stopped()
hs = sm.hybridize(s, s.init(jax.random.key(0), jnp.ones((3, 4))))
"""


@pytest.mark.slow  # an IPython shell and a first trace and compile: seconds
def test_the_stop_button_in_a_first_trace_leaves_the_hybrid_working(shell):
    """Interrupted (the notebook's stop button) inside its first trace, the Hybrid is not
    stuck: the next cell's call traces once and answers as eager Flax does."""
    run(shell, STOPPED_CELL)
    error, _ = run(shell, "stop.append(True)\nhs(jnp.ones((3, 4)))")
    assert isinstance(error, KeyboardInterrupt)
    error, _ = run(shell, "y = hs(jnp.ones((3, 4)))")
    hs = shell.user_ns["hs"]
    assert error is None and hs.trace_count == 1
    assert jnp.array_equal(shell.user_ns["y"], hs.eager(jnp.ones((3, 4))))


@pytest.mark.slow  # an IPython shell and a first trace and compile: seconds
def test_timeit_and_verify_ending_a_cell_show_their_tables(shell):
    """``sm.timeit(h, x)`` ending a cell showed its dataclass: eight tuples of floats in
    seconds; ``sm.verify(...)`` its checks as nested reprs. A cell shows the tables ``print``
    shows (and ``symjax-mlp bench`` / ``verify`` print)."""
    from IPython.lib.pretty import pretty

    from symjax_mlp import VerifyCheck, VerifyReport

    run(shell, "x = jnp.ones((1, 4))")  # this test's own: another worker may run the others
    run(shell, "h2 = sm.hybridize(sm.mlp((8, 2)), sm.mlp((8, 2)).init(jax.random.key(0), x))")
    error, shown = run(shell, "sm.timeit(h2, x, calls=3, repeats=1)")
    assert error is None and "min / compiled" in shown and "synced=(" not in shown
    check = VerifyCheck(runtime="jax", batch=7, ok=True, max_abs_err=0.0)
    report = VerifyReport(Path("a"), "h", 1e-5, 1e-5, (check,), {"jax": 0.4})
    assert pretty(report) == str(report) and "verify a: OK" in pretty(report)


def test_a_train_result_ending_a_cell_shows_its_figures_not_its_arrays():
    """``sm.training.train(...)`` ending a cell (or ``print(result)``) showed the trained
    params, the optimizer's state and the data's 64-feature mean and std: pages of arrays
    around the few figures a notebook wants. Its repr keeps the figures."""
    from symjax_mlp.training import TrainResult

    big = np.zeros(4096, np.float32)
    result = TrainResult(
        model=sm.mlp((8, 2)), params={"w": big}, opt_state=(big,), step=92, epoch=4,
        history=(), test_accuracy=0.93, train_seconds=4.7, compiled=True, trace_count=1,
        resumed_from=None, checkpoint=None, num_features=64, standardize=(big, big),
    )  # fmt: skip
    shown = repr(result)
    assert "test_accuracy=0.93" in shown and "epoch=4" in shown
    assert "array" not in shown and len(shown) < 400


@pytest.mark.slow  # an export: about a second on 2 cores
def test_a_cell_ending_in_export_shows_one_line(shell, tmp_path):
    """``sm.export(h, path, ...)`` ending a cell (the artifact it returns) showed the whole
    manifest as nested mappingproxies, 2 kB of sha256s and versions; ``sm.inspect(path)``
    too. One line says where and what (``print(art)`` is the full summary)."""
    run(shell, "x = jnp.ones((1, 4))")  # this test's own: another worker may run the others
    run(shell, "h2 = sm.hybridize(sm.mlp((8, 2)), sm.mlp((8, 2)).init(jax.random.key(0), x))")
    shell.user_ns["where"] = str(tmp_path / "a")
    error, shown = run(shell, "sm.export(h2, where, example=x, batch='b')")
    assert error is None and "mappingproxy" not in shown
    line = f"Artifact({str(tmp_path / 'a')!r}, (args[0]: float32[b, 4]) -> float32[b, 2]"
    assert line in shown and len(shown.strip().splitlines()) == 1
    assert repr(sm.inspect(tmp_path / "a")) in shown
    assert jax.tree.leaves(sm.load(tmp_path / "a").params)


@pytest.mark.slow  # a training of one epoch: seconds
def test_trainings_warnings_are_shown_under_the_cells_line(shell, tmp_path):
    """``train(..., resume=True)`` of a checkpoint folder that holds none, and an optimizer
    that moved no param, warned from ``symjax_mlp/training/_epoch.py:48``, quoting our line
    (a wrapper of train's had moved the user's frame one further): and Python shows a warning
    once per line it is charged to, so in a notebook the cell run again (the same typo, the
    same frozen optimizer) said nothing. Both are charged to the cell's line."""
    shell.user_ns["where"] = str(tmp_path / "typo")
    error, _ = run(
        shell,
        "import optax, warnings\n"
        "with warnings.catch_warnings(record=True) as said:\n"
        "    warnings.simplefilter('always')\n"
        "    sm.training.train(epochs=1, optimizer=optax.sgd(0.0), checkpoint=where, resume=True)",
    )
    said = {str(w.message)[:40]: w.filename for w in shell.user_ns["said"]}
    assert error is None and len(said) == 2, said
    assert all(file.startswith("<ipython-input-") for file in said.values()), said


@pytest.mark.slow  # two exports, the module checker's child started three times: seconds
@pytest.mark.parametrize("stopped_at", ["start", "answer"])
def test_the_stop_button_while_the_module_checker_reads_leaves_no_answer_behind(
    tmp_path, monkeypatch, stopped_at
):
    """The stop button while ``load``, ``inspect(...).op_counts()`` or ``export`` waited for
    the child that reads StableHLO left that child running with its answer unread: the next
    module's check in the kernel read it instead. Stopped while the child started, the next
    load failed with a raw ``JSONDecodeError`` ("ready" read as a report); stopped while it
    read a module, the next module got that module's report: its ops, and what load refuses,
    a stranger's module judged by the one before it. The child is ended on the interrupt."""
    import select

    from symjax_mlp._artifact import checker

    x = jnp.ones((3, 4))
    net = sm.mlp((8, 2))
    models = {"a": sm.hybridize(net, net.init(jax.random.key(0), x))}
    models["b"] = sm.hybridize(lambda p, x: jnp.sin(x) * p["w"], {"w": jnp.ones(4)})
    modules = {}
    for name, model in models.items():
        sm.export(model, tmp_path / name, example=x)
        modules[name] = (tmp_path / name / "model.mlirbc").read_bytes()
    checker.CHECKER.close()  # a child of this test's own
    b = checker.CHECKER.report(modules["b"], file=tmp_path / "b")  # the child started
    if stopped_at == "start":
        checker.CHECKER.close()
    real = select.select

    def stop(*args):
        monkeypatch.setattr(select, "select", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(select, "select", stop)
    try:
        with pytest.raises(KeyboardInterrupt):
            checker.CHECKER.report(modules["a"], file=tmp_path / "a")
        assert checker.CHECKER.report(modules["b"], file=tmp_path / "b") == b
    finally:
        checker.CHECKER.close()  # none left behind for another test, fixed or not
