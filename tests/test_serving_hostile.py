"""The Batcher against models and callers that misbehave: what a model raises or does to the
batcher that runs it, and callers that come from odd places, never leave a request unanswered
or the batcher wedged. Every wait is bounded, so that a regression fails rather than hangs.
"""

from __future__ import annotations

import asyncio
import fractions
import math
import os
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
from helpers import bounded

import symjax_mlp as sm

X1 = np.ones((1, 2), np.float32)
X7 = np.full((1, 2), 7, np.float32)  # the row a model below raises on
X9 = np.full((1, 2), 9, np.float32)  # the row a model below waits on, at its gate


class Gate(threading.Event):
    """Set, it lets a model's row of 9s through; ``entered`` is set once one waits at it."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = threading.Event()

    def busy(self, b):
        """Submits a row of 9s to ``b``; returns its future once the model waits at the gate
        (the batcher's thread busy: what comes next queues)."""
        future = b.submit(X9)
        assert self.entered.wait(30), "the gated request never ran"
        return future


def _model(error, gate=None):
    def model(x):
        if gate is not None and (x[:, 0] == 9).any():
            gate.entered.set()
            assert gate.wait(30), "the test never opened the gate"
        if (x[:, 0] == 7).any():
            raise error("boom")
        return x * 2

    return model


@pytest.mark.parametrize("error", [StopIteration, GeneratorExit])
def test_a_model_raising_stop_iteration_answers_every_awaiting_caller(error):
    """An asyncio future refuses StopIteration (a TypeError, on the loop): the awaited requests
    of that batch, alone or merged, were never answered. A GeneratorExit thrown into a task
    closed each coroutine up to it, their handlers' answers dropped (an HTTP server's request
    unanswered, the error out of the app). They get a RuntimeError from it."""
    gate = Gate()
    with sm.serving.Batcher(_model(error, gate), example=X1, max_batch=4) as b:

        async def lone():
            return await asyncio.wait_for(b.asubmit(X7), 10)

        says = rf"the model raised {error.__name__}\('boom'\)"
        with pytest.raises(RuntimeError, match=says) as e:
            asyncio.run(lone())
        assert isinstance(e.value.__cause__, error)
        busy = gate.busy(b)  # the batcher's thread waits at the gate: the next two queue

        async def merged():
            requests = [b.asubmit(X7), b.asubmit(X1)]
            asyncio.get_running_loop().call_later(0.2, gate.set)
            return await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 10)

        answers = asyncio.run(merged())
        assert [type(a) for a in answers] == [RuntimeError, RuntimeError], answers
        np.testing.assert_array_equal(busy.result(10), 2 * X9)
        with pytest.raises(error):  # the other callers get it as it was raised
            b.submit(X7).result(10)
        np.testing.assert_array_equal(b(X1), 2 * X1)


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_a_model_raising_system_exit_leaves_the_awaiting_loop_running(error):
    """asyncio.wait_for and gather wrap an AsyncRequest (no Future) in a Task, which raises
    KeyboardInterrupt and SystemExit out of the loop: the caller's loop died, even where it
    caught BaseException. It gets a RuntimeError from it, as for StopIteration."""
    with sm.serving.Batcher(_model(error), example=X1, max_batch=4) as b:

        async def guarded(make):
            try:
                return await make()
            except BaseException as e:  # what the caller catches
                return e

        for make in (
            lambda: asyncio.wait_for(b.asubmit(X7), 10),
            lambda: asyncio.gather(b.asubmit(X7)),
        ):
            try:
                got = asyncio.run(guarded(make))
            except BaseException as e:  # the loop died
                got = f"asyncio.run raised {e!r}"
            assert isinstance(got, RuntimeError), got
            assert isinstance(got.__cause__, error) and "the model raised" in str(got)
        np.testing.assert_array_equal(b(X1), 2 * X1)


class _Unrepresentable(StopIteration):
    def __repr__(self):
        raise ValueError("no repr")


def test_a_model_raising_a_stop_iteration_without_a_repr_answers_its_callers():
    """Its RuntimeError quoted repr(error), which raised on the loop: no request answered."""
    with sm.serving.Batcher(_model(_Unrepresentable), example=X1, max_batch=4) as b:

        async def both():
            requests = [b.asubmit(X7), b.asubmit(X7)]
            return await asyncio.wait_for(asyncio.gather(*requests, return_exceptions=True), 10)

        answers = asyncio.run(both())
        assert [str(a) for a in answers] == ["the model raised _Unrepresentable"] * 2, answers


def test_a_model_calling_its_own_batcher_is_answered_not_wedged():
    """A model that called b(x) while it ran alone (b(x) on the caller's thread, or a lone
    asubmit on the loop) waited for the lane it held: that request and every later one hung."""
    box = {}

    def model(x):
        if (x[:, 0] == 7).any():
            return box["b"](X1) + x  # X1 * 2 + x
        return x * 2

    b = box["b"] = sm.serving.Batcher(model, example=X1, max_batch=4)

    async def awaited():
        return await asyncio.wait_for(b.asubmit(X7), 10)

    try:
        for call in (
            lambda: b(X7),
            lambda: b.submit(X7).result(10),
            lambda: asyncio.run(awaited()),
        ):
            np.testing.assert_array_equal(bounded(call, 20), X7 + 2)
        np.testing.assert_array_equal(bounded(lambda: b(X1), 20), 2 * X1)
    finally:  # a wedged batcher: the inner request cancelled lets the outer one end
        b.close(cancel=True, timeout=20)


def test_a_model_waiting_on_its_own_batchers_future_is_answered_not_wedged():
    """A model (or a done callback) that called b.submit(x).result(): the request queued behind
    the batch that waited for it, so its result never came (the batcher wedged for ever). It
    runs at once, on the thread that holds the lane, as b(x) there does; closed, it is refused."""
    box, seen = {}, []

    def model(x):
        if (x[:, 0] == 7).any():
            return box["b"].submit(X1).result(5) + x  # X1 * 2 + x
        if (x[:, 0] == 9).any():
            box["b"].close()
            return box["b"].submit(X1).result(5)
        return x * 2

    b = box["b"] = sm.serving.Batcher(model, example=X1, max_batch=4)

    def callback(f):
        seen.append(b.submit(X1).result(5))

    def submitted():
        f = b.submit(X7)
        f.add_done_callback(callback)
        return f.result(20)

    async def awaited():
        return await asyncio.wait_for(b.asubmit(X7), 20)

    try:
        for call in (lambda: b(X7), submitted, lambda: asyncio.run(awaited())):
            np.testing.assert_array_equal(bounded(call, 30), X7 + 2)
        np.testing.assert_array_equal(bounded(lambda: seen, 30), [2 * X1])
        with pytest.raises(RuntimeError, match=r"Batcher\(model\) is closed"):
            bounded(lambda: b(X9), 30)
    finally:  # a wedged batcher: the inner request cancelled lets the outer one end
        b.close(cancel=True, timeout=20)


_ENDLESS_ON_ZEROS = """
import os, jax, jax.numpy as jnp, numpy as np, symjax_mlp as sm
def doubling(p, x):  # doubles x until its first entry passes p: for ever on zeros
    return jax.lax.while_loop(lambda y: jnp.abs(y[0, 0]) < p, lambda y: y * 2, x)
h = sm.hybridize(doubling, jnp.float32(10))
print(h(jnp.ones((1, 2))).tolist(), flush=True)
try:
    sm.serving.Batcher(h, example=jnp.ones((1, 2)), max_batch=2, warm_up_timeout=1)
except TimeoutError as e:
    print(e, flush=True)
    os._exit(0)  # its thread still runs the loop on zeros
os._exit(3)
"""


def test_a_model_that_never_returns_on_zero_rows_times_the_warm_up_out():
    """The warm-up calls the model on zero rows, as padding does: a while loop that never ends
    on zeros made Batcher(...) itself hang, the caller's thread with it. It runs on the
    batcher's thread: past warm_up_timeout, a TimeoutError says why and what to do."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", _ENDLESS_ON_ZEROS],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    done, says = out.stdout.splitlines()
    assert done == "[[16.0, 16.0]]"
    assert says.startswith("Batcher(doubling): warming up, the model did not return within 1 s")
    assert "a batch of 1 rows of zeros" in says and "returns on zero rows" in says


def test_a_batchers_warm_up_timeout_is_checked_and_its_errors_reach_the_caller():
    def model(x):
        return x * 2

    for bad in ("a", -1, float("nan"), True):
        with pytest.raises(sm.ConfigError, match=r"warm_up_timeout=.*: pass seconds >= 0"):
            sm.serving.Batcher(model, example=X1, warm_up_timeout=bad)
    with sm.serving.Batcher(model, example=X1, max_batch=2, warm_up_timeout=None) as b:
        np.testing.assert_array_equal(b(X7), 2 * X7)
    with pytest.raises(sm.ConfigError, match="per-row outputs"):  # raised on its thread
        sm.serving.Batcher(lambda x: x.sum(), example=X1, max_batch=2, warm_up_timeout=30)


@pytest.mark.parametrize("out", [None, (), {}, [None]])
def test_a_model_that_returns_no_array_is_refused_when_the_batcher_is_made(out):
    """A model that forgot its return (def model(x): x * 2) was served: every request, and
    every HTTP client, answered None."""

    def model(x):  # x * 2, its return forgotten (or no array in what it returns)
        return out

    with pytest.raises(sm.ConfigError, match=r"returned no array for a batch of 1 rows") as e:
        sm.serving.Batcher(model, example=X1, max_batch=2)
    assert f"(it returned {out!r})" in str(e.value) and "returns its outputs" in str(e.value)


@pytest.mark.parametrize("seconds", [math.inf, np.float32(30), fractions.Fraction(30)])
def test_a_timeout_of_any_real_number_waits(seconds):
    """b.run(x, timeout=math.inf) behind a running batch, close(timeout=inf) with work queued,
    and Batcher(..., warm_up_timeout=inf) were Python's OverflowError ('timestamp out of range
    for platform time_t'): threading takes no wait past threading.TIMEOUT_MAX. A NumPy float
    or a Fraction, which the checks take, was a TypeError ('cannot be interpreted as an
    integer'): threading takes Python's floats."""
    gate = Gate()

    def slow(x):  # a warm-up that takes a while: the caller waits on it
        time.sleep(0.2)
        return x * 2

    with sm.serving.Batcher(slow, example=X1, max_batch=1, warm_up_timeout=seconds) as b:
        np.testing.assert_array_equal(b(X1), 2 * X1)
    b = sm.serving.Batcher(_model(RuntimeError, gate), example=X1, max_batch=1)
    busy = gate.busy(b)
    threading.Timer(0.3, gate.set).start()
    np.testing.assert_array_equal(bounded(lambda: b.run(X1, timeout=seconds), 30), 2 * X1)
    gate.clear()
    busy, queued = gate.busy(b), b.submit(X1)
    threading.Timer(0.3, gate.set).start()
    bounded(lambda: b.close(timeout=seconds), 30)
    assert [busy.result(1).tolist(), queued.result(1).tolist()] == [(2 * X9).tolist(), [[2, 2]]]


def test_a_hybrid_whose_trace_budget_is_below_the_buckets_is_told_how_to_serve_it():
    """hybridize(..., max_traces=1) served with the default buckets: a RetraceError at the
    second bucket, 'args[0].shape changed from (1, 3) to (2, 3)', not saying that the batcher
    traces once per bucket nor what to pass."""
    import jax
    import jax.numpy as jnp

    net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), x), max_traces=1)
    with pytest.raises(sm.RetraceError) as e:
        sm.serving.Batcher(h, example=x, max_batch=8)
    says = (
        "Batcher(HybridSequential) traces the model once per bucket, (1, 2, 4, 8): pass "
        "buckets=(8,) (one trace), or max_traces >= 4."
    )
    assert says in e.value.__notes__, e.value.__notes__
    assert not [n for n in e.value.__notes__ if "warming up" in n]  # a model's own error's note
    h = sm.hybridize(net, net.init(jax.random.key(0), x), max_traces=1)  # its budget unspent
    with sm.serving.Batcher(h, example=x, buckets=(8,)) as b:  # as the note says
        np.testing.assert_array_equal(b(np.ones((3, 3), np.float32)), h(jnp.ones((8, 3)))[:3])


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_an_integer_of_thousands_of_digits_is_refused_as_out_of_range(dtype):
    """int() refuses 4300 digits: such a body was "not valid JSON" (400) and told the client
    to call sys.set_int_max_str_digits(), where 1e400 is a SignatureError (422)."""
    from symjax_mlp.serving import _bodies

    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), dtype), max_batch=2) as b:
        with pytest.raises(sm.SignatureError, match="beyond every dtype's range") as e:
            _bodies.decode(b, b'{"inputs": [[' + b"9" * 5000 + b", 0]]}", "application/json")
        assert "set_int_max_str_digits" not in str(e.value)
        with pytest.raises(_bodies.BadRequest, match="not valid JSON"):  # a syntax error still
            _bodies.decode(b, b'{"inputs": [[9, 0]]', "application/json")


def test_a_json_body_of_more_numbers_than_a_request_holds_is_refused_before_parsing():
    """60 MB of "1," for a model of one int per row was parsed whole (10 s of the event loop,
    850 MB) before its shape was refused: one client stalled the server. A body with more
    numbers than max_batch rows hold is a 413 now; whitespace in a valid one is no matter."""
    from symjax_mlp.serving import _bodies

    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 1), np.int32), max_batch=2) as b:
        with pytest.raises(_bodies.BadRequest, match="more than a request of at most 2 rows") as e:
            _bodies.decode(b, b'{"inputs": [[' + b"1, " * 5000 + b"1]]}", "application/json")
        assert e.value.status == 413
        spaced = b'{"inputs": [' + b",".join([b"[ 1 ]" + b" " * 8000] * 2) + b"]}"
        [x], _ = _bodies.decode(b, spaced, "application/json")
        assert x.tolist() == [[1], [1]]


@pytest.mark.parametrize("batched", [False, True])
def test_a_batcher_of_a_model_taking_a_key_is_refused_naming_the_key(batched):
    """flax examples/vae's VAE(x, z_rng): Batcher(h, example=(x, key)) advised x[None] for the
    key, and then (key[None]) failed with NumPy's TypeError 'data type key<fry> not understood'.
    A key is one value shared by every row: the message names it and how to serve the model."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class Noisy(nn.Module):  # examples/vae's calling convention, reduced
        @nn.compact
        def __call__(self, x, z_rng):
            mean = nn.Dense(3)(x)
            return mean + jax.random.normal(z_rng, mean.shape)

    model, x, key = Noisy(), jnp.ones((4, 5)), jax.random.key(1)
    variables = model.init(jax.random.key(0), x, key)
    example = (x[:1], key[None] if batched else key)
    with pytest.raises(sm.ConfigError, match=r"input 1 is a typed rng key") as e:
        sm.serving.Batcher(sm.hybridize(model, variables), example=example, max_batch=4)
    assert "x[None]" not in str(e.value) and "closing over it" in str(e.value)
    h = sm.hybridize(lambda p, x: model.apply(p, x, key), variables)  # as the message says
    with sm.serving.Batcher(h, example=x[:1], max_batch=4) as b:
        assert b(np.ones((2, 5), np.float32)).shape == (2, 3)


@pytest.mark.parametrize("refused", [1, 2])
def test_a_model_raising_in_the_warm_up_is_told_it_was_on_rows_of_zeros(refused):
    """What the model raised on the warm-up's call (each bucket, on zero rows) reached
    Batcher(...) as it was, with nothing to say that it came from a call the caller never made,
    nor on which rows: a model that refuses all-zero rows (a check, a division) was a mystery."""

    def model(x):
        if len(x) == refused and not x.any():
            raise ValueError("no signal in the batch")
        return x * 2

    with pytest.raises(ValueError, match="no signal in the batch") as e:
        sm.serving.Batcher(model, example=X1, max_batch=4)
    [note] = e.value.__notes__
    says = f"Batcher(model): raised by the model warming up, on a batch of {refused} rows of zeros"
    assert note.startswith(says) and "padding" in note and "rows of zeros" in note, note


def test_a_model_whose_output_rows_depend_on_the_batch_size_is_refused_showing_both():
    def model(x):  # a row per row, but as wide as the batch
        return {"y": np.zeros((len(x), len(x)), np.float32)}

    with pytest.raises(sm.ConfigError) as e:
        sm.serving.Batcher(model, example=X1, max_batch=2)
    says = (
        "Batcher(model): the outputs for a batch of 2 rows are PyTreeDef({'y': *}) of rows "
        "float32[2], but for a batch of 1, PyTreeDef({'y': *}) of rows float32[1], while"
    )
    assert str(e.value).startswith(says), e.value


@pytest.mark.parametrize(
    "x", [[[10**40, 1]], [[1e40, 1]], np.array([[-1e40, 1]]), [[10**400, 1.5]]]
)
def test_a_request_beyond_its_dtypes_range_is_told_so_not_to_cast_it(x):
    """b([[10**40, 1]]) of a float32 model was told to cast it, x.astype(np.float32), which
    makes inf (an int32 model's 2**40, which wraps): it is told the values are out of range,
    as a JSON body is."""
    with sm.serving.Batcher(lambda x: x * 2, example=X1, max_batch=2) as b:
        beyond = r"holds numbers beyond float32's range \(largest 3.403e\+38\)"
        with pytest.raises(sm.SignatureError, match=beyond) as e:
            b(x)
        assert "astype" not in str(e.value), e.value
        for dtype in (np.float64, np.float16):  # in range: a cast it is (float16: no overflow)
            with pytest.raises(sm.SignatureError, match=r"Cast it: x.astype\(np.float32\)"):
                b(np.ones((1, 2), dtype))
    with sm.serving.Batcher(lambda x: x, example=np.zeros((1, 2), np.int32), max_batch=2) as b:
        held = r"holds integers outside int32's range \[-2147483648, 2147483647\], which a cast"
        with pytest.raises(sm.SignatureError, match=held):
            b([[2**40, -1]])


class _NoArray:
    def __array__(self, *args, **kwargs):
        raise ValueError("no array here")


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda x: (row for row in x), "of type generator, which NumPy reads as Python objects"),
        (
            lambda x: {"y": _NoArray()},
            "of type _NoArray, which NumPy cannot read as an array "
            r"\(ValueError: no array here\)",
        ),
        (lambda x: np.array([object()] * len(x)), "of type ndarray, which NumPy reads as Python"),
        (
            lambda x: jax.random.split(jax.random.key(0), len(x)),
            r"of type \w+, which NumPy cannot "
            r"read as an array \(TypeError: .*Use jax.random.key_data",
        ),
    ],
    ids=["generator", "__array__ raises", "objects", "prng key"],
)
def test_a_model_whose_outputs_are_no_arrays_of_numbers_is_refused_naming_the_output(make, says):
    """A generator was refused as an output 'of shape ()'; an __array__ that raised, or a typed
    key, was a bare ValueError or JAX's TypeError; object arrays were served, and every HTTP
    request was a 500 logged as a bug of the server's, its .npy refused (allow_pickle=False)."""
    with pytest.raises(sm.ConfigError, match=rf"Batcher\(<lambda>\): output out.* is {says}") as e:
        sm.serving.Batcher(make, example=X1, max_batch=2)
    assert "per-row outputs: arrays of numbers" in str(e.value), str(e.value)


@pytest.mark.parametrize(
    ("model", "kwargs", "says"),
    [
        (lambda x: np.zeros((len(x), 2**40)), None, "out of memory: a smaller max_batch"),
        (lambda x, **kw: np.add(x, x, **kw), {"train": 0}, "takes the example's inputs and kwargs"),
    ],
    ids=["out of memory", "kwargs it passes on to a call not taking them"],
)
def test_a_warm_up_failing_on_memory_or_arguments_is_told_what_to_change(model, kwargs, says):
    """Out of memory at the largest bucket, or a plain function not taking kwargs=, had the one
    note 'Serve a model that runs on rows of zeros': no word of max_batch or of the kwargs."""
    with pytest.raises((MemoryError, ValueError, TypeError)) as e:
        sm.serving.Batcher(model, example=X1, max_batch=2, kwargs=kwargs)
    [note] = e.value.__notes__
    assert note.startswith("Batcher(<lambda>): raised by the model warming up") and says in note


def test_a_callable_given_kwargs_or_inputs_it_does_not_take_is_refused_naming_them():
    """A plain callable's TypeError reached the caller raw from the warm-up (a Hybrid's is a
    ConfigError naming the kwargs): its signature is now checked as a Hybrid's is."""

    def model(x, scale=1.0):
        return x * scale

    for example, kwargs, says in (
        (X1, {"train": False}, r"kwargs=\{'train': False\}, but got an unexpected keyword"),
        ((X1, X1, X1), {}, r"example's 3 inputs, but too many positional arguments"),
    ):
        with pytest.raises(sm.ConfigError, match=rf"^Batcher\(model\): a request calls .*{says}"):
            sm.serving.Batcher(model, example=example, kwargs=kwargs)
    with sm.serving.Batcher(model, example=X1, kwargs={"scale": 2.0}) as b:  # one it takes
        np.testing.assert_array_equal(b(X1), 2 * X1)
    with sm.serving.Batcher(np.negative, example=X1) as b:  # a ufunc: read as ever
        np.testing.assert_array_equal(b(X1), -X1)


def test_a_hybrid_and_a_callable_not_taking_the_example_or_kwargs_are_refused_alike():
    """A Hybrid and a plain function of one signature were refused in two messages (one named
    the signature, the other the kwargs fix): one check now serves both."""
    import jax.numpy as jnp

    def model(x, train):
        return x

    h = sm.hybridize(lambda p, x, train: x * p, jnp.float32(2))
    said = []
    for served in (h, model):
        for kwargs in ({}, {"scale": 1}):
            with pytest.raises(sm.ConfigError) as e:
                sm.serving.Batcher(served, example=X1, kwargs=kwargs, name="m")
            said.append(str(e.value))
    assert said[:2] == said[2:], said
    assert said[0] == (
        "Batcher(m): a request calls the model with the example's 1 input, but missing a "
        "required argument: 'train'; its signature is (x, train). Pass kwargs= of the settings"
        " it takes, e.g. kwargs={'train': False}, and an example of one array per input (a "
        "tuple for several)."
    ), said[0]
    assert "1 input and kwargs={'scale': 1}, but missing a required argument" in said[1], said[1]


@pytest.mark.parametrize("tuple_out", [False, True], ids=["array", "tuple"])
def test_an_output_unlike_the_warm_ups_is_named_by_its_path_or_none(tuple_out):
    """A single array output of the wrong shape or dtype mid-stream was "an output() of shape";
    an output of a tuple is named by its path, out[1]."""

    def model(x):
        y = x.astype(np.int32) if (x[:, 0] == 7).any() else x
        return (x, y) if tuple_out else y

    with sm.serving.Batcher(model, example=X1, max_batch=2) as b:
        with pytest.raises(RuntimeError) as e:
            b(X7)
        np.testing.assert_array_equal(b(X1)[-1] if tuple_out else b(X1), X1)  # it serves on
    said = str(e.value)
    where = " out[1]" if tuple_out else ""
    assert said.startswith(f"Batcher(model): the model returned an output{where} of shape (1, 2)")
    assert "dtype int32; it must return one row per input row" in said, said


def test_a_masked_request_is_refused_as_a_loaded_models_call_refuses_it():
    """b.submit(np.ma.array(...)) computed on the masked entries' hidden values, as if data,
    without a word (np.asarray drops the mask); m(x) and h(x) refuse it, naming x.filled(0.0)."""
    masked = np.ma.array(X7, mask=[[True, False]])
    with sm.serving.Batcher(lambda x: x, example=X1, max_batch=2) as b:
        for call in (b, lambda x: b.submit(x).result(30)):
            with pytest.raises(sm.SignatureError, match=r"args\[0\] is a NumPy masked array"):
                call(masked)
