"""A researcher's first afternoon: what the docs, --help and sibling APIs promise, held to it.

Each test pins one thing found by using the library as its README says, on one's own models:
a public name with no docstring, a --help that said what the code does not do, a Python
keyword with no command-line twin, a keyword spelt one way in ``load`` and refused in
``verify``.
"""

from __future__ import annotations

import inspect
import re

import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp import cli

#: public names still without a docstring
_UNDOCUMENTED = set()

#: public functions and methods whose docstrings do not yet name an argument, ``where(arg)``
_ARGUMENTS_UNNAMED = set()


def _public(module):
    for name in module.__all__:
        yield (
            f"{module.__name__.removeprefix('symjax_mlp')}.{name}".lstrip("."),
            getattr(module, name),
        )


def test_every_public_name_and_its_public_methods_have_a_docstring():
    """help(sm.training.Step) showed collections.abc.Callable's help; VerifyReport.ok,
    Signature.to_json, TensorSpec.to_json and BatcherStats.to_dict had none at all."""
    missing = []
    for module in (sm, sm.serving, sm.training, sm.chapter):
        for where, obj in _public(module):
            if inspect.ismodule(obj) or not (callable(obj) or isinstance(obj, type)):
                continue  # a constant (EXIT_STATUS, ACTIVATIONS) is documented by its module
            if not inspect.getdoc(obj) or inspect.getdoc(obj) == inspect.getdoc(type(obj)):
                missing.append(where)
            if not isinstance(obj, type):
                continue
            for attr, value in vars(obj).items():
                member = getattr(value, "__func__", value)  # a classmethod's function
                documented = callable(member) or isinstance(member, property)
                if not attr.startswith("_") and documented and not inspect.getdoc(member):
                    missing.append(f"{obj.__name__}.{attr}")
    assert set(missing) == _UNDOCUMENTED, sorted(set(missing) - _UNDOCUMENTED)


def _unnamed_arguments(where, fn):
    doc = inspect.getdoc(fn) or ""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # no signature to read
        return []
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [
        f"{where}({p.name})"
        for p in parameters
        if p.name not in ("self", "cls") and p.kind not in variadic
        and not re.search(rf"\b{re.escape(p.name)}\b", doc)
    ]  # fmt: skip


def test_public_functions_and_methods_name_their_arguments():
    """Artifact.op_counts(entry), Hybrid.hybridize(active), Hybrid.shard(axis, pad),
    BatcherStats.to_prometheus(prefix), ShardedStep.__call__/lower and Graph.of/traced(name):
    help() showed an argument its docstring never said a word of."""
    unnamed = []
    for module in (sm, sm.serving, sm.training, sm.chapter):
        for where, obj in _public(module):
            if inspect.ismodule(obj):
                continue
            if not isinstance(obj, type):
                unnamed += _unnamed_arguments(where, obj) if callable(obj) else []
                continue
            for attr, value in vars(obj).items():
                member = getattr(value, "__func__", value)  # a classmethod's function
                public = not attr.startswith("_") or attr == "__call__"
                if public and callable(member) and not isinstance(member, type):
                    unnamed += _unnamed_arguments(f"{where}.{attr}", member)
    assert set(unnamed) == _ARGUMENTS_UNNAMED, sorted(set(unnamed) ^ _ARGUMENTS_UNNAMED)


def test_the_training_step_type_is_documented_as_what_train_step_returns():
    """``Step`` was a bare ``Callable`` alias: its help was Callable's, saying nothing of the
    five arguments a step takes or the three things it returns."""
    doc = inspect.getdoc(sm.training.Step)
    assert "step(params, opt_state, x, y, w)" in doc and "train_step" in doc
    params = list(inspect.signature(sm.training.Step.__call__).parameters)
    assert params == ["self", "params", "opt_state", "x", "y", "w"]


def test_cli_verify_takes_seed_and_timeout_as_sm_verify_does(monkeypatch, tmp_path):
    """``sm.verify(path, seed=, timeout=)`` had no command-line twin: a slow machine's
    artifact could not be given more than 300 s from the shell."""
    got = {}

    def fake_verify(path, **options):
        got.update(options, path=path)
        raise sm.ConfigError("stop here")

    monkeypatch.setattr(sm, "verify", fake_verify)
    argv = ["verify", str(tmp_path / "art"), "--seed", "3", "--timeout", "900"]
    assert cli.main(argv) == 2
    assert got["seed"] == 3 and got["timeout"] == 900.0 and got["path"] == str(tmp_path / "art")


def test_cli_train_checkpoint_help_says_every_checkpoint_every_epochs():
    """``--checkpoint DIR`` said "write a checkpoint every epoch here", next to a
    ``--checkpoint-every`` that makes it every N epochs (and after the last, as train does)."""
    train = cli.build_parser().commands["train"]
    (action,) = [a for a in train._actions if "--checkpoint" in a.option_strings]
    assert "a checkpoint every epoch" not in action.help
    assert "--checkpoint-every" in action.help and "after the last" in action.help


def test_serve_help_shows_the_predict_body_the_app_takes(capsys):
    """``symjax-mlp serve --help`` (and the README) said "JSON" without its shape; a first
    ``curl -d '[[1, 2, 3]]'`` got a 400. The help now shows ``{"inputs": [[...], ...]}`` (the
    body test_serving's test_http_predict_with_json_and_npy_bodies posts)."""
    assert cli.main(["serve", "--help"]) == 0
    shown = capsys.readouterr().out
    assert '{"inputs": [[...], ...]}' in shown and "application/x-npy" in shown


@pytest.mark.slow
def test_verify_takes_one_allow_name_as_load_does(tmp_path):
    """``sm.load(path, allow="gather")`` takes one name; ``sm.verify(path, allow="gather")``
    was a ConfigError ("pass a tuple of names"): the same keyword, spelt two ways."""
    art = sm.chapter.export_mlp(tmp_path / "mlp", sizes=(4, 2))
    assert sm.load(art.path, allow="gather").allowed == sm.load(art.path, allow=["gather"]).allowed
    report = sm.verify(art.path, allow="gather", batches=(1,))
    assert report.ok, report


def test_a_batcher_given_a_tuple_of_inputs_says_to_pass_each_to_submit():
    """``Batcher(h, example=(x, y))`` takes a tuple, so ``b.submit((x, y))`` is the natural
    first try; it said "Call it as b(args[0], args[1])", naming neither ``submit`` nor what
    was wrong."""
    h = sm.hybridize(lambda p, x, y: x * p + y, jnp.float32(2))
    x, y = np.ones((1, 3), np.float32), np.ones((1, 3), np.float32)
    with sm.serving.Batcher(h, example=(x, y), max_batch=1) as b:
        with pytest.raises(sm.SignatureError, match="got 1") as e:
            b.submit((x, y))
        assert "its own argument: b.submit(args[0], args[1])" in str(e.value)
        np.testing.assert_array_equal(b.submit(x, y).result(), 3 * x)


def test_export_of_an_int_batch_says_none_exports_the_examples_static_batch(tmp_path):
    """``chapter.export_mlp(batch=4)`` and ``symjax-mlp export --batch 4`` take a static size;
    ``sm.export(h, batch=4)`` said only "pass a name such as 'b' (...), or None", not what None
    does: a researcher with a static batch in mind had to find it in the docstring."""
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    with pytest.raises(sm.ConfigError, match=r"^export\(batch=4\)") as e:
        sm.export(h, tmp_path / "m", example=jnp.ones((4, 3)), batch=4)
    said = str(e.value)
    assert "or None for the example's static shapes (an example of 4 rows: a static" in said
    assert not (tmp_path / "m").exists()


def test_train_result_export_documents_its_arguments_return_and_errors():
    """``result.export(path)``, the step after ``train``, said neither what it returns nor
    what it raises, nor which of export's options it takes (``example=`` it refuses)."""
    doc = inspect.getdoc(sm.training.TrainResult.export)
    for section in ("Args:", "Returns:", "Raises:", "ConfigError", "ArtifactError"):
        assert section in doc, section
    for name in inspect.signature(sm.training.TrainResult.export).parameters:
        assert name == "self" or f"  {name}:" in doc, name
    assert "example" in doc and "batch=None" in doc


@pytest.mark.slow
def test_train_result_export_does_what_its_docstring_says(tmp_path):
    """The docstring's promises: ``example=`` refused, ``batch=None`` a static row, the
    artifact returned; an existing path an ArtifactError."""
    x = np.random.default_rng(0).normal(size=(32, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    result = sm.training.train(
        sm.mlp((4, 2)), sm.training.Dataset(x, y, x, y), epochs=1, batch_size=8
    )
    with pytest.raises(sm.ConfigError, match="drop example="):
        result.export(tmp_path / "m", example=x)
    art = result.export(tmp_path / "m", batch=None)
    assert isinstance(art, sm.Artifact) and art.signature.inputs[0].shape == (1, 3)
    with pytest.raises(sm.ArtifactError, match="already exists"):
        result.export(tmp_path / "m")


@pytest.mark.slow
def test_ray_app_takes_one_allow_name_as_load_does(tmp_path):
    """``ray_app(path, allow="gather")`` passed ``tuple("gather")`` on: load refused
    ``allow={'a', 'e', 'g', 'h', 'r', 't'}``, letters the user never wrote."""
    pytest.importorskip("ray.serve")
    art = sm.chapter.export_mlp(tmp_path / "mlp", sizes=(4, 2))
    app = sm.serving.ray_app(art.path, allow="gather", replicas=1)
    assert type(app).__name__ == "Application"


@pytest.mark.slow
def test_a_verify_whose_fresh_process_fails_reports_the_tolerances_asked_for(tmp_path):
    """``symjax-mlp verify --timeout`` too short printed "rtol nan, atol nan": the report of a
    fresh process that ran out of time (or died) dropped the tolerances given."""
    art = sm.chapter.export_mlp(tmp_path / "mlp", sizes=(4, 2))
    report = sm.verify(art.path, rtol=1e-3, atol=2e-4, timeout=1e-3, batches=(1,))
    assert not report.ok and "ran past" in report.errors[0]
    assert (report.rtol, report.atol) == (1e-3, 2e-4)
    assert "rtol 0.001, atol 0.0002" in str(report)


def test_timeit_given_a_models_keyword_names_kwargs():
    """``sm.timeit(h, x, train=False)``, as one calls ``h(x, train=False)``, was Python's
    "unexpected keyword argument 'train'", naming neither ``kwargs=`` nor the fix."""
    h = sm.hybridize(lambda p, x, train=True: x * p, jnp.float32(2))
    with pytest.raises(sm.ConfigError, match=r"^timeit\(<lambda>, train=\.\.\.\): ") as e:
        sm.timeit(h, jnp.ones(3), train=False, calls=1, repeats=1)
    assert "timeit(model, x, kwargs={'train': False})" in str(e.value)


def test_export_and_batcher_given_a_models_keyword_name_kwargs_as_timeit(tmp_path):
    """``sm.export(h, path, example=x, train=False)`` and ``Batcher(h, example=x,
    train=False)`` were Python's "unexpected keyword argument 'train'": the three siblings
    that take the model's keywords as ``kwargs=`` now all say so."""
    h = sm.hybridize(lambda p, x, train=True: x * p, jnp.float32(2))
    x = jnp.ones((1, 3))
    with pytest.raises(sm.ConfigError, match=r"^export\(h, train=\.\.\.\): ") as e:
        sm.export(h, tmp_path / "m", example=x, train=False)
    assert "sm.export(h, path, example=x, kwargs={'train': False})" in str(e.value)
    assert not (tmp_path / "m").exists()
    with pytest.raises(sm.ConfigError, match=r"^Batcher\(model, train=\.\.\.\): ") as e:
        sm.serving.Batcher(h, example=x, train=False)
    assert "Batcher(model, example=x, kwargs={'train': False})" in str(e.value)


def test_an_on_trace_callback_s_stop_iteration_reaches_the_caller_as_it_is():
    """The callbacks ran inside a ``@contextlib.contextmanager`` generator: a callback's
    ``StopIteration`` came out of ``h(x)`` as ``RuntimeError('generator raised
    StopIteration')`` (``h.eager`` raised it as it is); the trace it stopped is not logged."""
    stops = [StopIteration("done"), StopIteration("again")]

    def callback(*args, **kwargs):
        if stops:
            raise stops[0]

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    h.on_trace(callback)
    x = np.ones((2, 3), np.float32)
    for call in (h, h.eager):
        with pytest.raises(StopIteration) as caught:
            call(x)
        assert caught.value is stops.pop(0) and caught.value.__cause__ is None
    assert h.trace_log == ()
    np.testing.assert_array_equal(h(x), 2 * x)
    assert [e.reason for e in h.trace_log] == ["first call"]


def test_cli_list_options_refuse_with_an_example_of_their_own(tmp_path, capsys):
    """``verify --batches 0`` said "such as 256,128,2": layer widths, --sizes' example."""
    for argv, example in (
        (["verify", str(tmp_path), "--batches", "0"], "such as 1,7,128;"),
        (["export", str(tmp_path / "a"), "--sizes", "8,0"], "such as 256,128,2;"),
        (["train", "--sizes", "x", "--out", str(tmp_path / "c")], "such as 128,64,10;"),
    ):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert example in err and len(err.splitlines()) == 1, err


def test_no_test_module_imports_another_s_helpers():
    """test_authors_round9.py (and 10, 11) imported ``_every_feature`` from
    test_authors_round8.py: a test module's private helper, and the rounds ran round8's module
    body with theirs. Shared helpers live in tests/features.py (zoo*.py, helpers.py); from a
    test module, only its pytest fixtures are imported by name (the matrix's)."""
    import ast
    import functools
    from pathlib import Path

    texts = {p.stem: p.read_text() for p in Path(__file__).parent.glob("test_*.py")}

    @functools.cache
    def fixtures(module):  # its top-level defs under @pytest.fixture
        return {
            node.name for node in ast.parse(texts[module]).body
            if isinstance(node, ast.FunctionDef)
            and any("fixture" in ast.unparse(d) for d in node.decorator_list)
        }  # fmt: skip

    imported = [
        f"{stem}: {node.module}.{alias.name}"
        for stem, text in texts.items()
        if "from test_" in text
        for node in ast.parse(text).body
        if isinstance(node, ast.ImportFrom) and node.module in texts
        for alias in node.names
        if alias.name not in fixtures(node.module)
    ]
    assert not imported, imported
