"""verify and bench on artifacts whose signature constrains its shapes or returns rng keys."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp.cli import main


def _scaled(tmp_path, name, example, shapes, constraints):
    h = sm.hybridize(lambda p, *xs: sum(x.sum(axis=1) for x in xs) * p, jnp.float32(2))
    return sm.export(h, tmp_path / name, example=example, shapes=shapes, constraints=constraints)


@pytest.mark.parametrize(
    "example, shapes, constraint, drawn",
    [
        ((jnp.ones((3, 5)),), ("b, t",), "t >= 4", {1: [(1, 4)], 7: [(7, 7)]}),
        ((jnp.ones((3, 5)),), ("b, t",), "t <= 8", {1: [(1, 1)], 16: [(16, 8)]}),
        ((jnp.ones((2, 3)), jnp.ones((2, 4))), ("b, 3", "b, t"), "t == 2*b",
         {1: [(1, 3), (1, 2)], 7: [(7, 3), (7, 14)]}),
    ],
    ids=["ge", "le", "eq"],
)  # fmt: skip
def test_verify_and_bench_draw_the_shapes_the_constraints_admit(
    tmp_path, capsys, monkeypatch, example, shapes, constraint, drawn
):
    """verify drew every symbolic dim at each batch (1, 7, 128) and bench at 1, which `t >= 4`
    and `t == 2*b` refuse: verify FAILED with a SignatureError, bench printed JAX's traceback.
    The batch dimension is the batch; the others move where a constraint sets or bounds them."""
    art = _scaled(tmp_path, "m", example, shapes, (constraint,))
    assert main(["verify", str(art.path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and [c["batch"] for c in report["checks"]] == [1, 7, 128]
    assert report["skipped"] == []
    seen = []
    call = sm.LoadedModel.__call__

    def spy(self, *xs, **kw):
        seen.append([tuple(x.shape) for x in xs])
        return call(self, *xs, **kw)

    monkeypatch.setattr(sm.LoadedModel, "__call__", spy)
    for batch, shapes_drawn in drawn.items():
        seen.clear()
        argv = ["bench", str(art.path), "--batch", str(batch), "--calls", "1", "--repeats", "1"]
        assert main(argv) == 0, capsys.readouterr().err
        _, *timed = seen  # load's self-test runs first, on its vectors' shapes
        assert timed and all(s == shapes_drawn for s in timed)
    assert "Traceback" not in capsys.readouterr().err


def test_a_batch_the_constraints_refuse_is_named_and_the_rest_checked(tmp_path, capsys):
    """`b >= 4` refuses batch 1 itself: verify says which batch it skipped and why, checks 7
    and 128, and passes; with no batch admitted it says what to pass, as bench does."""
    art = _scaled(tmp_path, "m", (jnp.ones((5, 3)),), ("b, t",), ("b >= 4",))
    report = sm.verify(art.path)
    assert report.ok and [c.batch for c in report.checks] == [7, 128]
    (skipped,) = report.skipped
    assert "batch 1 is not checked" in skipped and "b >= 4" in skipped
    assert "Pass batch sizes within them" in skipped and skipped in str(report)
    assert main(["verify", str(art.path), "--batches", "1,2"]) == 2
    err = capsys.readouterr().err
    assert "batch 2 is not checked" in err and "Traceback" not in err
    assert main(["bench", str(art.path), "--calls", "1"]) == 2
    err = capsys.readouterr().err
    assert "batch=1): the inputs drawn at batch 1 do not fit" in err and "b >= 4" in err
    assert "Traceback" not in err


@pytest.mark.slow  # (the README suite: within 10 minutes on 2 cores)
def test_verify_of_a_model_that_returns_an_rng_key_compares_its_key_data(tmp_path, capsys):
    """The fresh process turned outputs into NumPy arrays with np.asarray, which refuses a key:
    `symjax-mlp verify` printed its traceback and FAILED. A key is compared by its key data."""
    h = sm.hybridize(lambda p, x: (x * p, jax.random.fold_in(jax.random.key(7), 3)), 2.0)
    art = sm.export(h, tmp_path / "a", example=jnp.ones((2, 3)))
    assert main(["verify", str(art.path), "--batches", "1,3"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "Traceback" not in out
    report = sm.verify(art.path, reference=h, batches=(2,))
    assert report.ok and report.checks[0].max_abs_err == 0
    wrong = sm.hybridize(lambda p, x: (x * p, jax.random.fold_in(jax.random.key(7), 4)), 2.0)
    assert not sm.verify(art.path, reference=wrong, batches=(2,)).ok
    np.testing.assert_array_equal(np.asarray(h(jnp.ones((2, 3)))[0]), np.full((2, 3), 2.0))
