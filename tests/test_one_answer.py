"""One model, one answer through every door: ``net.apply``, ``h(x)``, ``h.apply``, the loaded
``m(x)`` and ``m.apply``, a Batcher over either, ``symjax-mlp run`` on a .npy file and HTTP's
``/predict`` (session 61, part E). Each door answers an input with h's values and dtype, or
refuses it with a message that says what to pass; none answers in another dtype in silence.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp.cli import main

X = (np.arange(6, dtype=np.float32).reshape(2, 3) - 2.5) / 7


def _same(got, want):
    """``got`` has ``want``'s dtype and values (the dtype first: a bfloat16 answer where the
    model answers float32 may hold the same rounded values)."""
    assert np.asarray(got).dtype == np.asarray(want).dtype, (got, want)
    np.testing.assert_array_equal(np.asarray(got, np.float64), np.asarray(want, np.float64))


@pytest.mark.slow  # an export, its load and h's four traces: 1.8 s
def test_an_export_at_a_weak_scalar_answers_as_h_or_refuses_a_strong_one(tmp_path):
    """Export traced a weakly typed scalar example (jnp.asarray(1.5), a Python number) as jit
    does, so a bfloat16 model times it stays bfloat16; but the artifact recorded the input as a
    plain float32 (jax.export serializes no weak type), and the loaded model took a float32
    array there and answered bfloat16 where h promotes to float32: another dtype, in silence.
    The manifest records the weak type; a weakly typed input answers as h does, a strongly
    typed one is refused by every door that takes it (m, m.apply), a jax.Array after a weak one
    of its shape too (a call checks the weak type before its cache of checked shapes)."""
    h = sm.hybridize(lambda p, x: p["w"] * x, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    weak = jnp.asarray(1.5)
    m = sm.load(sm.export(h, tmp_path / "m", example=weak, batch=None).path)
    assert m.signature.inputs[0].weak_type and "(weak)" in str(m.signature)
    for x in (1.5, weak, 2):  # weakly typed: the model's answer, bfloat16
        _same(m(x), h(x))
        _same(m.apply(m.params, x), h(x))
    assert h(weak).dtype == jnp.bfloat16
    for x in (np.float32(1.5), np.asarray(1.5, np.float32), jnp.float32(1.5)):
        assert h(x).dtype == jnp.float32  # what the artifact cannot answer
        for door in (m, functools.partial(m.apply, m.params)):
            with pytest.raises(sm.SignatureError) as e:
                door(x)
            said = str(e.value)
            head = f'symjax_mlp.load("{m.path}"): input args[0] takes only a Python number such '
            assert said.startswith(head + "as 2.0, as it was exported; got a "), said
            assert "float32[], strongly typed" in said and "Pass a Python number, x.item()" in said
            assert "or export at np.float32(2.0) to take arrays." in said, said


@pytest.mark.slow  # two exports and loads: 1.3 s
def test_an_export_at_a_strong_scalar_refuses_a_python_number_h_answers_otherwise(tmp_path):
    """The converse: exported at np.float32(1.5), a bfloat16 model answers float32, and m(1.5)
    cast the Python number to float32 and answered float32 where h(1.5) answers bfloat16, in
    silence. Export records the scalar inputs where a Python number changes the model's dtypes
    and the loaded model refuses one there (a weak jax.Array too, after a strong one of its
    shape); where it changes nothing (x's float32 rows decide), a Python number still answers
    as h does."""
    h = sm.hybridize(
        lambda p, x, s: (p["w"] * s, x * s), {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)}
    )
    example = (X, np.float32(1.5))
    m = sm.load(sm.export(h, tmp_path / "m", example=example, batch=None).path)
    assert m.signature.strong == ("args[1]",)
    _same(m(*example)[0], h(*example)[0])
    assert h(X, 1.5)[0].dtype == jnp.bfloat16  # what the artifact cannot answer
    for s in (1.5, 2, jnp.asarray(1.5)):
        for door in (m, functools.partial(m.apply, m.params)):
            with pytest.raises(sm.SignatureError) as e:
                door(X, s)
            said = str(e.value)
            head = f'symjax_mlp.load("{m.path}"): input args[1] takes only a strongly typed '
            assert said.startswith(head + "float32 scalar such as np.float32(2.0)"), said
            assert ", weakly typed, " in said and "Pass np.float32(x);" in said, said
    same = sm.hybridize(lambda p, x, s: x * s * p["w"], {"w": jnp.ones(3, jnp.float32)})
    m = sm.load(sm.export(same, tmp_path / "same", example=example, batch=None).path)
    assert m.signature.strong == ()
    _same(m(X, 1.5), same(X, 1.5))


def test_an_export_at_a_weak_array_takes_arrays_as_h_does(tmp_path):
    """An example of more than one value that is weakly typed (jnp.full's, a weak scalar
    broadcast) exports as jax.export records it, strongly typed, as a NumPy array of it traces:
    the loaded model answers a float32 array as h does (float32 for a bfloat16 model)."""
    h = sm.hybridize(lambda p, x: p["w"] * x, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    weak = jnp.full((2, 3), 1.5)
    assert jax.typeof(weak).weak_type
    m = sm.load(sm.export(h, tmp_path / "m", example=weak).path)
    assert not m.signature.inputs[0].weak_type
    _same(m(X), h(X))
    _same(m.apply(m.params, X), h(X))
    assert m(X).dtype == jnp.float32


@pytest.fixture(scope="module")
def doors(tmp_path_factory):
    """Each door of one float32 MLP, by name: a function of an input that answers or raises."""
    from test_http_hostile import _in_thread, _post  # (skipped without the serve extra)

    net = sm.mlp((4, 2))
    variables = net.init(jax.random.key(0), X)
    h = sm.hybridize(net, variables)
    where = tmp_path_factory.mktemp("doors")
    m = sm.load(sm.export(h, where / "m", example=X).path)
    out = where / "y.npy"

    def cli(x):
        np.save(where / "x.npy", np.asarray(x))
        if main(["run", str(m.path), "--input", str(where / "x.npy"), "--output", str(out)]):
            raise sm.SignatureError("run refused it")  # (its one line: test_cli's)
        return np.load(out)

    def http(x):
        body = x if isinstance(x, (list, tuple)) else np.asarray(x).tolist()
        code, raw = _post(url, json.dumps({"inputs": body}).encode())
        if code != 200:
            assert 400 <= code < 500 and "message" in json.loads(raw), raw
            raise sm.SignatureError(json.loads(raw)["message"])
        return np.asarray(json.loads(raw)["outputs"], np.float32)  # JSON: float32's values

    with (
        sm.serving.Batcher(m, max_batch=4) as bm,
        sm.serving.Batcher(h, example=X, max_batch=4) as bh,
        sm.serving.Batcher(m, max_batch=4) as served,
        _in_thread(sm.serving.create_app(served, close_batcher=False), lifespan="off") as url,
    ):
        yield {
            "net.apply": lambda x: net.apply(variables, x),
            "h": h,
            "h.apply": lambda x: h.apply(h.params, x),
            "m": m,
            "m.apply": lambda x: m.apply(m.params, x),
            "Batcher(m)": bm,
            "Batcher(h)": bh,
            "run": cli,
            "http": http,
        }


def _readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


KINDS = {  # what a user may pass: h's answer is the reference where h takes it
    "float32": lambda: X,
    "list": lambda: X.tolist(),
    "nested tuple": lambda: tuple(map(tuple, X.tolist())),
    "float64": lambda: X.astype(np.float64),
    "int": lambda: np.arange(6).reshape(2, 3),
    "bool": lambda: X > 0,
    "bfloat16": lambda: X.astype(jnp.bfloat16),
    "float16": lambda: X.astype(np.float16),
    "non-contiguous": lambda: np.repeat(X, 2, axis=1)[:, ::2],
    "Fortran order": lambda: np.asfortranarray(X),
    "read-only": lambda: _readonly(X),
    "jax.Array": lambda: jnp.asarray(X),
    "jax.Array on device 1": lambda: jax.device_put(X, jax.devices()[1]),
    "a row as a list of ints": lambda: [[1, 2, 3]],
}


@pytest.mark.slow  # a CLI run and an HTTP request per input: ~0.3 s each, 1.2 s the fixture
@pytest.mark.parametrize("kind", KINDS)
def test_every_door_answers_an_input_as_h_does_or_refuses_it(doors, kind):
    """Every door that answers gives one dtype and one set of values: h's where h takes the
    input, else (a Python list, which h refuses) those of its array; a door that does not
    answer refuses with a symjax_mlp error (run: exit 2, HTTP: a 4xx JSON body). Nothing is
    cast to another dtype behind the caller's back."""
    x = KINDS[kind]()
    answers, refused = {}, {}
    for name, door in doors.items():
        try:
            answers[name] = np.asarray(door(x))
        except sm.SymjaxError as e:
            refused[name] = str(e)
        except DeprecationWarning as e:  # JAX's of a model given a list, an error to come
            assert name in ("net.apply", "h", "h.apply") and isinstance(x, (list, tuple)), e
    assert "m" in answers or "h" in answers, refused  # each kind is taken somewhere
    want = answers.get("h", answers.get("net.apply"))
    if want is None:  # h refuses it (a list, JAX a tuple): the array it is, as m makes it
        want = np.asarray(doors["h"](np.asarray(x, np.float32)))
    for name, got in answers.items():
        assert got.dtype == want.dtype, (name, got.dtype, want.dtype)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=name)


def _bf16():
    """A bfloat16 weight times the input: float32 for a strongly typed float32 input, bfloat16
    for a weakly typed one (JAX's promotion, type_promotion.rst)."""
    return sm.hybridize(lambda p, x: p["w"] * x, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})


@pytest.mark.slow  # two exports and loads, a Batcher, h's and m's traces: ~3 s
@pytest.mark.parametrize("at", ["strong", "weak"])
def test_a_weak_array_the_model_answers_otherwise_is_refused_at_each_door(tmp_path, at):
    """A bfloat16 model exported at a float32 array (at a weak one too: export records it
    strong, as jax.export does) answers float32; h answers a weakly typed array
    (jnp.full(s, 1.5), jax.vmap over Python numbers) in bfloat16, and m, m.apply, jax.jit(m),
    jax.vmap(m) and a Batcher over m took it and answered float32, in silence. Export now
    records it in ``strong`` and each door refuses a weak array there, a shape it answered
    before too, naming x.astype(jnp.float32); strong ones are answered as h answers them."""
    h = _bf16()
    weak = jnp.full(X.shape, 1.5)
    example = X if at == "strong" else jnp.full(X.shape, 0.5)
    m = sm.load(sm.export(h, tmp_path / "m", example=example).path)
    assert h(weak).dtype == jnp.bfloat16 and m.signature.strong == ("args[0]",)
    _same(m(jnp.asarray(X)), h(X))  # a strong jax.Array of weak's shape first: cached
    with sm.serving.Batcher(m, max_batch=4) as b:
        doors = {
            "m": m,
            "m.apply": functools.partial(m.apply, m.params),
            "jax.jit(m)": jax.jit(m),
            "jax.vmap(m)": lambda x: jax.vmap(m)(x),  # each row: float32[3], weakly typed
            "Batcher(m)": b,
        }
        for name, door in doors.items():
            with pytest.raises(sm.SignatureError) as e:
                door(weak)
            said = str(e.value)
            assert "input args[0] takes only a strongly typed float32 array" in said, name
            assert "weakly typed" in said and "Pass x.astype(jnp.float32)" in said, (name, said)
            strong = weak.astype(jnp.float32)
            _same(door(strong), h(strong))
    _same(m(X), h(X))


@pytest.mark.slow  # an export and its load: ~1 s
def test_a_model_a_weak_array_changes_nothing_for_takes_both_on_the_plain_path(tmp_path):
    """Where a weak array is answered as a strong one (float32 weights), nothing is recorded
    and the loaded model is the plain one, whose calls check no weak type: both answer as h."""
    h = sm.hybridize(lambda p, x: p["w"] * x, {"w": jnp.arange(1, 4, dtype=jnp.float32)})
    m = sm.load(sm.export(h, tmp_path / "m", example=X).path)
    assert m.signature.strong == () and type(m) is sm.LoadedModel
    for x in (X, jnp.full(X.shape, 1.5), jnp.asarray(X)):
        _same(m(x), h(x))


@pytest.mark.slow  # two exports and loads: ~1.5 s
def test_vmap_of_weak_scalars_answers_as_h_or_is_refused(tmp_path):
    """jax.vmap over Python numbers' array (jnp.full(n, 1.5), weakly typed) gives m a weak
    scalar per example: an export at a Python number answers it as h does (bfloat16), one at
    np.float32(1.5) refuses it (h: bfloat16, the program: float32); a strong array's scalars
    go the other way."""
    h = _bf16()
    weak, strong = jnp.full((2,), 1.5), jnp.asarray([1.5, 2.0])
    for example, takes in ((jnp.asarray(1.5), weak), (np.float32(1.5), strong)):
        where = tmp_path / ("weak" if takes is weak else "strong")
        m = sm.load(sm.export(h, where, example=example, batch=None).path)
        _same(jax.vmap(m)(takes), jax.vmap(h)(takes))
        other = strong if takes is weak else weak
        with pytest.raises(sm.SignatureError, match=r"input args\[0\] takes only a "):
            jax.vmap(m)(other)
