"""A model that raises anything, at every door that runs the user's code: ``h(x)``,
``h.eager``, ``export``, a ``Batcher``, ``train()`` (in a step, in a callback).

What a user expects, decided once for all doors: the error the model raised, raised as it is
(the same object) in the caller's thread: a KeyboardInterrupt or SystemExit is the user's Ctrl-C
or exit, never swallowed or wrapped; an error whose ``__str__`` raises is still that error (the
library reads messages to explain JAX's errors, and the error its ``__str__`` raised replaced
the model's); a 10 MB message and a cyclic ``__cause__`` pass through as they are. A Batcher
hands the error to the request and serves the next ones; train() leaves only whole checkpoints.
``symjax-mlp serve`` (HTTP): tests/test_http_hostile.py (a 500 each, the next request a 200).
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm


class Fatal(BaseException):
    """A BaseException of the user's own."""


def _unreadable(base: type[Exception]) -> type[Exception]:
    """An error of ``base`` whose message cannot be read."""

    def text(self):
        raise ValueError("no text")

    return type(f"Unreadable{base.__name__}", (base,), {"__str__": text, "__repr__": text})


def _cyclic() -> ValueError:
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    return a


RAISED = {
    "KeyboardInterrupt": lambda: KeyboardInterrupt("ctrl-c"),
    "SystemExit": lambda: SystemExit(3),
    "GeneratorExit": lambda: GeneratorExit("closed"),
    "StopIteration": lambda: StopIteration("done"),
    "BaseException of its own": lambda: Fatal("the model gave up"),
    "10 MB message": lambda: RuntimeError("x" * 10**7),
    "ValueError()": ValueError,  # no message: no first line to quote
    "TypeError()": TypeError,
    "cyclic __cause__": _cyclic,
    **{
        f"unreadable {base.__name__}": (lambda base=base: _unreadable(base)())
        for base in (Exception, ValueError, TypeError, IndexError, NameError)
    },
}
X = np.ones((2, 3), np.float32)


def _raising(make):
    error = make()

    def model(p, x):
        raise error

    return error, sm.hybridize(model, jnp.float32(2))


DOORS = ["h(x)", "h.eager", "export", "Batcher"]


@pytest.mark.parametrize("door", DOORS)
@pytest.mark.parametrize("raised", RAISED)
def test_a_models_error_is_raised_as_it_is_at_each_door(raised, door, tmp_path):
    """An error whose __str__ raised came out of h(x), and a Batcher made of it, as that
    ValueError('no text'): the Hybrid read each model error's message, to explain JAX's;
    export's batch check read a ValueError's or TypeError's first line: ValueError() (none)
    came out as IndexError('list index out of range')."""
    error, h = _raising(RAISED[raised])
    run = {
        "h(x)": lambda: h(X),
        "h.eager": lambda: h.eager(X),
        "export": lambda: sm.export(h, tmp_path / "m", example=X),
        "Batcher": lambda: sm.serving.Batcher(h, example=X, max_batch=2),
    }[door]
    with pytest.raises(BaseException) as e:
        run()
    assert e.value is error, repr(e.value)
    assert not (tmp_path / "m").exists()  # an export that failed wrote nothing


@pytest.mark.parametrize("raised", RAISED)
def test_a_batchers_model_raising_anything_fails_its_request_and_serves_the_next(raised):
    error = RAISED[raised]()

    def model(x):
        if (np.asarray(x) == 13).all(axis=1).any():
            raise error
        return np.asarray(x) * 2

    with sm.serving.Batcher(model, example=X[:1], max_batch=2) as b:
        assert b.submit(np.full((1, 3), 13, np.float32)).exception(timeout=10) is error
        np.testing.assert_array_equal(b.submit(X[:1]).result(timeout=10), 2 * X[:1])
        with pytest.raises(BaseException) as e:  # on the caller's thread: as it was raised
            b(np.full((1, 3), 13, np.float32))
        assert e.value is error
        np.testing.assert_array_equal(b(X[:1]), 2 * X[:1])


@pytest.fixture(scope="module")
def tiny():
    x = np.random.default_rng(0).normal(size=(48, 12)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return sm.training.Dataset(x[:32], y[:32], x[32:], y[32:], name="tiny")


@pytest.mark.parametrize("raised", RAISED)
def test_a_model_raising_anything_in_train_is_raised_as_it_is_and_writes_nothing(
    raised, tiny, tmp_path
):
    error = RAISED[raised]()

    class Raises(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            raise error

    with pytest.raises(BaseException) as e:
        sm.training.train(Raises(), tiny, epochs=1, batch_size=16, checkpoint=tmp_path / "ck")
    assert e.value is error
    assert not os.listdir(tmp_path / "ck") if (tmp_path / "ck").exists() else True


@pytest.mark.slow
@pytest.mark.parametrize("raised", ["KeyboardInterrupt", "unreadable Exception"])
def test_a_callback_raising_anything_leaves_whole_checkpoints_and_resumes(raised, tiny, tmp_path):
    error = RAISED[raised]()

    def on_epoch(record):
        if record.epoch == 2:
            raise error

    run = {"epochs": 3, "batch_size": 16, "checkpoint": tmp_path}
    with pytest.raises(BaseException) as e:
        sm.training.train(sm.mlp((8, 2)), tiny, on_epoch=on_epoch, **run)
    assert e.value is error
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000004"]
    assert sm.training.train(sm.mlp((8, 2)), tiny, resume=True, **run).step == 6


@pytest.mark.parametrize("base", [TypeError, ValueError])
def test_an_unreadable_model_error_on_an_input_no_array_is_named_by_the_input(base):
    """The refusal of a str input quotes the model's error: its __str__'s ValueError('no
    text') came out in place of the refusal."""

    def model(p, x, s):
        raise _unreadable(base)()

    h = sm.hybridize(model, jnp.float32(2))
    for call in (h, h.eager):
        with pytest.raises(sm.SignatureError, match=r"args\[1\].*str.*could not be read"):
            call(X, "abc")
