"""Every private internal lives in ``symjax_mlp._compat``, and each public fallback computes the
same: each test runs the library with one internal on and then forced off
(``_compat.INTERNALS[name] = False``) and compares the results."""

from __future__ import annotations

import ast
import concurrent.futures
import re
import subprocess
import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import NnxDropout, keyless

import symjax_mlp as sm
from symjax_mlp import _compat

ROOT = Path(sm.__file__).parent

# What only _compat may name: private JAX/jaxlib modules, jaxlib's own modules (public:
# jax.extend.mlir), nnx's privates, and the CPython internals it wraps.
_PRIVATE = re.compile(
    r"jax\._src|jaxlib\.|_pytree__|backends_are_initialized|traceback_in_locations_limit"
    r"|futures\._base|_is_gil_enabled|_threefry2x32|_getframe|_clear_cache"
)
_FUTURE_FIELDS = {"_state", "_waiters", "_condition", "_done_callbacks", "_invoke_callbacks"}


def _code(file: Path) -> list[tuple[int, str]]:
    """The file's lines without its docstrings and comments (what runs)."""
    tree = ast.parse(file.read_text())
    docs = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docs.update(range(value.lineno, value.end_lineno + 1))
    lines = file.read_text().splitlines()
    return [(i, line.split("#")[0]) for i, line in enumerate(lines, 1) if i not in docs]


def test_private_internals_are_named_only_in_compat():
    found = []
    for file in sorted(ROOT.rglob("*.py")):
        if file.name == "_compat.py" and file.parent == ROOT:
            continue
        for i, line in _code(file):
            code = re.sub(r"\bsymjax_mlp(\.\w+)+", "", line)  # our modules' paths: no field
            names = set(re.findall(r"\.(_\w+)", code)) & _FUTURE_FIELDS
            if _PRIVATE.search(line) or names or '__class__"' in line:
                found.append(f"{file.relative_to(ROOT.parent)}:{i}: {line.strip()}")
    assert found == [], "\n".join(found)


def test_the_check_sees_a_private_import(tmp_path):
    file = tmp_path / "m.py"
    file.write_text('"""jax._src in a docstring is fine."""\nfrom jax._src import config\n')
    assert [i for i, line in _code(file) if _PRIVATE.search(line)] == [2]


@pytest.fixture
def internals(monkeypatch):
    """``off(name)``: the public fallback of that internal, for the rest of the test."""
    return lambda name: monkeypatch.setitem(_compat.INTERNALS, name, False)


def _drop(p, key, x):
    return jax.random.bernoulli(key, 0.5, x.shape) * x * p


def test_threefry_unrolled_or_as_jax_lowers_it_draws_the_same_bits(internals):
    key, x = jax.random.key(3), jnp.arange(1.0, 65.0).reshape(8, 8)
    h = sm.hybridize(_drop, jnp.float32(2))
    want = h(key, x)
    if jax.default_backend() == "cpu":
        assert "stablehlo.while" not in h.lower(key, x).as_text()
    internals("threefry")
    fallback = sm.hybridize(_drop, jnp.float32(2))  # a new program, lowered now
    if jax.default_backend() == "cpu":
        assert "stablehlo.while" in fallback.lower(key, x).as_text()  # JAX's rolled loop
    np.testing.assert_array_equal(fallback(key, x), want)


def test_the_lapack_skip_and_its_fallback_load_the_same_model(tmp_path, internals):
    kernels = _compat.lapack_kernels()
    assert kernels and "lapack_sgetrf_ffi" in kernels
    h = sm.hybridize(lambda p, x: jnp.tanh(x @ p), jnp.ones((3, 2)) / 3)
    x = jnp.arange(6.0).reshape(2, 3)
    art = sm.export(h, tmp_path / "m", example=x)
    with _compat.skipping_lapack({"stablehlo.dot_general"}):
        assert _compat._LAPACK.skip  # this thread skips the set-up
        with _compat.skipping_lapack({next(iter(kernels))}):
            assert not _compat._LAPACK.skip  # a module that calls a kernel gets it
    want = np.asarray(sm.load(art.path)(x))
    internals("lapack")
    with _compat.skipping_lapack({"stablehlo.dot_general"}):
        assert not _compat._LAPACK.skip  # the fallback: the set-up always runs
    np.testing.assert_array_equal(np.asarray(sm.load(art.path)(x)), want)
    np.testing.assert_allclose(want, h(x), rtol=1e-6)


def test_an_export_without_source_locations_computes_what_one_with_them_does(tmp_path, internals):
    h = sm.hybridize(lambda p, x: jnp.tanh(x @ p), jnp.ones((3, 2)) / 3)
    x = jnp.arange(6.0).reshape(2, 3)
    clean = sm.export(h, tmp_path / "clean", example=x)
    internals("source_locations")
    located = sm.export(h, tmp_path / "located", example=x)
    here = Path(__file__).name
    assert here not in clean.mlir_module()  # reproducible anywhere
    assert here in located.mlir_module()  # the fallback keeps them
    np.testing.assert_array_equal(sm.load(clean.path)(x), sm.load(located.path)(x))


@pytest.fixture(scope="module")
def tanh_model(tmp_path_factory):
    """A Hybrid, an input, and the model loaded from its export with a VJP module."""
    h = sm.hybridize(lambda p, x: jnp.tanh(x @ p), jnp.ones((3, 2)) / 3)
    x = jnp.arange(6.0).reshape(2, 3)
    path = tmp_path_factory.mktemp("tanh") / "m"
    return h, x, sm.load(sm.export(h, path, example=x, vjp_order=1).path)


def test_linearize_of_a_loaded_model_refused_as_it_traces_or_by_jax_when_run(tanh_model, internals):
    h, x, m = tanh_model
    with pytest.raises(sm.ConfigError, match="reverse mode only"):
        jax.linearize(m, x)
    with pytest.raises(sm.ConfigError, match="reverse mode only"):
        jax.jvp(jax.jit(m), (x,), (x,))
    grads = jax.grad(lambda x: m(x).sum())(x), jax.grad(lambda x: h(x).sum())(x)
    np.testing.assert_allclose(*grads, rtol=1e-6)  # two programs: equal to round-off
    internals("linearizing")
    y, run = jax.linearize(m, x)  # the fallback: linearize traces the model
    np.testing.assert_allclose(y, h(x), rtol=1e-6)
    with pytest.raises(TypeError):  # and JAX refuses its linear function
        run(x)
    with pytest.raises(TypeError, match="forward-mode"):  # jvp of jit: JAX's, as it lowers
        jax.jvp(jax.jit(m), (x,), (x,))
    grads = jax.grad(lambda x: m(x).sum())(x), jax.grad(lambda x: h(x).sum())(x)
    np.testing.assert_allclose(*grads, rtol=1e-6)


def test_latency_mode_without_knowing_whether_jax_started_sets_the_same_mode(internals):
    jnp.ones(1)  # the backend has started in this process
    assert _compat.backend_started() is True
    internals("backend_started")
    assert _compat.backend_started() is None
    code = (
        "from symjax_mlp import _compat\n"
        "_compat.INTERNALS['backend_started'] = False\n"
        "import symjax_mlp as sm\n"
        "from symjax_mlp.chapter import chapter_mlp\n"
        "sm.serving.latency_mode()\n"
        "h, x = chapter_mlp()\n"
        "print(sm.serving.dispatch_mode(), float(abs(h(x) - h.eager(x)).max()) < 1e-5)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["sync", "True"]


def test_nnx_layers_named_or_not_the_model_computes_the_same(internals):
    x = jnp.arange(10.0).reshape(2, 5)
    h = sm.hybridize(NnxDropout(nnx.Rngs(0, dropout=1)))
    assert {"dense", "out"} <= set(h.graph(x).by_layer)
    want = h(x, deterministic=False), h(x)
    internals("layer_scopes")
    fallback = sm.hybridize(NnxDropout(nnx.Rngs(0, dropout=1)))
    assert "dense" not in fallback.graph(x).by_layer  # the ops, not grouped by layer
    np.testing.assert_array_equal(fallback(x, deterministic=False), want[0])
    np.testing.assert_array_equal(fallback(x), want[1])


def test_a_stateful_hybrids_dispatch_cache_kept_or_not_it_computes_the_same(internals):
    def run():  # train mode: each call draws dropout bits and moves the held state
        h = sm.hybridize(NnxDropout(nnx.Rngs(0, dropout=1)))
        outs = [h(x, deterministic=False) for x in (jnp.ones((2, 5)), jnp.ones((3, 5))) * 3]
        return outs, keyless(h.state)

    want = run()
    internals("dispatch_cache")
    chex.assert_trees_all_equal(run(), want)


def test_gil_check_and_its_fallback(internals):
    assert _compat.gil_enabled() == getattr(sys, "_is_gil_enabled", lambda: True)()
    internals("gil")
    assert _compat.gil_enabled() is False


def _served(n: int) -> tuple[list[np.ndarray], list[sm.serving.RequestFuture]]:
    """``n`` requests submitted at once to a Batcher: their results, and their futures."""
    h = sm.hybridize(lambda p, x: jnp.tanh(x * p), jnp.float32(0.5))
    xs = [np.full((1 + i % 3, 3), i, np.float32) for i in range(n)]
    seen = []
    with sm.serving.Batcher(h, example=xs[0], max_batch=8) as b:
        futures = [b.submit(x) for x in xs]
        for f in futures:
            f.add_done_callback(seen.append)
        done, _ = concurrent.futures.wait(futures, timeout=30)
        assert len(done) == n
        results = [f.result() for f in futures]
    assert len(seen) == n and all(f.timing is not None for f in futures)
    return results, futures


@pytest.mark.parametrize("internal", ["futures", "gil"])
def test_a_batcher_with_plain_futures_serves_the_same_results(internals, monkeypatch, internal):
    want, futures = _served(24)
    assert all(f._shared for f in futures)  # one lock for all, settled a batch at a time
    internals(internal)
    if internal == "gil":
        monkeypatch.setattr(_compat, "GIL", False)  # every read takes the lock
    got, futures = _served(24)
    assert all(f._shared == (internal == "gil") for f in futures)  # else plain Futures
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_constraint_the_manifest_drops_refused_at_load_or_by_the_program_at_the_call(
    tmp_path, internals
):
    import json

    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=jnp.ones((2, 3)), shapes=("b, 3",),
                    constraints=("b >= 2",)).path  # fmt: skip
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["signature"]["constraints"] = []
    (art / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(sm.ArtifactError, match=r"requires b >= 2, which manifest\.json's"):
        sm.load(art)  # the constraints read from the program's shape assertions
    internals("constraints")
    m = sm.load(art)  # the fallback: the program itself refuses a call that breaks it
    np.testing.assert_array_equal(m(np.ones((2, 3), np.float32)), np.full((2, 3), 2.0))
    with pytest.raises(sm.ArtifactError, match=r"model\.jaxexport: .*constraint b >= 2") as e:
        m(np.ones((1, 3), np.float32))
    assert ".py:" not in str(e.value)  # no source locations of this library


def test_a_transpose_rule_jax_has_is_kept_never_replaced(monkeypatch, internals):
    """custom_vjp_call is JAX's primitive: our transpose rule for it (a loaded model's VJP,
    which jaxopt's implicit differentiation transposes) goes where JAX has none, or over an
    earlier one of ours; a rule a later JAX registers is kept, where it was silently replaced
    (for every custom_vjp, ours refusing all but a loaded model's)."""
    from jax.extend.core import Primitive
    from jax.extend.core.primitives import custom_vjp_call_p
    from jax.interpreters import ad

    from symjax_mlp._runtimes.transforms import transposing

    def jaxs(cts, *args, **params):  # a later JAX's rule
        return [None] * len(args)

    table = ad.primitive_transposes
    monkeypatch.setitem(table, custom_vjp_call_p, jaxs)  # (the table restored after the test)
    transposing.cache_clear()
    try:
        transposing()  # as a loaded model's VJP registers it
        assert table[custom_vjp_call_p] is jaxs
        table[custom_vjp_call_p] = None  # JAX has none: ours
        transposing.cache_clear()
        transposing()
        mine = table[custom_vjp_call_p]
        assert mine.__module__ == "symjax_mlp._runtimes.transforms", mine
        transposing.cache_clear()
        transposing()  # an earlier one of ours: replaced
        assert table[custom_vjp_call_p] is not mine and table[custom_vjp_call_p].__module__ == (
            mine.__module__
        )
    finally:
        transposing.cache_clear()  # registered again at its next use, over the restored table
    fresh, taken = Primitive("fresh"), Primitive("taken")
    monkeypatch.setitem(table, fresh, None)
    monkeypatch.setitem(table, taken, jaxs)
    assert _compat.add_transpose(fresh, mine) and table[fresh] is mine
    assert not _compat.add_transpose(taken, mine) and table[taken] is jaxs
    internals("transposes")  # the fallback: none added, JAX's NotImplementedError
    monkeypatch.setitem(table, fresh, None)
    assert not _compat.add_transpose(fresh, mine) and table[fresh] is None


def test_forward_mode_after_a_grad_refused_by_the_model_or_by_jax_another_custom_vjp_as_jax(
    tanh_model, internals
):
    """custom_lin is JAX's: after a jax.grad, jax.linearize of jax.jit(m) reaches its rules,
    whose wraps raise the loaded model's ConfigError as the linear function runs, is batched or
    lowered; each wraps the rule JAX has (once), so another custom_vjp, and the fallback for
    the model too, get JAX's own TypeError."""
    from jax.extend.core.primitives import custom_lin_p
    from jax.interpreters import batching

    from symjax_mlp._runtimes.transforms import refusing_forward

    h, x, m = tanh_model
    jitted, want = jax.jit(m), jax.grad(lambda x: h(x).sum())(x)
    np.testing.assert_allclose(jax.grad(lambda x: jitted(x).sum())(x), want, rtol=1e-6)

    @jax.custom_vjp
    def other(x):
        return jnp.sin(x)

    other.defvjp(lambda x: (jnp.sin(x), x), lambda x, ct: (ct * jnp.cos(x),))
    rules = custom_lin_p.impl, batching.fancy_primitive_batchers[custom_lin_p]
    refusing_forward.cache_clear()
    refusing_forward()  # again: JAX's rules wrapped once, not twice
    assert (custom_lin_p.impl, batching.fancy_primitive_batchers[custom_lin_p]) == rules
    assert all(r.func is _compat._refuse and r.args[0].__module__.startswith("jax.") for r in rules)
    jaxs = (TypeError, "can't apply forward-mode autodiff")
    for off in (False, True):
        if off:
            internals("refusals")  # the fallback: JAX's TypeError for the model too
        mine = jaxs if off else (sm.ConfigError, "jax.linearize differentiate forward.*jacrev")
        for f, (error, said) in ((jitted, mine), (other, jaxs)):
            run = jax.linearize(f, x)[1]
            for call, t in ((run, x), (jax.vmap(run), jnp.stack([x, x])), (jax.jit(run), x)):
                with pytest.raises(error, match=said):  # run, batched, lowered
                    call(t)
        np.testing.assert_allclose(jax.grad(lambda x: jitted(x).sum())(x), want, rtol=1e-6)
