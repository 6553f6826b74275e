"""Round twelve of a stranger's attacks (session 60): whole, self-consistent inputs against what
session 59 added (transfer guards, '/' in param keys, hijax types, checkpoint headers), hostile
but well-formed StableHLO, HTTP clients and models that raise anything. Each way in that got
through has a test failing without its fix; each surface that held keeps one test showing it.
The rounds before: test_stranger11.py, test_stranger10.py, test_stranger9.py, test_security.py,
test_checker_limits.py, test_http_hostile.py, test_raises_anything.py, ..."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import symjax_mlp as sm

X = np.ones((2, 3), np.float32)


def _linear(p, x):
    return x @ p["net/~/linear"]["w"] + p["net/~/linear"]["b"]


def _haiku(**more):
    """Params as Haiku names them (a key holding '/'), and ``more`` keys beside them."""
    w, b = np.arange(6, dtype=np.float32).reshape(3, 2), np.ones(2, np.float32)
    return {"net/~/linear": {"w": w, "b": b}, **more}


@pytest.mark.slow  # three exports (~1 s)
@pytest.mark.parametrize("key", ["x/", "a//b", "/x"])
def test_a_param_key_whose_path_holds_an_empty_part_is_refused_at_export(key, tmp_path):
    """Export took a key holding '/' (Haiku's) since session 59, and with it 'x/' or 'a//b':
    it wrote the artifact, whose own ``m.params`` ``load(params=...)`` then refused ("has an
    empty key"), so its weights could never be given back. Refused at export, as the empty
    key always was; Haiku's own names still export and reload."""
    h = sm.hybridize(_linear, _haiku(**{key: np.zeros(1, np.float32)}))
    with pytest.raises(sm.ArtifactError, match=rf"param path '{key}' has an empty key"):
        sm.export(h, tmp_path / "empty", example=X)
    assert not (tmp_path / "empty").exists()
    art = sm.export(sm.hybridize(_linear, _haiku()), tmp_path / "haiku", example=X).path
    m = sm.load(art)
    np.testing.assert_allclose(sm.load(art, params=m.params)(X), _linear(_haiku(), X))


@pytest.mark.slow  # verify runs a fresh process (~3 s)
def test_verify_runs_its_own_inputs_under_a_global_transfer_guard(tmp_path, monkeypatch):
    """transfer-guard.rst's global ``jax_transfer_guard="disallow"`` (and JAX_TRANSFER_GUARD in
    the environment, which verify's fresh process inherits): verify drew its own NumPy inputs
    and gave them to the reference and the loaded model, so it raised JAX's "Disallowed
    host-to-device transfer" (or reported the fresh process failing) for a sound artifact.
    Its inputs and outputs are verify's own to move, as load's self-test vectors are."""
    net = sm.mlp((4, 2))
    x = jnp.ones((2, 3), jnp.float32)
    h = sm.hybridize(net, net.init(jax.random.key(0), x))
    art = sm.export(h, tmp_path / "m", example=x, batch="b").path
    monkeypatch.setenv("JAX_TRANSFER_GUARD", "disallow")
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        reports = [sm.verify(art, reference, batches=(1, 7)) for reference in (None, h)]
    finally:
        jax.config.update("jax_transfer_guard", None)
    assert all(r.ok for r in reports), [str(r) for r in reports]
    assert [len(r.checks) for r in reports] == [2, 2]


@pytest.fixture(scope="module")
def loaded_mlp(tmp_path_factory):
    """``sm.mlp((4, 2))`` on rows of 3, exported at a symbolic batch: its path, its answer to X."""
    net = sm.mlp((4, 2))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.ones((2, 3), jnp.float32)))
    art = sm.export(h, tmp_path_factory.mktemp("mlp") / "m", example=X, batch="b").path
    return art, np.asarray(h(X))


@pytest.fixture
def disallowed():
    """transfer-guard.rst's global ``jax.config.update("jax_transfer_guard", "disallow")``."""
    jax.config.update("jax_transfer_guard", "disallow")
    try:
        yield
    finally:
        jax.config.update("jax_transfer_guard", None)


def test_run_moves_its_files_arrays_itself_under_a_transfer_guard(loaded_mlp, disallowed, tmp_path):
    """``symjax-mlp run`` with JAX_TRANSFER_GUARD=disallow (or a global guard in-process): the
    arrays it reads from .npy files are its own to move, yet it printed JAX's traceback
    ("Disallowed host-to-device transfer") and "this is a bug in symjax_mlp"."""
    from symjax_mlp.cli import main

    art, want = loaded_mlp
    np.save(tmp_path / "x.npy", X)
    x, y = str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    assert main(["run", str(art), "--input", x, "--output", y]) == 0
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), want, rtol=1e-6)


def test_a_batcher_runs_a_lone_call_and_one_on_an_event_loop_under_a_transfer_guard(
    loaded_mlp, disallowed
):
    """A Batcher served its thread's batches under a global "disallow" (session 59), not the
    ones that run elsewhere: ``b(x)`` in the caller's thread, and a quick batch on the event
    loop that awaits it, which is every request of ``symjax-mlp serve`` under
    JAX_TRANSFER_GUARD=disallow: each raised, or was answered 500, with JAX's "Disallowed
    host-to-device transfer". The rows are the batcher's own to move, as its thread's are."""
    import asyncio

    art, want = loaded_mlp
    want = want[:1]
    with sm.serving.Batcher(sm.load(art), max_batch=4) as b:
        np.testing.assert_allclose(b(X[:1]), want, rtol=1e-6)

        async def awaited():
            return [await b.asubmit(X[:1]) for _ in range(3)]  # the lone ones run on the loop

        for got in asyncio.run(awaited()):
            np.testing.assert_allclose(got, want, rtol=1e-6)
        assert b.stats.requests == 4, b.stats
