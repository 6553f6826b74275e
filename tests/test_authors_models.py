"""The Flax and Equinox authors' own models (tests/helpers.py, as their guides write them)
through training, a Hybrid, a Batcher and export: issue 33."""

import contextlib
import functools
import subprocess
import sys
import textwrap

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    BatchNormGuideMLP,
    DropoutGuideModel,
    Seq2seq,
    SowCNN,
    TutorialCNN,
    keyless,
    mixer,
    seq2seq_inputs,
    tagger,
)

import symjax_mlp as sm


def _data(classes, n=64, features=5, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features)).astype(np.float32)
    y = (rng.integers(0, classes, n)).astype(np.int32)
    return sm.training.Dataset(x[:48], y[:48], x[48:], y[48:], classes)


def _steps(model, x, n=3, **flags):
    """``n`` jitted training steps of the pieces; the params and metrics after each."""
    opt = optax.adam(1e-2)
    params = sm.training.init_params(model, jax.random.key(0), x, **flags)
    step = jax.jit(sm.training.train_step(model, opt, **flags))
    opt_state = opt.init(params.params if hasattr(params, "params") else params)
    y, w, runs = jnp.arange(len(x)) % 10, jnp.ones(len(x)), []
    for _ in range(n):
        params, opt_state, metrics = step(params, opt_state, x, y, w)
        runs.append((params, metrics))
    return runs


# -- the authors' models through a Hybrid: compiled == eager == plain Flax (each model of AUTHORS,
# both modes, outputs, state and grads: test_authors_matrix.py, over MATRIX = (*AUTHORS, ...)) --
def _close(a, b):
    chex.assert_trees_all_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_nnx_tutorial_cnn_compiled_equals_eager_equals_nnx():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 28, 28, 1)), jnp.float32)
    want_model, rngs = TutorialCNN(rngs=nnx.Rngs(0)), nnx.Rngs(5)
    want = [want_model(x + i, rngs=rngs) for i in range(3)]  # train mode, as built
    for compiled in (True, False):
        h, rngs = sm.hybridize(TutorialCNN(rngs=nnx.Rngs(0))).hybridize(compiled), nnx.Rngs(5)
        _close([h(x + i, rngs=rngs) for i in range(3)], want)
        _close(keyless(h.state), keyless(nnx.state(want_model, nnx.Not(nnx.Param))))
    trained = h.module  # rebuilt with the state the calls moved
    trained.eval(), want_model.eval()
    _close(sm.hybridize(trained)(x), want_model(x))


@pytest.mark.parametrize("compiled", [True, False])
def test_the_nnx_toy_vae_runs_through_a_hybrid_as_through_nnx_jit(compiled):
    """flax's 05_vae.py: its Encoder sets self.kl_loss in __call__, kept as nnx.jit keeps it."""
    from helpers import _binary, _vae

    h, (want_model, _) = sm.hybridize(_vae()[0]).hybridize(compiled), _vae()
    for i in range(2):  # the noise stream advances; kl_loss is set by every call
        _close(h(_binary(i)), nnx.jit(lambda m, x: m(x))(want_model, _binary(i)))
    _close(h.state["encoder"]["kl_loss"], want_model.encoder.kl_loss[...])


# -- item 2: a mode flag without a default ------------------------------------------------------
@pytest.mark.parametrize(
    ("model", "flag"),
    [(DropoutGuideModel(10), "training"), (BatchNormGuideMLP(), "train")],
    ids=["dropout_guide", "batch_norm_guide"],
)
@pytest.mark.parametrize("given", [False, True], ids=["found", "given"])
def test_a_flag_without_a_default_trains(model, flag, given):
    classes = 10 if isinstance(model, DropoutGuideModel) else 1
    flags = dict(train_flags={flag: True}, eval_flags={flag: False}) if given else {}
    one_class = pytest.warns(RuntimeWarning, match="a classifier of one class")  # nothing moves
    with one_class if classes == 1 else contextlib.nullcontext():
        run = sm.training.train(model, _data(classes), epochs=2, batch_size=16, **flags)
    assert np.isfinite(run.history[-1].loss) and run.eval_flags == {flag: False}
    # initialised as the author does, model.init(key, x, flag=False)
    x = jnp.ones((1, 5))
    params = sm.training.init_params(model, jax.random.key(3), x, train_flags={flag: True})
    params = getattr(params, "params", params)
    want = model.init({"params": jax.random.key(3)}, x, **{flag: False})["params"]
    assert jax.tree.all(jax.tree.map(np.array_equal, params, want))
    if classes == 1:  # BatchNorm's statistics moved
        assert not np.allclose(run.model_state["batch_stats"]["BatchNorm_0"]["mean"], 0)


def test_a_keyword_only_flag_trains():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8, 8, 1)), jnp.float32)
    model = mixer()  # *, train; its patches a namespace (not hashable, as a ConfigDict)
    runs = _steps(model, x, train_flags={"train": True})
    assert all(np.isfinite(m["loss"]) for _, m in runs)
    assert runs[-1][1]["loss"] < runs[0][1]["loss"]


def test_the_nnx_tutorial_cnn_trains_with_rngs_passed_to_its_call():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 28, 28, 1)), jnp.float32)
    for flags in ({}, {"train_flags": {"rngs": nnx.Rngs(1)}}):
        runs = _steps(TutorialCNN(rngs=nnx.Rngs(0)), x, **flags)
        keys = [p.state["__call_rngs__"] for p, _ in runs]
        assert all(np.isfinite(m["loss"]) for _, m in runs)
        assert not np.array_equal(keys[0], keys[1])  # a new nnx.Rngs every step
        assert not np.array_equal(runs[0][0].state["batch_norm1"]["mean"], 0)


def test_a_required_flag_training_cannot_name_is_refused_with_the_fix():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, is_training: bool):
            return nn.Dropout(0.5, deterministic=not is_training)(nn.Dense(3)(x))

    with pytest.raises(sm.ConfigError, match=r"train_flags=\{'is_training': True\}"):
        sm.training.train(Net(), _data(3), epochs=1)


# -- item 3: a Batcher serving a model whose call needs a flag ----------------------------------
@pytest.mark.parametrize(
    ("model", "flag"),
    [(BatchNormGuideMLP(), "train"), (DropoutGuideModel(4), "training")],
    ids=["batch_norm_guide", "dropout_guide"],
)
def test_a_batcher_serves_a_model_whose_call_needs_a_flag(model, flag):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), jnp.float32)
    variables = model.init(jax.random.key(0), x[:1], **{flag: False})
    h = sm.hybridize(model, variables)
    with pytest.raises(sm.ConfigError, match=r"kwargs=\{'train': False\}"):
        sm.serving.Batcher(h, example=x[:1])
    with sm.serving.Batcher(h, example=x[:1], max_batch=4, kwargs={flag: False}) as b:
        got = b(np.asarray(x))
    np.testing.assert_allclose(got, model.apply(variables, x, **{flag: False}), rtol=1e-6)
    np.testing.assert_allclose(got, h(x, **{flag: False}), rtol=1e-6)


# -- item 6: self.sow's intermediates -----------------------------------------------------------
def test_sown_intermediates_are_returned_as_apply_returns_them():
    model = SowCNN()
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 8, 1)), jnp.float32)
    variables = model.init(jax.random.key(0), x)  # as the guide: no "intermediates" yet
    h = sm.hybridize(model, variables, mutable=["intermediates"])
    for xi in (x, x + 1, x + 2):  # fresh every call, as model.apply's
        want = model.apply(variables, xi, mutable=["intermediates"])
        chex.assert_trees_all_close(h(xi), want, rtol=1e-5, atol=1e-6)
        chex.assert_trees_all_close(h.eager(xi), want, rtol=1e-5, atol=1e-6)
    assert h.trace_count == 1 and h.state == {}
    grads = jax.grad(lambda p: h.apply(p, x)[0].sum())(h.params)
    want = jax.grad(lambda p: model.apply({"params": p}, x).sum())(variables["params"])
    chex.assert_trees_all_close(grads["params"], want, rtol=1e-5, atol=1e-6)


# -- smaller bullets: a retrace's reason; a shape from a traced array ---------------------------
def test_a_retrace_is_explained_against_the_nearest_trace_not_the_latest():
    h = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    for x in (jnp.ones((2, 3)), jnp.ones((2, 3), jnp.int32), jnp.ones((5, 3))):
        h(x)
    assert h.trace_log[2].reason == "args[0].shape changed from (2, 3) to (5, 3)"


@pytest.mark.parametrize(
    "fn", [lambda p, x, n: x[:n] * p, lambda p, x, n: jnp.zeros(n) + p], ids=["slice", "zeros"]
)
def test_a_shape_taken_from_an_array_argument_names_static_argnames(fn, tmp_path):
    h, x, n = sm.hybridize(fn, jnp.float32(1)), jnp.ones(4), jnp.int32(2)
    calls = (lambda: h(x, n), lambda: h.graph(x, n), lambda: h.apply(h.params, x, n),
             lambda: sm.export(h, tmp_path / "m", example=(x, n), batch=None))  # fmt: skip
    for call in calls:
        with pytest.raises(sm.ControlFlowError, match=r"static_argnames=\('n',\)"):
            call()
    assert sm.hybridize(fn, jnp.float32(1), static_argnames="n")(x, 2).shape == (2,)


# -- items 9-10: equinox ------------------------------------------------------------------------
def _eqx():
    return pytest.importorskip("equinox")


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_an_equinox_module_is_a_model_its_arrays_the_params(which, tmp_path):
    eqx = _eqx()
    from helpers import EqxCNN

    if which == "mlp":
        model, shape = eqx.nn.MLP(5, 3, width_size=8, depth=2, key=jax.random.key(0)), (5,)
    else:
        model, shape = EqxCNN(jax.random.key(0)), (1, 28, 28)
    x = jax.random.normal(jax.random.key(1), shape)
    h = sm.hybridize(model)
    assert jax.tree.leaves(h.params) and h.name == type(model).__name__
    for i in range(3):
        _close(h(x + i), model(x + i))
        _close(h.eager(x + i), model(x + i))
    grads = jax.grad(lambda p: h.apply(p, x).sum())(h.params)
    want = eqx.filter_grad(lambda m: m(x).sum())(model)
    assert jax.tree.leaves(grads)
    _close(jax.tree.leaves(grads), jax.tree.leaves(eqx.filter(want, eqx.is_array)))
    sm.export(h, tmp_path / "m", example=x, batch=None)
    loaded = sm.load(tmp_path / "m", trust=True)  # the CNN: convolution, reduce_window
    _close(np.asarray(loaded(np.asarray(x))), model(x))
    assert len(loaded.params) == len(jax.tree.leaves(h.params))


def test_equinox_dropout_takes_its_key_per_call_and_inference_stays_static():
    eqx = _eqx()
    from helpers import EqxDropout

    model, x = EqxDropout(jax.random.key(0)), jnp.ones(5)
    h = sm.hybridize(model)
    for i in range(2):
        k = jax.random.key(i)
        _close(h(x, key=k), model(x, key=k))
    frozen = eqx.nn.inference_mode(model)
    _close(sm.hybridize(frozen)(x), frozen(x))


def test_an_equinox_module_among_the_inputs_is_refused_naming_eqx_partition():
    eqx = _eqx()
    mlp = eqx.nn.MLP(5, 3, width_size=8, depth=1, key=jax.random.key(0))
    h = sm.hybridize(lambda p, m, x: m(x) * p, jnp.float32(1))
    with pytest.raises(sm.ConfigError, match=r"eqx\.partition\(model, eqx\.is_array\)"):
        h(mlp, jnp.ones(5))
    with pytest.raises(sm.ConfigError, match="takes no params"):
        sm.hybridize(mlp, {})


def test_an_equinox_model_reducing_over_an_unbound_axis_is_told_code_that_runs():
    """The refusal's code named fn and params, which an equinox module given alone has not."""
    eqx = _eqx()

    class Centre(eqx.Module):
        w: jax.Array

        def __call__(self, x):
            return (x - jax.lax.pmean(x.mean(0), "batch")) * self.w

    model, x = Centre(jnp.arange(3.0)), jnp.arange(6.0).reshape(2, 3)
    for h in (sm.hybridize(model), sm.hybridize(lambda m, x: m(x), model)):
        with pytest.raises(sm.ConfigError, match="reduces over the axis name") as e:
            h(x)
        code = str(e.value).split("binding it:\n")[1].split("\nor call it")[0]
        scope = {"sm": sm, "jax": jax, "model": model, "fn": lambda m, x: m(x)}
        exec(textwrap.dedent(code), scope)
        _close(scope["h"](x), (x - x.mean(0)) * model.w)


def test_the_library_never_imports_equinox_itself():
    code = "import sys, symjax_mlp; assert 'equinox' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# -- issue 33, remaining: export's batch, a shared input, eqx.filter_jit, jax.debug.print ------
def test_a_per_example_equinox_model_under_the_default_batch_is_refused_with_the_fixes(tmp_path):
    eqx = _eqx()
    mlp = eqx.nn.MLP(5, 3, width_size=8, depth=2, key=jax.random.key(0))
    for x in (jnp.ones(5), jnp.ones((4, 5))):  # one example, or a batch it cannot take
        with pytest.raises(sm.SignatureError, match=r"float32\[b.*eqx\.filter_vmap\(model\)"):
            sm.export(sm.hybridize(mlp), tmp_path / "m", example=x)
    sm.export(sm.hybridize(eqx.filter_vmap(mlp)), tmp_path / "m", example=jnp.ones((4, 5)))
    loaded, xs = sm.load(tmp_path / "m", trust=True), jnp.ones((7, 5))
    _close(np.asarray(loaded(np.asarray(xs))), jax.vmap(mlp)(xs))


@pytest.mark.parametrize("shared", [(3,), (3, 3)], ids=["weights", "mask"])
def test_an_input_without_the_batch_is_taken_as_shared_by_every_row(shared, tmp_path):
    def fn(p, x, w):
        return (x * w if w.ndim == 1 else x @ w) + p

    w = jnp.asarray(np.random.default_rng(0).standard_normal(shared), jnp.float32)
    sm.export(sm.hybridize(fn, jnp.float32(1)), tmp_path / "m", example=(jnp.ones((4, 3)), w))
    loaded = sm.load(tmp_path / "m", trust=True)
    assert [s.shape for s in loaded.signature.inputs] == [("b", 3), shared]
    for n in (1, 7):
        x = jnp.ones((n, 3))
        _close(np.asarray(loaded(np.asarray(x), np.asarray(w))), fn(1.0, x, w))
    with pytest.raises(sm.ConfigError, match=r"args\[1\] is float32\[3.*without the batch 'b'"):
        sm.serving.Batcher(loaded)


def test_a_batcher_refuses_an_artifact_with_a_shared_input_naming_it(tmp_path):
    h = sm.hybridize(lambda p, x, m: x @ m + p, jnp.float32(1))
    x, mask = jnp.ones((4, 5)), jnp.eye(5)
    sm.export(h, tmp_path / "m", example=(x, mask), shapes=("b, 5", None))
    with pytest.raises(sm.ConfigError, match=r"args\[1\] is float32\[5, 5\], without") as e:
        sm.serving.Batcher(sm.load(tmp_path / "m", trust=True))
    assert "static batch" not in str(e.value)


def test_stage_of_an_eqx_filter_jit_module_stages_the_module():
    eqx = _eqx()
    mlp = eqx.nn.MLP(5, 3, width_size=8, depth=1, key=jax.random.key(0))
    staged, want = (sm.stage(m)(jnp.ones(5)) for m in (eqx.filter_jit(mlp), mlp))
    assert staged.name == "MLP" and staged.by_layer == want.by_layer
    assert staged.primitive_counts["dot_general"] == 2


@pytest.mark.parametrize("batch", ["b", None])
def test_a_function_with_jax_debug_print_is_refused_at_export(batch, tmp_path):
    def fn(p, x):
        jax.debug.print("x = {}", x)
        return x * p

    with pytest.raises(sm.ConfigError, match=r"calls back into Python \(debug_print\)"):
        sm.export(sm.hybridize(fn, jnp.float32(1)), tmp_path / "m", example=jnp.ones((2, 3)),
                  batch=batch)  # fmt: skip


@pytest.mark.parametrize("which", ["mlp", "cnn"])
def test_equinox_layers_of_one_class_are_told_apart_in_by_layer(which):
    eqx = _eqx()
    from helpers import EqxCNN

    key = jax.random.key(0)
    if which == "mlp":  # equinox's scopes name the class: all three Linear layers share one
        model, x, at = eqx.nn.MLP(5, 3, width_size=8, depth=2, key=key), jnp.ones(5), "eqx.nn.MLP/"
    else:
        model, x, at = EqxCNN(key), jnp.ones((1, 28, 28)), ""
    layers = sm.hybridize(model).graph(x).by_layer
    for i in range(3):
        assert layers[f"{at}eqx.nn.Linear[{i}]"]["dot_general"] == 1
    assert f"{at}eqx.nn.Linear" not in layers


def test_a_linen_dropout_exported_in_training_is_refused_and_the_named_fix_draws_per_call(
    tmp_path,
):
    """flax's dropout guide in training mode: an artifact could only bake the Hybrid's key in
    (the same mask on every call); refused, naming the key as an input, which then draws a
    mask per key as the source does."""
    model = DropoutGuideModel(8)
    x = np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5)
    variables = model.init(jax.random.key(0), x, training=False)
    h = sm.hybridize(model, variables, rngs={"dropout": jax.random.key(1)})
    with pytest.raises(sm.ConfigError, match=r"every call would drop the same units") as e:
        sm.export(h, tmp_path / "fixed", example=x, kwargs={"training": True})
    assert "jax.random.wrap_key_data(key)" in str(e.value)
    assert not (tmp_path / "fixed").exists()
    sm.export(h, tmp_path / "eval", example=x, kwargs={"training": False})  # no draw: exports

    def fix(params, x, key):
        rngs = {"dropout": jax.random.wrap_key_data(key)}
        return model.apply(params, x, training=True, rngs=rngs)

    k1, k2 = (jax.random.key_data(jax.random.key(i)) for i in (1, 2))
    shapes = (f"b, {x.shape[1]}", None)
    art = sm.export(sm.hybridize(fix, variables), tmp_path / "key", example=(x, k1),
                    shapes=shapes).path  # fmt: skip
    m = sm.load(art)
    for k in (k1, k2):
        np.testing.assert_allclose(m(x, k), fix(variables, x, k), rtol=1e-6)
    assert not np.allclose(m(x, k1), m(x, k2))  # a mask per key, not one baked in


@pytest.mark.slow  # (the README suite: within 10 minutes on 2 cores)
def test_seq2seq_draws_its_lstm_stream_per_call_and_exports_with_the_key_an_input(tmp_path):
    """flax examples/seq2seq: nn.RNN cells sampling from an "lstm" stream on every call (no
    mode turns it off). A Hybrid given that stream splits it per call as the example's loop
    does, with grads; the export takes the key as an input (references jitted: faster)."""
    model = Seq2seq(teacher_force=True, hidden_size=8, vocab_size=5)
    init, apply = jax.jit(model.init), jax.jit(model.apply)
    variables = init({"params": jax.random.key(0), "lstm": jax.random.key(1)}, *seq2seq_inputs(0))
    key, want = jax.random.key(3), []
    for i in range(2):  # the example's train loop: a fresh lstm key per step
        key, sub = jax.random.split(key)
        want.append(apply(variables, *seq2seq_inputs(i), rngs={"lstm": sub}))
    h = sm.hybridize(model, variables, rngs={"lstm": jax.random.key(3)})
    _close([h(*seq2seq_inputs(i)) for i in range(2)], want)
    grads = jax.grad(lambda p: h.apply(p, *seq2seq_inputs(0))[0][0].sum())(h.params)
    assert set(grads["params"]) == set(variables["params"])

    decode = Seq2seq(teacher_force=False, hidden_size=8, vocab_size=5)  # samples fed back

    def fix(params, queries, answers, key):
        rngs = {"lstm": jax.random.wrap_key_data(key)}
        return decode.apply(params, queries, answers, rngs=rngs)

    queries, answers = seq2seq_inputs(1)
    k = jax.random.key_data(jax.random.key(4))
    art = sm.export(sm.hybridize(fix, variables), tmp_path / "m", example=(queries, answers, k),
                    shapes=("b, 4, 5", "b, 3, 5", None))  # fmt: skip
    allow = {"gather", "dynamic_gather", "dynamic_slice", "real_dynamic_slice",
             "dynamic_update_slice"}  # fmt: skip
    m = sm.load(art.path, allow=allow)
    want = jax.jit(fix)(variables, queries, answers, k)
    _close(m(*(np.asarray(a) for a in (queries, answers, k))), want)


@pytest.mark.parametrize("kind", ["linen", "nnx", "fn"])
def test_a_reduction_over_a_pmap_axis_is_refused_naming_a_binding_that_runs(kind):
    """flax imagenet's ResNet: BatchNorm(axis_name='batch'), which train.py's pmap binds."""
    from helpers import RESNET, _x, resnet_variables

    x, bn = _x(1, (2, 8, 8, 3)), nnx.BatchNorm(3, axis_name="batch", rngs=nnx.Rngs(0))
    given = {"linen": {"model": RESNET, "variables": resnet_variables()}, "nnx": {"module": bn},
             "fn": {"fn": lambda p, x: x - jax.lax.pmean(x.mean(0), "batch") * p,
                    "params": jnp.float32(2)}}[kind]  # fmt: skip
    h = sm.hybridize(*given.values())
    for call in (h, h.eager, lambda x: h.apply(h.params, x)):
        with pytest.raises(sm.ConfigError, match=r"(?s)axis name 'batch'.*axis_size=1") as e:
            call(x)
    names = {"functools": functools, "jax": jax, "nnx": nnx, "sm": sm, **given}
    exec(textwrap.dedent(str(e.value).split("binding it:\n")[1].split("\nor call")[0]), names)
    if kind == "linen":  # train.py's call, on one device
        apply = functools.partial(RESNET.apply, mutable=["batch_stats"])
        want = jax.pmap(apply, axis_name="batch", in_axes=(None, 0))(given["variables"], x[None])
        want = jax.tree.map(lambda a: a[0], want)
    else:  # over the whole batch, as without the axis name
        want = nnx.BatchNorm(3, rngs=nnx.Rngs(0))(x) if kind == "nnx" else x - x.mean(0) * 2
    _close(names["h"](x), want)


@pytest.mark.filterwarnings("ignore:SelfAttention will be deprecated")  # (the example's layer)
def test_a_tagger_taking_its_tokens_keyword_only_runs_and_a_positional_call_names_its_keywords():
    """flax's nlp_seq Transformer, ``__call__(self, *, inputs, train)``, called as train.py
    applies it; ``h(x, train=False)`` was told to call ``h(x)``, the very call it refused."""
    model, variables, x = tagger()
    h = sm.hybridize(model, variables, rngs=jax.random.key(3))
    want = model.apply(variables, inputs=x, train=False)
    chex.assert_trees_all_close(h(inputs=x, train=False), want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(h(inputs=x, train=True), want)  # dropout drawn from its stream
    with pytest.raises(sm.SignatureError, match=r"\(\*, inputs, train\): too many positional "
                       r"arguments\. .* without its params or self: h\(inputs=inputs, "
                       r"train=train\)\."):  # fmt: skip
        h(x, train=False)
