"""Code we did not write, round thirty-one (tests/zoo31.py; sources and commits there):
DeepMind's small libraries and JAX MD, never run here before, over every feature and inside
the authors' own jitted loops.

- mctx (the AlphaZero maze demo of its README's example projects): the Haiku policy network,
  batched as the author batches it, over every feature; ``mctx.gumbel_muzero_policy`` over a
  ``recurrent_fn`` whose networks are a Hybrid's ``h.apply``, then loaded artifacts'
  ``m.apply``: the search's action weights, actions and tree equal those over the source
  networks, same key; the demo's whole training loop (search, the networks trained towards its
  action weights, the maze's resets, one ``lax.scan``) over the loaded networks equals the
  author's.
- jax-md's NVE notebook (``energy.soft_sphere_pair`` of two species, under the notebook's
  ``jax_enable_x64``): the forces as an artifact over every feature (a Batcher's thread ran
  without the caller's x64 block); the energy exported, forces as ``-jax.grad`` of the LOADED
  energy equal jax-md's own ``quantity.force``, its gradient over the species' sigmas equals
  too, and ten ``simulate.nve`` steps over the loaded energy equal jax-md's. Its neural network
  potential (``energy.graph_network_neighbor_list``, an nnx model's state the params, a
  neighbor list inside): the loaded energy and its forces equal the notebook's, the gradient
  of its energy-and-force loss over ``m.apply`` (``vjp_order=2``) equals its ``grad(loss)``,
  NVE steps over it equal.
- jmp's README: ``layer`` under its float16-compute policy, and under bfloat16: the answer's
  dtype through every door (Hybrid, export, load, ``m.apply``, grads, a Batcher) equals the
  source's; its dynamic loss scaling's ``train_step`` over the loaded layer equals the
  author's, the loss scale's too.
"""

import concurrent.futures
import functools
import types

import jax
import jax.numpy as jnp
import jmp
import mctx
import numpy as np
import pytest
import zoo31
from features import close, every_feature
from jax_md import quantity, simulate

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each compiles a search, a training loop or a simulation

# --- mctx ----------------------------------------------------------------------------------------


_INIT = ("env_states", "V_func", "pi_func", "V_opt_state", "pi_opt_state", "V_opt_update",
         "pi_opt_update", "get_V_params", "V_target_params", "get_pi_params")  # fmt: skip


def _maze():
    """The demo's environment and what its ``init_fn`` returns, by the script's names, and the
    two networks' params."""
    env = zoo31.ProcMaze(**zoo31.config.env_config)
    made = types.SimpleNamespace(**dict(zip(_INIT, zoo31.get_init_fn(env)(jax.random.PRNGKey(0)),
                                            strict=True)))  # fmt: skip
    made.V_params, made.pi_params = made.V_target_params, made.get_pi_params(made.pi_opt_state)
    return env, made


def _loaded(tmp_path, env, made):
    """The two networks (Haiku applies of one observation) hybridized, exported
    (``vjp_order=1``, for the demo's training) on one float observation, loaded."""
    obs = env.get_observation(jax.tree.map(lambda x: x[0], made.env_states)).astype(float)
    pairs = []
    for name in ("V", "pi"):
        h = sm.hybridize(getattr(made, f"{name}_func"), getattr(made, f"{name}_params"))
        sm.export(h, tmp_path / name, example=(obs,), batch=None, vjp_order=1)
        pairs.append((h, sm.load(tmp_path / name)))
    return pairs


def _search(recurrent_fn, env, made, key):
    """The demo's ``loop_function``'s root and search (its first step), over ``recurrent_fn``."""
    obs = jax.vmap(env.get_observation)(made.env_states).astype(float)
    batched = lambda f, p: jax.vmap(f, (None, 0))(p, obs)  # noqa: E731
    root = mctx.RootFnOutput(
        prior_logits=batched(made.pi_func, made.pi_params),
        value=batched(made.V_func, made.V_params),
        embedding=made.env_states,
    )
    search = functools.partial(
        mctx.gumbel_muzero_policy,
        params={"V": made.V_params, "pi": made.pi_params},
        root=root,
        recurrent_fn=recurrent_fn,
        num_simulations=zoo31.config.num_simulations,
        max_num_considered_actions=env.num_actions(),
        qtransform=functools.partial(
            mctx.qtransform_completed_by_mix_value, use_mixed_value=True, value_scale=0.1
        ),
    )
    return jax.jit(lambda key: search(rng_key=key))(key)


def test_mctx_policy_network_batched_as_the_author_over_every_feature(tmp_path):
    """``pi_function`` (Haiku, ``hk.without_apply_rng``) as the demo batches it,
    ``vmap(pi_func, in_axes=(None, 0))``, over every feature."""
    env, made = _maze()
    obs = jax.vmap(env.get_observation)(made.env_states).astype(float)
    batched = lambda p, o: jax.vmap(made.pi_func, (None, 0))(p, o)  # noqa: E731
    h = sm.hybridize(batched, made.pi_params)
    every_feature(tmp_path, h, lambda o: batched(made.pi_params, o), obs)


def test_mctx_gumbel_muzero_over_loaded_networks_equals_the_source_networks(tmp_path):
    """``gumbel_muzero_policy`` over the demo's ``recurrent_fn`` (the maze's exact step, the
    value and policy networks on the next observation), its networks ``h.apply``, then loaded
    artifacts' ``m.apply``: the action weights, the actions and the search tree's values and
    visits equal the search over the Haiku networks, for three keys."""
    env, made = _maze()
    (hv, mv), (hp, mp) = _loaded(tmp_path, env, made)
    theirs_fn = zoo31.get_recurrent_fn(env, made.V_func, made.pi_func)
    for key in map(jax.random.PRNGKey, range(3)):
        theirs = _search(theirs_fn, env, made, key)
        for v_apply, pi_apply in ((hv.apply, hp.apply), (mv.apply, mp.apply)):
            ours = _search(zoo31.get_recurrent_fn(env, v_apply, pi_apply), env, made, key)
            close(ours.action_weights, theirs.action_weights)
            assert jnp.array_equal(ours.action, theirs.action)
            tree, want = ours.search_tree, theirs.search_tree
            close((tree.node_values, tree.node_visits), (want.node_values, want.node_visits))
    assert len({tuple(np.asarray(w).round(4)) for w in theirs.action_weights}) > 1  # mazes differ


def _training(made, v_func, pi_func, env, iterations=3):
    """The demo's ``agent_environment_interaction_loop_function`` (jitted) over ``v_func`` and
    ``pi_func``, from the run state its script builds."""
    loop = zoo31.get_agent_environment_interaction_loop_function(
        env, v_func, pi_func, zoo31.get_recurrent_fn(env, v_func, pi_func), made.V_opt_update,
        made.pi_opt_update, made.get_V_params, made.get_pi_params, env.num_actions(),
        iterations)  # fmt: skip
    b = zoo31.config.batch_size
    state = {"env_states": made.env_states, "V_opt_state": made.V_opt_state,
             "V_target_params": made.V_target_params, "pi_opt_state": made.pi_opt_state,
             "opt_t": 0, "avg_return": jnp.zeros(b), "episode_return": jnp.zeros(b),
             "num_episodes": jnp.zeros(b), "key": jax.random.PRNGKey(5)}  # fmt: skip
    return jax.jit(loop)(state)


def test_mctx_demos_training_loop_over_loaded_networks_equals_the_authors(tmp_path):
    """Three steps of the demo's whole loop (search, its targets, adamw steps of both networks
    through ``jax.grad`` of the loss, the maze's steps and resets, all in one ``lax.scan``),
    the networks loaded artifacts' ``m.apply``: the author's run state, leaf by leaf."""
    env, made = _maze()
    (_, mv), (_, mp) = _loaded(tmp_path, env, made)
    theirs = _training(made, made.V_func, made.pi_func, env)
    ours = _training(made, mv.apply, mp.apply, env)
    close(ours, theirs)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), theirs["pi_opt_state"],
                         made.pi_opt_state)  # fmt: skip
    assert max(jax.tree.leaves(moved)) > 0  # it trained


# --- jax-md --------------------------------------------------------------------------------------

X64 = {"rtol": 1e-10, "atol": 1e-10}


@pytest.fixture
def nve():
    """The notebook's system, 16 particles in a box of 5, under its ``jax_enable_x64``."""
    with jax.enable_x64(True):
        yield zoo31.nve_simulation(N=16, box_size=5.0)


def test_jax_md_forces_as_an_artifact_over_every_feature_with_x64(tmp_path, nve):
    """jax-md's ``quantity.force`` of the notebook's soft-sphere energy, its sigmas the params:
    float64 over every feature, served by a Batcher made in the caller's
    ``jax.enable_x64(True)`` block (its thread ran without x64, and the warm-up's float64 zeros
    reached the program as float32: "Dtype mismatch ... expected float64", blamed on a
    corrupted artifact)."""
    force = lambda p, r: quantity.force(lambda r: nve.energy_fn(r, sigma=p))(r)  # noqa: E731
    h = sm.hybridize(force, nve.sigma)
    want = quantity.force(nve.energy_fn)
    m = every_feature(tmp_path, h, want, nve.R, batch=None, allow={"gather", "scatter"}, **X64)
    assert m(nve.R).dtype == np.float64 and jnp.abs(want(nve.R)).max() > 0  # particles touch


def test_jax_md_forces_of_the_loaded_energy_and_nve_steps_over_it(tmp_path, nve):
    """The notebook's energy exported: forces as ``-jax.grad`` of the LOADED energy equal
    jax-md's own ``quantity.force``, its gradient over the sigmas (``m.apply``, of the params
    as the source holds them or by ``m.params``' names) equals jax-md's, and ten of the
    notebook's ``simulate.nve`` steps over the loaded energy (its ``step`` under
    ``lax.fori_loop``) equal its own, float64 throughout."""
    h = sm.hybridize(lambda p, r: nve.energy_fn(r, sigma=p), nve.sigma)
    sm.export(h, tmp_path / "e", example=(nve.R,), batch=None, vjp_order=2)
    m = sm.load(tmp_path / "e", allow={"gather", "scatter"})
    close(m(nve.R), nve.energy_fn(nve.R), **X64)
    close(-jax.grad(m)(nve.R), quantity.force(nve.energy_fn)(nve.R), **X64)
    by_sigma = jax.grad(lambda s: nve.energy_fn(nve.R, sigma=s))(nve.sigma)
    close(jax.grad(m.apply)(nve.sigma, nve.R), by_sigma, **X64)  # the source's params tree
    close(jax.grad(m.apply)(m.params, nve.R), {"params": by_sigma}, **X64)  # or by its names
    init, apply = simulate.nve(m, nve.shift, 1e-2)
    ours = jax.lax.fori_loop(0, 10, jax.jit(lambda i, s: apply(s)), init(nve.key, nve.R, kT=0.0))
    theirs = jax.lax.fori_loop(0, 10, nve.step, nve.state)
    close(ours, theirs, **X64)
    assert ours.position.dtype == np.float64
    assert jnp.abs(theirs.position - nve.R).max() > 1e-4  # they moved


def test_jax_md_graph_network_potential_loaded_its_forces_and_the_notebooks_loss_gradient(
    tmp_path,
):
    """neural_networks.py's graph network potential (an nnx model split to its state, a
    neighbor list inside ``train_energy``) hybridized over that state and exported
    (``vjp_order=2``: the notebook trains on forces): the loaded energy under ``vmap`` and its
    forces (``-jax.grad``) equal the notebook's ``vectorized_energy_fn`` and
    ``vectorized_force_fn``; the gradient of the notebook's energy-and-force loss over the
    loaded model's ``m.apply`` (the state as the source holds it) equals its ``grad(loss)``;
    five ``simulate.nve`` steps over the loaded energy equal those over the notebook's."""
    k = jax.random.split(jax.random.key(3), 3)
    positions = jax.random.uniform(k[0], (3, 64, 3), maxval=10.862)  # 64 atoms, its box
    nn = zoo31.neural_network_potential(positions)
    h = sm.hybridize(nn.train_energy, nn.params)
    sm.export(h, tmp_path / "gnn", example=(positions[0],), batch=None, vjp_order=2)
    m = sm.load(tmp_path / "gnn", allow={"gather", "reduce_window", "scatter", "sort"})
    tol = {"rtol": 1e-4, "atol": 1e-3}
    close(jax.vmap(m)(positions), nn.vectorized_energy_fn(nn.params, positions), **tol)
    forces = jax.vmap(lambda r: -jax.grad(m)(r))(positions)
    close(forces, nn.vectorized_force_fn(nn.params, positions), **tol)
    targets = (jax.random.normal(k[1], (3,)), jax.random.normal(k[2], (3, 64, 3)))

    def loss(params):  # the notebook's loss, its train_energy the loaded model's m.apply
        energies = jax.vmap(m.apply, (None, 0))(params, positions)
        force = jax.vmap(lambda r: -jax.grad(m.apply, argnums=1)(params, r))(positions)
        return jnp.mean((energies - targets[0]) ** 2) + jnp.mean(
            jnp.sum((force - targets[1]) ** 2, axis=(1, 2))
        )

    want = jax.grad(nn.loss)(nn.params, positions, targets)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(want))  # sums of 1e4s
    close(jax.grad(loss)(nn.params), want, rtol=1e-4, atol=1e-6 * scale)  # float32's rounding
    theirs = lambda r: nn.vectorized_energy_fn(nn.params, r[None])[0]  # noqa: E731
    steps = []
    for fn in (theirs, m):
        init, apply = simulate.nve(fn, nn.shift, 1e-3)
        state = init(k[1], positions[0], kT=1e-3)
        for _ in range(5):
            state = jax.jit(apply)(state)
        steps.append(state)
    close(steps[1].position, steps[0].position, **tol)
    assert jnp.abs(steps[0].position - positions[0]).max() > 1e-5  # they moved


def test_a_float64_artifact_called_from_a_thread_without_x64_names_the_block(tmp_path):
    """The notebook's habit, ``jax_enable_x64`` for the cells that need it, as a ``with
    jax.enable_x64(True)`` block: a float64 artifact loaded in it is served by a Batcher made
    in it (its thread ran without x64), and called from a worker thread (which starts without
    it) is refused naming the block's thread, where it said "corrupted, was edited, or was
    made for another JAX. Export it again"."""
    with jax.enable_x64(True):
        x = np.linspace(0.0, 1.0, 6).reshape(3, 2)
        h = sm.hybridize(lambda p, x: jnp.sin(x) * p, jnp.float64(2.0))
        m = sm.load(sm.export(h, tmp_path / "m", example=(x,)).path)
        with sm.serving.Batcher(m, max_batch=4) as b:
            got = b.submit(x[:1]).result(30)
        assert got.dtype == np.float64
        close(got, h(x[:1]), **X64)
        close(m(x), h(x), **X64)  # its shape run before: the thread's call runs the program
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            for rows in (x, x[:2]):  # and a new shape, refined first
                with pytest.raises(sm.ArtifactError, match="holds only in the thread that") as e:
                    pool.submit(m, rows).result(30)
                assert "float64" in str(e.value) and "Export" not in str(e.value)


# --- jmp -----------------------------------------------------------------------------------------

F16 = {"rtol": 2e-3, "atol": 2e-3}


def _layer_params(seed=0):
    k = jax.random.split(jax.random.key(seed), 3)
    w, b = jax.random.normal(k[0], (4, 3)), jax.random.normal(k[1], (3,))
    return (w, b), jax.random.normal(k[2], (5, 4))


def _doors(tmp_path, h, ref, params, x, want, name="m"):
    """``h`` (of ``ref(params, x)``) through every door, each answer of dtype ``want`` as the
    source's (the grads of the params' and the input's own dtype): the loaded model."""
    assert ref(params, x).dtype == want
    sm.export(h, tmp_path / name, example=(x,), batch="b", vjp_order=2)
    m = sm.load(tmp_path / name)
    rows = np.asarray(x[:3])
    for got in (h(x), h.apply(params, x), m(rows), m.apply(params, rows), jax.jit(m)(rows),
                jax.vmap(m)(rows[:, None])[:, 0]):  # fmt: skip
        assert got.dtype == want, got.dtype
        close(got.astype(jnp.float32), ref(params, x)[: len(got)].astype(jnp.float32), **F16)
    loss = lambda f: lambda p, r: f(p, r).astype(jnp.float32).sum()  # noqa: E731
    for f in (m.apply, h.apply):
        dp, dx = jax.grad(loss(f), argnums=(0, 1))(params, rows)
        tp, tx = jax.grad(loss(ref), argnums=(0, 1))(params, rows)
        assert jax.tree.map(lambda a: a.dtype, (dp, dx)) == jax.tree.map(
            lambda a: a.dtype, (tp, tx)
        )
        close((dp, dx), (tp, tx), **F16)
    with sm.serving.Batcher(m, max_batch=4) as b:
        got = [b.submit(rows[i : i + 1]).result(30) for i in range(2)]
    assert {g.dtype for g in got} == {jnp.dtype(want)}
    close(np.concatenate(got).astype(np.float32), ref(params, rows[:2]).astype(jnp.float32), **F16)
    return m


def test_jmp_readme_layer_keeps_its_policys_dtypes_through_every_door(tmp_path):
    """The README's ``layer`` under ``my_policy`` (float32 params, float16 compute and out):
    float16 from the Hybrid, the loaded model, ``m.apply``, ``jax.jit`` and ``jax.vmap`` of it,
    a Batcher; its grads float32 as the params' and input's; the policy
    ``with_output_dtype(full)``: float32 out through every door."""
    params, x = _layer_params()
    _doors(tmp_path, sm.hybridize(zoo31.layer, params), zoo31.layer, params, x, jnp.float16)
    full_out = zoo31.my_policy.with_output_dtype(zoo31.full)

    def layer32(params, x):  # the README's layer, under its with_output_dtype(full) policy
        params, x = full_out.cast_to_compute((params, x))
        w, b = params
        return full_out.cast_to_output(x @ w + b)

    _doors(tmp_path, sm.hybridize(layer32, params), layer32, params, x, jnp.float32, "full")


def test_jmp_haiku_mlp_under_a_bfloat16_policy_keeps_bfloat16_through_every_door(tmp_path):
    """A Haiku ``hk.nets.MLP`` under ``hk.mixed_precision.set_policy`` of the README's policy
    string ``params=float32,compute=bfloat16,output=bfloat16``: bfloat16 answers through every
    door, float32 grads of its float32 params."""
    import haiku as hk

    policy = jmp.get_policy("params=float32,compute=bfloat16,output=bfloat16")
    hk.mixed_precision.set_policy(hk.nets.MLP, policy)
    try:
        net = hk.without_apply_rng(hk.transform(lambda x: hk.nets.MLP([8, 3])(x)))
        _, x = _layer_params(1)
        params = net.init(jax.random.key(2), x)
        assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
        _doors(tmp_path, sm.hybridize(net.apply, params), net.apply, params, x, jnp.bfloat16)
    finally:
        hk.mixed_precision.clear_policy(hk.nets.MLP)


def test_jmp_dynamic_loss_scaling_train_step_over_the_loaded_layer(tmp_path):
    """The README's ``train_step`` with a dynamic loss scale of 2 ** 15 (float32, as
    ``DynamicLossScale``'s docstring makes it: the README's ``jmp.half_dtype()(2 ** 15)`` makes
    jmp's own ``adjust`` raise "lax.select requires arguments to have the same dtypes, got
    float32, float16") over a loaded ``layer`` (``m.apply``, jitted): eight steps give the
    author's params and loss scale, the steps whose float16 grads overflowed skipped and the
    scale halved as for the source's."""
    params, x = _layer_params()
    y = jnp.full((5, 3), 100.0)  # far: the scaled float16 grads overflow at first
    sm.export(sm.hybridize(zoo31.layer, params), tmp_path / "m", example=(x,), vjp_order=1)
    m = sm.load(tmp_path / "m")
    steps = [jax.jit(zoo31.readme_train_step(f)) for f in (zoo31.layer, m.apply)]
    scale = jmp.DynamicLossScale(jnp.asarray(2.0**15))
    theirs = ours = (params, scale)
    scales = []
    for _ in range(8):
        theirs, ours = steps[0](*theirs, x, y), steps[1](*ours, x, y)
        close(ours[0], theirs[0])
        assert ours[1].loss_scale.dtype == theirs[1].loss_scale.dtype
        close(ours[1], theirs[1])
        scales.append(float(theirs[1].loss_scale))
    assert scales[0] < 2**15  # the first step's grads overflowed float16: skipped, scale halved
    assert not np.allclose(theirs[0][0], params[0]), scales  # and later ones trained
