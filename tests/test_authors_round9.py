"""Code we did not write, round nine: JAX's own docs and tests where no round looked, as their
authors wrote them (tests/zoo9.py; sources and commit there), over every feature: hybridize,
``h(x)`` equal to the plain model, its graph, export (a symbolic batch where the model allows
one) + load + call equal, grads/Hessians over the loaded model (``vjp_order=2``), a Batcher's
answers, the original's own training steps; or export's refusal, naming what works.

- external-callbacks.md: ``pure_callback``, ``io_callback``, ``jax.debug.callback`` and
  ``jax.debug.print`` in a net: the Hybrid runs them (the debug callback under ``grad`` too),
  export refuses each naming it; ``jv`` (a ``pure_callback`` given a ``custom_jvp``): grads and
  the docs' ``jax.hessian`` over the Hybrid equal the plain function's.
- array_refs.md: refs made inside a net (its ``g``, ``pure1``: JAX serializes no VJP of order
  2 of it; refused naming order 1) over every feature; a net closing over a ref is a
  ConfigError naming it (jax.export's raw "Too many leaves").
- checkify_guide.md: ``checkify.checkify(f)`` (its ``(*args, **kwargs)``) hybridized, its
  error value as jit's; export refused for its Error output (it was refused as given "too
  many positional arguments": the ``*args`` taking the params was dropped with them), a
  ``*args`` wrapper of it exported; the unchecked ``f`` refused by JAX as under jit.
- gradient-checkpointing.md: ``f``, ``f2``, ``f3`` and ``f4`` (a policy's saved residuals are
  rounded by ``reduce_precision`` in the VJP: loaded without ``allow`` now).
- ode_test.py: the pendulum's ``odeint`` (a ``while_loop`` and a ``custom_vjp``) per row of
  ``y0``, its ``m``/``g`` the params: every feature, the loader naming what it must allow.
- ode_test.py's ``test_grad_closure`` (``with_vmap`` too): ``odeint`` of a closure over the
  param, its grads over ``h.apply`` (vmapped) equal the plain ones.
- pallas/quickstart.md: ``matmul`` with a fused activation (``interpret=True``): exported with
  no VJP; ``vjp_order=1`` is refused naming ``vjp_order=0`` (JAX's raw ``ValueError`` before).
- new_docs/201/sharding.md: its ``f`` (``with_sharding_constraint``) under its Auto mesh,
  exported there, loaded and called on or off the mesh; under its Explicit mesh an export of
  ``vjp_order=1`` works as outside it (the one-device program is staged off the mesh: JAX
  built no VJP of it staged there, its raw ValueError said to enter a mesh, already entered).
- the-training-cookbook.py: its transformer (``dot_dict`` params, bfloat16, FSDP over its
  Explicit mesh, ``out_sharding=``): the Hybrid, its export (the loader naming ``gather``) and
  its own ``train_step`` (Adam on ``jax.ref`` s) against the same step over ``h.apply``.
- custom_pytrees.md: the registered containers in and out of the Hybrid; export refuses one
  as an input, naming the arrays it takes.
- Equinox's all-of-equinox.md: both networks per example and ``jax.vmap`` ped, the filter_jit
  function handed to us, the guide's gradient-descent step over ``h.apply`` equal to its own.
- Flax's examples/linen_design_test: mlp_lazy's ``MLP`` over every feature; the linear
  regression's loop over ``h.apply`` equal to its own.
- Flax's docs_nnx/guides/checkpointing.md: ``TwoLayerMLP`` saved and restored with Orbax as
  the guide does; the restored model over every feature; the abstract model (``nnx.eval_shape``)
  stages its graph, and a call or export of it is refused naming the param and the restore
  (jit's raw TypeError before); the modified model given the old pure dict names the biases.
"""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
import zoo9
from features import close as _close
from features import every_feature
from flax import nnx

import symjax_mlp as sm


def _w(shape=(4, 3), seed=0):
    return jax.random.normal(jax.random.key(seed), shape) * 0.5


CALLBACKS = {  # net -> the primitive export names
    "pure_callback": zoo9.net_pure,
    "io_callback": zoo9.net_io,
    "debug_callback": zoo9.net_debug,
    "debug_print": zoo9.net_print,
}


@pytest.mark.slow
@pytest.mark.parametrize("prim", CALLBACKS)
def test_external_callbacks_run_in_the_hybrid_and_export_refuses_them_by_name(
    prim, tmp_path, capsys
):
    """Each flavour of callback after a layer: the Hybrid runs it (io_callback's global
    generator drawn as the plain net draws it; the debug ones print), its graph counts it, and
    export refuses the model naming the callback and what to do (no Python in an artifact)."""
    net, p = CALLBACKS[prim], _w()
    x = jax.random.normal(jax.random.key(1), (5, 4))
    h = sm.hybridize(net, p)
    zoo9.global_rng = np.random.default_rng(0)
    got = h(x)
    zoo9.global_rng = np.random.default_rng(0)
    _close(got, net(p, x))
    assert h.graph(x).primitive_counts[prim] == 1
    if prim.startswith("debug"):
        said = "log:" if prim == "debug_callback" else "intermediate value"
        assert said in capsys.readouterr().out
    with pytest.raises(sm.ConfigError, match=rf"calls back into Python \({prim}\).*jnp/lax"):
        sm.export(h, tmp_path / "m", example=(x,), batch="b")
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_debug_callback_under_grad_trains_as_the_plain_net():
    """The docs: ``debug.callback`` is compatible with ``grad``. Three SGD steps over
    ``h.apply`` of the logging net equal the plain net's, and the callback logs each time."""
    p, x = _w(), jax.random.normal(jax.random.key(1), (5, 4))
    h, tx = sm.hybridize(zoo9.net_debug, p), optax.sgd(0.1)

    def steps(apply, p):
        state = tx.init(p)
        for _ in range(3):
            g = jax.grad(lambda p: (apply(p, x) ** 2).mean())(p)
            updates, state = tx.update(g, state)
            p = optax.apply_updates(p, updates)
        return p

    _close(steps(h.apply, p), steps(zoo9.net_debug, p))


@pytest.mark.slow
def test_jv_pure_callback_with_custom_jvp_differentiates_in_the_hybrid(tmp_path):
    """``j1`` (scipy's Bessel function via ``pure_callback``, its ``custom_jvp``) after a layer:
    the Hybrid, grads of its params via ``h.apply`` and the docs' ``jax.hessian`` over the
    Hybrid equal the plain net's; export refuses it naming ``pure_callback``."""
    p, x = _w(), jax.random.normal(jax.random.key(1), (2, 4))
    h = sm.hybridize(zoo9.net_j1, p)
    _close(h(x), zoo9.net_j1(p, x))
    loss = lambda apply: lambda p: apply(p, x).sum()  # noqa: E731
    _close(jax.grad(loss(h.apply))(p), jax.grad(loss(zoo9.net_j1))(p))
    hess = lambda fn: jax.hessian(lambda r: fn(r).sum())(x)  # noqa: E731
    _close(hess(h), hess(lambda r: zoo9.net_j1(p, r)), rtol=1e-4, atol=1e-5)
    with pytest.raises(sm.ConfigError, match=r"\(pure_callback\)"):
        sm.export(h, tmp_path / "m", example=(x,))


CHECKPOINTED = {"f": zoo9.f_plain, "f2": zoo9.f2, "f3": zoo9.f3, "f4": zoo9.f4}


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_gradient_checkpointing_exports_loads_and_differentiates(name, tmp_path):
    """The guide's ``f`` of ``W1, W2, W3`` and ``x`` (a vector: a static batch), each way it
    checkpoints: every feature, grads and Hessians over the loaded model equal the plain
    function's. ``f3``/``f4``'s policies save residuals through ``reduce_precision`` (to the
    same precision) in their VJP: loaded as is (refused, ``allow={'reduce_precision'}``, before);
    ``jax.vmap`` of it over a batch of ``x``, every feature, batch symbolic; three SGD steps
    of the W's over its ``h.apply`` equal the plain ones."""
    fn, (Ws, x) = CHECKPOINTED[name], zoo9.checkpoint_weights()
    model = lambda Ws, x: fn(*Ws, x)  # noqa: E731
    h = sm.hybridize(model, Ws)
    counts = h.graph(x).primitive_counts
    assert counts.get("remat2", 0) == {"f": 0, "f2": 3}.get(name, 1)
    _close(h(x), model(Ws, x))
    sm.export(h, tmp_path / "one", example=(x,), batch=None, vjp_order=2)
    one = sm.load(tmp_path / "one")
    _close(one(np.asarray(x)), model(Ws, x))
    hess = lambda f: jax.jacrev(jax.jacrev(lambda r: f(r).sum()))(x)  # noqa: E731
    _close(hess(one), hess(lambda r: model(Ws, r)))
    rows = jax.vmap(model, (None, 0))  # a batch of x: every feature, batch symbolic
    hb, xb = sm.hybridize(rows, Ws), jax.random.normal(jax.random.key(2), (5, 4)) * 0.3
    every_feature(tmp_path, hb, lambda r: rows(Ws, r), xb)

    def steps(apply, Ws):
        for _ in range(3):
            g = jax.grad(lambda Ws: (apply(Ws, xb) ** 2).sum())(Ws)
            Ws = jax.tree.map(lambda w, d: w - 0.05 * d, Ws, g)
        return Ws

    _close(steps(hb.apply, Ws), steps(rows, Ws))


@pytest.mark.slow
def test_ode_pendulum_per_row_exports_loads_and_differentiates(tmp_path):
    """ode_test's pendulum: ``odeint`` of ``y0`` (a row: theta, omega) over ``ts``, its ``m``
    and ``g`` the params. Every feature, batch symbolic: its artifact (a ``while_loop``, its
    ``custom_vjp``'s adjoint ODE, gathers) is refused by default naming each op to allow; with
    those the loaded model, its grads and per-row Hessians equal the plain ``odeint``'s."""
    p = {"m": jnp.float32(zoo9.PEND_ARGS[0]), "g": jnp.float32(zoo9.PEND_ARGS[1])}

    def model(p, y0):
        one = lambda r: jnp.stack(zoo9.integrate([r[0], r[1]], zoo9.PEND_TS, p["m"], p["g"]), -1)  # noqa: E731
        return jax.vmap(one)(y0)

    x = jnp.array([zoo9.PEND_Y0, [0.5, 0.1], [1.0, -0.2], [0.2, 0.0]], jnp.float32)
    h = sm.hybridize(model, p)
    sm.export(h, tmp_path / "refused", example=(x,), batch="b")
    refused = r"(?s)while loop whose trip count.*pass allow=\{'dynamic_slice', 'dynamic_upd"
    with pytest.raises(sm.ArtifactError, match=refused):
        sm.load(tmp_path / "refused")
    allow = {"while", "dynamic_slice", "dynamic_update_slice", "real_dynamic_slice", "scatter"}
    allow |= {"dynamic_gather", "compute"}  # its VJPs' (order 2: the adjoint's own adjoint)
    every_feature(tmp_path, h, lambda r: model(p, r), x, allow=allow, rtol=1e-4, atol=1e-4)
    m = sm.load(tmp_path / "m", allow=allow)  # its params' grads: the docs' check_grads, rev
    loss = lambda fn: lambda p: fn(p, x).sum()  # noqa: E731
    _close(jax.grad(loss(h.apply))(p), jax.grad(loss(model))(p), rtol=1e-4, atol=1e-4)
    assert m.signature.inputs[0].shape[0] == "b"


GRID = {"dynamic_slice", "dynamic_update_slice", "while"}


@pytest.mark.slow
def test_pallas_matmul_exports_without_a_vjp_and_vjp_order_one_is_refused(tmp_path):
    """The quickstart's ``matmul`` (grid (2, 2), relu fused; ``interpret=True``) of the input
    and a weight: the Hybrid and its graph equal/count it, its artifact of ``vjp_order=0``
    loads and answers; ``vjp_order=1`` is a ConfigError naming what JAX said and
    ``vjp_order=0`` (it was JAX's raw ``ValueError``, "Linearization failed ...")."""
    w, x = _w((8, 8)), jax.random.normal(jax.random.key(1), (4, 8))
    net = lambda w, x: zoo9.matmul(x, w, activation=jax.nn.relu)  # noqa: E731
    h = sm.hybridize(net, w)
    _close(h(x), net(w, x))
    assert h.graph(x).primitive_counts["pallas_call"] == 1
    with pytest.raises(sm.ConfigError, match=r"vjp_order=1\): JAX could not build the model's "
                       r"VJP.*Linearization failed.*vjp_order=0") as e:  # fmt: skip
        sm.export(h, tmp_path / "m", example=(x,), batch=None, vjp_order=1)
    assert e.value.__cause__ is None and not (tmp_path / "m").exists()
    sm.export(h, tmp_path / "m", example=(x,), batch=None)
    with pytest.raises(sm.ArtifactError, match=r"allow=\{'dynamic_slice', 'dynamic_update_slic"):
        sm.load(tmp_path / "m")  # interpret mode: the grid a while loop of dynamic slices
    _close(sm.load(tmp_path / "m", allow=GRID)(np.asarray(x)), net(w, x))


@pytest.mark.slow
def test_pallas_add_vectors_as_written(tmp_path):
    """The quickstart's first kernel, ``add_vectors`` (jitted, ``interpret=True``) of the
    input and a bias: every feature but the VJP's (refused as ``matmul``'s is), batch
    symbolic (the kernel's one block is the whole array, any size)."""
    b, x = jnp.arange(8.0), jnp.arange(8.0)
    h = sm.hybridize(lambda b, x: zoo9.add_vectors(x, b), b)
    _close(h(x), zoo9.add_vectors(x, b))
    sm.export(h, tmp_path / "m", example=(x,), batch=None)
    m = sm.load(tmp_path / "m", allow=GRID)
    _close(m(np.asarray(x)), x + b)
    with sm.serving.Batcher(m) as batcher:
        _close(batcher.submit(np.asarray(x)).result(30), x + b)


@pytest.mark.slow
def test_custom_pytree_containers_in_and_out_of_the_hybrid(tmp_path):
    """custom_pytrees.md's containers: ``MyDataclassContainer`` (``name`` a meta field) into
    the Hybrid of the docs' jitted ``f`` after a layer, a ``RegisteredSpecial`` out of it,
    equal to the plain net. ``MyOtherContainer`` (a NamedTuple: its ``name`` a leaf) is
    refused, as jit refuses it in the docs, naming the str and the docs' way (``meta_fields``)
    (it said the str was no "None, bool, int, float, complex, str" setting before); export
    refuses a container as an input, naming the arrays it takes and the flatten/unflatten
    recipe dict inputs get (it said "pass an array"), which exports."""
    p = _w((3, 3))
    net = lambda p, c: zoo9.RegisteredSpecial(zoo9.f_container(c) @ p, c.c)  # noqa: E731
    h, ones = sm.hybridize(net, p), jnp.ones((4, 3))
    mdc = zoo9.MyDataclassContainer("mdc", ones, 2 * ones, jnp.zeros(4))
    got, want = h(mdc), net(p, mdc)
    assert isinstance(got, zoo9.RegisteredSpecial)
    _close((got.x, got.y), (want.x, want.y))
    moc = zoo9.MyOtherContainer("moc", ones, 3 * ones, jnp.ones(4))
    with pytest.raises(TypeError, match=r"path x\.name"):  # JAX's own, as the docs show
        net(p, moc)
    with pytest.raises(sm.ConfigError, match=r"args\[0\]\.name is the str 'moc', a leaf of an "
                       r"input that holds arrays.*meta_fields="):  # fmt: skip
        h(moc)
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a MyDataclassContainer \(a "
                       r"registered pytree\) of 3 arrays.*jax\.tree\.unflatten"):  # fmt: skip
        sm.export(h, tmp_path / "m", example=(mdc,))
    leaves, tree = jax.tree.flatten(mdc)  # the refusal's recipe

    def flat(params, *xs):
        return tuple(jax.tree.leaves(h.apply(params, jax.tree.unflatten(tree, xs))))

    sm.export(sm.hybridize(flat, h.params), tmp_path / "m", example=tuple(leaves))
    _close(sm.load(tmp_path / "m")(*leaves), (want.x, want.y))


def test_a_namedtuple_container_s_str_field_is_refused_as_a_str_among_arrays():
    """custom_pytrees.md's ``MyOtherContainer('moc', ...)`` given to a Hybrid (jit refuses it
    in the docs): the refusal names its ``name`` field as a str among the arrays and the
    docs' way, a meta field; it said the str was no "None, bool, int, float, complex, str"
    setting before, which a str is."""
    h = sm.hybridize(lambda p, c: c.a @ p, jnp.ones((3, 3)))
    moc = zoo9.MyOtherContainer("moc", jnp.ones((4, 3)), jnp.ones((4, 3)), jnp.ones(4))
    with pytest.raises(sm.ConfigError, match=r"args\[0\]\.name is the str 'moc', a leaf of "
                       r"an input that holds arrays.*register_dataclass"):  # fmt: skip
        h(moc)
    assert h.eager(moc).shape == (4, 3)  # op by op, the str unread: runs as plain Python does


@pytest.mark.slow
def test_nnx_checkpointing_guide_restored_and_abstract_models(tmp_path):
    """The guide's TwoLayerMLP saved (its ``nnx.State`` and a pure dict), restored into the
    abstract model's state and as a pure dict (``nnx.replace_by_pure_dict``): each restored
    model's Hybrid equals the saved one, every feature, batch symbolic, and three SGD steps of
    ``h.apply`` equal nnx's own. The abstract model itself hybridizes and stages its graph
    (shapes only); its call, eager call and export are ConfigErrors naming the param and the
    restore (jax.jit's raw "not a valid JAX type" TypeError before). The modified model given
    the old pure dict is refused naming the biases it lacks, as the guide's fix then adds."""
    model = zoo9.TwoLayerMLP(4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(42), (3, 4))
    ckpt_dir = ocp.test_utils.erase_and_create_empty(tmp_path / "my-checkpoints")
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(ckpt_dir / "state", state)
    checkpointer.save(ckpt_dir / "pure_dict", nnx.to_pure_dict(state))
    checkpointer.wait_until_finished()
    abstract_model = nnx.eval_shape(lambda: zoo9.TwoLayerMLP(4, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract_model)
    h_abstract = sm.hybridize(abstract_model)
    assert h_abstract.graph(x).primitive_counts["dot_general"] == 2
    said = r"params\['linear1'\]\['kernel'\] is a jax\.ShapeDtypeStruct \(float32\[4, 4\]\).*store"
    for call in (h_abstract, h_abstract.eager):
        with pytest.raises(sm.ConfigError, match=said):
            call(x)
    with pytest.raises(sm.ConfigError, match=said):
        sm.export(h_abstract, tmp_path / "abstract", example=(x,))
    state_restored = checkpointer.restore(ckpt_dir / "state", abstract_state)
    restored = nnx.merge(graphdef, state_restored)
    restored_pure_dict = checkpointer.restore(ckpt_dir / "pure_dict")
    nnx.replace_by_pure_dict(abstract_state, restored_pure_dict)
    from_dict = nnx.merge(graphdef, abstract_state)
    _close(h_abstract.replace(params=restored_pure_dict)(x), model(x))
    h = sm.hybridize(restored)
    _close(sm.hybridize(from_dict)(x), model(x))
    every_feature(tmp_path, h, model, x)
    tx = optax.sgd(0.1)

    def steps(apply, p):
        for _ in range(3):
            g = jax.grad(lambda p: (apply(p, x) ** 2).mean())(p)
            p = optax.apply_updates(p, tx.update(g, tx.init(p))[0])
        return p

    nnx_apply = lambda p, x: nnx.merge(graphdef, nnx.State(p))(x)  # noqa: E731
    _close(steps(h.apply, h.params), nnx.to_pure_dict(nnx.State(steps(nnx_apply, h.params))))
    modified = sm.hybridize(zoo9.ModifiedTwoLayerMLP(4, rngs=nnx.Rngs(0)))
    with pytest.raises(sm.ConfigError, match=r"missing \[\"params\['linear1'\]\['bias'\]\""):
        modified.apply(restored_pure_dict, x)


@pytest.mark.slow
def test_sharding_guide_constraint_under_auto_and_explicit_meshes(tmp_path):
    """The guide's ``f`` of ``x`` and its weight ``y`` under its Auto mesh: the Hybrid equals
    it, sharded as the constraint says, its graph counts the constraint; exported there (batch
    symbolic, vjp_order=1) the artifact loads, answers and differentiates on the mesh and off
    it. Under the Explicit mesh, ``jnp.tanh(x @ w)`` (the contracted axis unsharded) runs
    sharded, and exports there with ``vjp_order=1`` as outside ``jax.set_mesh`` (its one
    device's program staged off the mesh: JAX's raw ValueError before, "Please enter your
    `jit` into a mesh context", then a refusal): its grads equal the plain ones."""
    with jax.set_mesh(zoo9.auto_mesh()):
        x, y = zoo9.sharding_xy()
        h = sm.hybridize(lambda y, x: zoo9.f_sharded(x, y), y)
        out, want = h(x), zoo9.f_sharded(x, y)
        _close(out, want)
        assert out.sharding.spec == jax.P("X", None)
        assert h.graph(x).primitive_counts["sharding_constraint"] == 1
        sm.export(h, tmp_path / "auto", example=(x,), batch="b", vjp_order=1)
        _close(sm.load(tmp_path / "auto")(np.asarray(x)), want)
    host, w = np.asarray(x), np.asarray(y)
    m = sm.load(tmp_path / "auto")
    _close(m(host[:4]), host[:4] @ w)
    with jax.set_mesh(zoo9.auto_mesh()):
        _close(jax.grad(lambda r: m(r).sum())(host), jax.grad(lambda r: (r @ w).sum())(host))
    g = lambda w, x: jnp.tanh(x @ w)  # noqa: E731
    with jax.set_mesh(zoo9.explicit_mesh()):
        xe = jax.device_put(jnp.arange(8 * 4.0).reshape(8, 4) / 32, jax.P("X", None))
        we = jax.device_put(jnp.ones((4, 4)), jax.P(None, "Y"))
        he = sm.hybridize(g, we)
        _close(he(xe), g(we, xe))
        sm.export(he, tmp_path / "on", example=(xe,), batch=None, vjp_order=1)
    sm.export(he, tmp_path / "explicit", example=(np.asarray(xe),), batch="b", vjp_order=1)
    ones, xs = np.ones((4, 4), np.float32), np.asarray(xe)
    want = jax.grad(lambda r: g(ones, r).sum())(xs)
    for me in map(sm.load, (tmp_path / "on", tmp_path / "explicit")):
        _close(jax.grad(lambda r, me=me: me(r).sum())(xs), want)


@pytest.mark.slow
def test_ode_grad_closure_over_h_apply_and_vmapped():
    """ode_test's ``experiment``: ``odeint`` of a model closing over ``x`` (the param). The
    Hybrid of ``s * experiment(x)`` equals it; the grad of ``x`` over ``h.apply`` equals
    ``jax.grad(experiment)``, and ``jax.vmap(jax.value_and_grad(...))`` over a grid of ``x``
    (its ``test_grad_closure_with_vmap``) equals the plain one."""
    model = lambda x, s: s * zoo9.experiment(x)  # noqa: E731
    h = sm.hybridize(model, jnp.float32(0.01))
    one = jnp.float32(1.0)
    _close(h(one), zoo9.experiment(jnp.float32(0.01)))
    _close(jax.grad(lambda x: h.apply(x, one))(jnp.float32(0.3)), jax.grad(zoo9.experiment)(0.3))
    t = jnp.arange(0.0, 1.0, 0.25)
    got = jax.vmap(jax.value_and_grad(lambda x: h.apply(x, one)))(t)
    _close(got, jax.vmap(jax.value_and_grad(zoo9.experiment))(t), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("cls", ["NeuralNetwork", "NeuralNetwork2"])
def test_all_of_equinox_networks_as_written(cls, tmp_path):
    """all-of-equinox.md: each network per example (the Hybrid of the module) and over the
    guide's batch (``jax.vmap`` of it; the same function wrapped in ``eqx.filter_jit``), every
    feature, batch symbolic; grads over ``h.apply`` equal ``filtered_loss``'s (and the jitted
    ``loss``'s, NeuralNetwork's: jit refuses NeuralNetwork2's relu leaf, the guide's point),
    and the guide's step ``m - 0.1 * g`` over them equals its own."""
    x, y, model_key = zoo9.eqx_data()
    model = getattr(zoo9, cls)(model_key)
    _close(sm.hybridize(model)(x[0]), model(x[0]))
    batched = lambda m, x: jax.vmap(m)(x)  # noqa: E731
    _close(sm.hybridize(eqx.filter_jit(batched), model)(x), jax.vmap(model)(x))
    h = sm.hybridize(batched, model)
    every_feature(tmp_path, h, jax.vmap(model), x[:5])
    grads = jax.grad(lambda p: jnp.mean((y - h.apply(p, x)) ** 2))(h.params)
    filtered = zoo9.filtered_loss(model, x, y)
    _close(grads, eqx.filter(filtered, eqx.is_inexact_array))
    if cls == "NeuralNetwork":  # the guide's jax.jit loss and step (NeuralNetwork2's relu is
        plain = zoo9.eqx_loss(model, x, y)  # no array: why the guide filters, jit refuses it)
        _close(grads, eqx.filter(plain, eqx.is_inexact_array))
        new_model = jax.tree_util.tree_map(lambda m, g: m - 0.1 * g, model, plain)
    else:
        new_model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, filtered))
    stepped = jax.tree.map(lambda m, g: m - 0.1 * g, h.params, grads)
    _close(h.apply(stepped, x), jax.vmap(new_model)(x))


@pytest.mark.slow
def test_linen_design_test_lazy_mlp_and_linear_regression(tmp_path):
    """linen_design_test: mlp_lazy's ``MLP`` (``setup``'s Denses, shapes known at the first
    call) over every feature, batch symbolic; linear_regression's loop (``value_and_grad`` of
    its ``loss_fn``, ``lr = 0.03``) over the Hybrid of its ``model`` (``h.apply`` of its params
    at its ``X``) equals the example's own, loss for loss."""
    mlp_variables = zoo9.LazyMLP().init(jax.random.key(10), jnp.zeros((1, 3)))
    x = jax.random.normal(jax.random.key(1), (5, 3))
    h = sm.hybridize(zoo9.LazyMLP(), mlp_variables)
    every_feature(tmp_path, h, lambda r: zoo9.LazyMLP().apply(mlp_variables, r), x)
    params = zoo9.init_params(jax.random.key(42))
    hr = sm.hybridize(zoo9.model, {"params": params})
    loss = lambda p: jnp.mean(jnp.abs(zoo9.Y - hr.apply({"params": p}, zoo9.X)))  # noqa: E731
    mine, theirs = params, params
    for _ in range(5):
        got, grad = jax.value_and_grad(loss)(mine)
        want, wgrad = jax.value_and_grad(zoo9.loss_fn)(theirs)
        _close(got, want)
        mine = jax.tree_util.tree_map(lambda x, d: x - 0.03 * d, mine, grad)
        theirs = jax.tree_util.tree_map(lambda x, d: x - 0.03 * d, theirs, wgrad)
    _close(mine, theirs)
    _close(hr.apply({"params": mine}, zoo9.X), zoo9.predict(theirs))


@pytest.mark.slow
def test_training_cookbook_transformer_fsdp_over_its_explicit_mesh(tmp_path):
    """JAX's training cookbook, its sizes cut (2 layers, width 16, 8 heads of 4, sequences of
    8, a batch of 8; its learning rate 1e-4 raised to 1e-2, so that two steps move bfloat16
    params): its ``Config`` sets its Explicit 8-way ``fsdp`` mesh; the Hybrid of
    ``model_apply`` over the ``dot_dict`` params equals it, sharded as its ``out_sharding``
    says; exported (static shapes, as the Explicit mesh allows) it loads with
    ``allow={'gather'}`` (its embedding lookup; refused by name without) and answers off the
    mesh. Two of its own ``train_step`` s (Adam on ``jax.ref`` s) equal the same step with
    ``h.apply`` in place of ``model_apply``, and move the params."""
    outer = jax.make_mesh((8,), ("fsdp",), (jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(outer):  # (restored on exit: the Config sets the mesh globally)
        config = zoo9.Config(seq_length=8, num_layers=2, embed_dim=16, mlp_dim=32, num_heads=8,
                             head_dim=4, host_batch_size=8, learning_rate=1e-2)  # fmt: skip
        params = zoo9.init_train_state(config).params
        obs = np.frombuffer(zoo9.ode.encode("ascii"), dtype=np.uint8)
        raw = {"observed_ids": np.tile(obs[:8], (8, 1)),
               "target_ids": np.tile(np.roll(obs, -1)[:8], (8, 1))}  # fmt: skip
        shard = lambda a: jax.make_array_from_process_local_data(jax.P("fsdp"), a)  # noqa: E731
        batch = {k: shard(v) for k, v in raw.items()}
        apply = lambda p, t: zoo9.model_apply(config, p, t)  # noqa: E731
        h, tokens = sm.hybridize(apply, params), batch["observed_ids"]
        want = jax.jit(apply)(params, tokens)
        got = h(tokens)
        assert jax.typeof(got).sharding.spec == jax.P("fsdp", None, None)
        _close(got.astype(jnp.float32), want.astype(jnp.float32), rtol=2e-2, atol=2e-2)
        sm.export(h, tmp_path / "m", example=(tokens,), batch=None)
        with pytest.raises(sm.ArtifactError, match=r"allow=\{'gather'\}"):
            sm.load(tmp_path / "m")
        theirs = jax.tree.map(jax.ref.new_ref, zoo9.init_train_state(config))
        mine = jax.tree.map(jax.ref.new_ref, zoo9.init_train_state(config))

        @jax.jit
        def step(train_state, batch):  # its train_step, h.apply in place of model_apply
            def loss_fn(params):
                logits = h.apply(params, batch["observed_ids"])
                labels = jax.nn.one_hot(batch["target_ids"], config.vocab_size)
                return -(labels * jax.nn.log_softmax(logits)).mean()

            params = jax.tree.map(jax.ref.get, train_state.params)
            loss, grad = jax.value_and_grad(loss_fn)(params)
            update = functools.partial(zoo9.adam_update, config)
            jax.tree.map(update, train_state.params, grad, train_state.opt)
            return {"train_loss": loss}

        for _ in range(2):
            _close(step(mine, batch), zoo9.train_step(config, theirs, batch))
        a, b = (jax.tree.map(lambda r: jax.ref.get(r).astype(jnp.float32), s.params)
                for s in (mine, theirs))  # fmt: skip
        _close(a, b)
        moved = jax.tree.map(lambda x, y: bool(jnp.any(x != y)), a, params)
        assert any(jax.tree.leaves(moved))
    m = sm.load(tmp_path / "m", allow={"gather"})
    host = np.asarray(tokens)
    _close(np.asarray(m(host), np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)


def test_dot_dict_params_whose_getattr_raises_keyerror_hybridize(tmp_path):
    """The cookbook's ``dot_dict`` (``__getattr__ = dict.__getitem__``: a missing attribute is
    a KeyError) as params, equinox imported: hybridize asked it for ``dtype`` and raised that
    KeyError ('dtype'); it is walked as the pytree it is, the call equal to the plain one. As
    export's example and as a static setting it was KeyError('shape'); now each refusal of a
    dict, or of an unhashable static, names it."""
    assert eqx.Module  # imported, as a process using both has it
    params = zoo9.dot_dict(w=jnp.full((3, 2), 0.5), layers=zoo9.dot_dict(b=jnp.ones(2)))
    fn = lambda p, x: x @ p.w + p.layers.b  # noqa: E731
    h, x = sm.hybridize(fn, params), jnp.ones((4, 3))
    assert isinstance(h.params, zoo9.dot_dict)
    _close(h(x), fn(params, x))
    given = zoo9.dot_dict(a=x)  # as an example to export, and a static setting: named, as a dict
    with pytest.raises(sm.SignatureError, match=r"args\[0\] is a dict with keys \['a'\]"):
        sm.export(sm.hybridize(lambda p, c: c.a @ p.w, params), tmp_path, example=(given,))
    static = sm.hybridize(lambda p, x, c: x, {}, static_argnames="c")
    with pytest.raises(sm.ConfigError, match=r"kwargs\['c'\] is marked static but is a dot_dict"):
        static(x, c=given)


@pytest.mark.slow
def test_checkify_guide_checked_function_hybridized_and_exported(tmp_path):
    """checkify_guide.md: ``jittable_f`` (``checkify.checkify(f)``, whose signature is
    ``(*args, **kwargs)``) with ``x`` as its params: the Hybrid's error and value equal
    ``jax.jit(jittable_f)``'s for a bad and a good index; export refuses its output (an Error
    pytree, its tree cut: 1,300 characters of tracebacks' addresses before) naming the flat
    tuple an artifact returns, where it refused the call's arguments ("too many positional
    arguments", the ``*args`` dropped with the params); ``lambda *a:
    jittable_f(*a)[1]`` exports, loads and answers. ``f`` itself, unchecked, is refused by
    JAX's own "not functionalized" error, as the guide shows under ``jax.jit``."""
    x = jnp.arange(5.0)
    h = sm.hybridize(zoo9.jittable_f, x)
    for i in (jnp.int32(-2), jnp.int32(3)):
        (err, z), (want_err, want) = h(i), jax.jit(zoo9.jittable_f)(x, i)
        assert err.get() == want_err.get()
        _close(z, want)
    assert "index needs to be non-negative, got -2" in h(jnp.int32(-2))[0].get()
    i = jnp.int32(1)  # (a scalar index, as the guide's: its check takes a scalar)
    with pytest.raises(sm.SignatureError, match=r"returns PyTreeDef.*\.\.\. \(\d+ arrays\); an "
                       r"artifact returns an array or a flat tuple") as e:  # fmt: skip
        sm.export(h, tmp_path / "checked", example=(i,), batch=None)
    assert len(str(e.value)) < 600  # its Error's tree cut (1,300 characters of it before)
    value = sm.hybridize(lambda *a: zoo9.jittable_f(*a)[1], x)
    sm.export(value, tmp_path / "value", example=(i,), batch=None)
    loaded = sm.load(tmp_path / "value", allow={"dynamic_slice"})  # x[i]
    _close(loaded(np.int32(4)), jnp.sin(x[4]))
    with pytest.raises(ValueError, match="not functionalized"):
        sm.hybridize(zoo9.checkify_f, x)(jnp.int32(2))


@pytest.mark.slow
def test_array_refs_inside_a_net_and_a_closed_over_ref(tmp_path):
    """array_refs.md: ``g`` (its ``jax.grad`` 0.54 at 1.0: ``cos(1)``) per element after a
    layer: every feature, batch symbolic. ``pure1`` after a layer: JAX builds no VJP of order
    2 of it (serialize raises AttributeError, raw before), refused naming order 1, which
    exports and differentiates. A net closing over a ref (after its
    ``impure2``) runs in the Hybrid, counting, and its export is a ConfigError naming the
    closed-over jax.Ref and what to do (jax.export's raw "Too many leaves for PyTreeDef")."""
    _close(jax.grad(zoo9.g_ref)(1.0), jnp.cos(1.0))
    p, x = _w(), jax.random.normal(jax.random.key(1), (5, 4))
    fn = lambda p, r: jax.vmap(jax.vmap(zoo9.g_ref))(r @ p)  # noqa: E731
    every_feature(tmp_path / "g", sm.hybridize(fn, p), lambda r: fn(p, r), x)
    fn = lambda p, r: zoo9.pure1(r @ p)  # noqa: E731 - JAX builds no VJP of order 2 of it
    h = sm.hybridize(fn, p)  # (jax.export's serialize(vjp_order=2) raises AttributeError)
    _close(h(x), 2 * x @ p)
    with pytest.raises(sm.ConfigError, match=r"VJP of order 2 \(DynamicJaxprTracer has no "
                       r"attribute accum\); it builds those of order 1.*vjp_order=1"):  # fmt: skip
        sm.export(h, tmp_path / "pure1", example=(x,), batch="b", vjp_order=2)
    sm.export(h, tmp_path / "pure1", example=(x,), batch="b", vjp_order=1)
    m = sm.load(tmp_path / "pure1")
    _close(jax.grad(lambda r: m(r).sum())(x), jax.grad(lambda r: fn(p, r).sum())(x))
    h = sm.hybridize(zoo9.net_counting, p)
    before = float(zoo9.calls[...])
    _close(h(x), x @ p)
    assert float(zoo9.calls[...]) == before + 1
    with pytest.raises(sm.ConfigError, match=r"export\(net_counting\): the function closes over "
                       r"a jax\.Ref.*Pass its value in"):  # fmt: skip
        sm.export(h, tmp_path / "m", example=(x,))
