"""Code we did not write, round twenty-seven (tests/zoo27.py; sources and commits there):
reinforcement learning and evolution strategies in pure JAX, never run here before, over every
feature and inside the authors' own jitted loops.

- PureJaxRL's ``ActorCritic`` (a distrax ``Categorical`` and a value out): the export's
  refusal of the distribution, and its route (the leaves, ``jax.tree.unflatten`` of the
  source's structure rebuilding the distribution from the loaded model's) over every feature;
  the loaded policy's actions and log-probs equal the source's for the same key. Its whole
  ``make_train`` (CartPole-v1 from gymnax, 2 updates) under one ``jax.jit`` with ``h.apply`` as
  the network's apply equals the author's: the trained params and every metric; with a loaded
  artifact's ``m.apply`` as the apply (PPO of a policy whose source is lost) too.
- evosax's RL notebook (CartPole, SNES, a population of 8): its population of the source's
  params tree through ``jax.vmap(h.apply, (0, None))`` and a loaded artifact's
  ``jax.vmap(m.apply, (0, None))`` equals the author's policy member by member, no member
  answering with another's weights (m.apply refused that tree: it took a dict of m.params'
  names only); the notebook's own ``problem.eval`` (rollouts under ``lax.scan`` and two
  ``vmap``) with the policy's apply ``h.apply``, then the loaded model's, equals the author's
  fitness, member by member; one generation of the notebook's ``step`` over it too.
- rlax's simple_dqn.py: the ``DQN`` agent's ``learner_step`` (``rlax.double_q_learning``,
  ``optax.periodic_update`` of the target) and ``actor_step`` with the network's apply
  ``h.apply``, then a loaded artifact's ``m.apply`` (Haiku's params tree, its keys holding
  ``/``), equal the author's over three steps.
- gymnax's own CartPole ``env.step`` (the package's, not copied), its ``EnvParams`` of Python
  numbers the params: an environment as an artifact, stepped through its auto-resets as
  gymnax steps, and under ``jax.vmap`` of ``m.apply`` over other worlds' params (m.apply
  refused the source's Python numbers: "is None[]").
"""

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import zoo27
from dm_env import specs
from features import close, every_feature

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each compiles a network, or a whole training loop (> 0.5 s)

OBS = jax.random.normal(jax.random.key(1), (5, 4))  # CartPole's observations, 4 numbers each


def _actor_critic():
    network = zoo27.ActorCritic(2, activation="tanh")
    return network, network.init(jax.random.key(0), jnp.zeros(4))


def test_purejaxrl_actor_critic_every_feature_and_its_policy_loaded(tmp_path):
    """The network returns a distrax ``Categorical`` and the value: an artifact returns arrays,
    so export refuses it, naming the leaves' route. The logits and value as one array over
    every feature; over the refusal's route, the distribution rebuilt from the loaded model's
    leaves (``jax.tree.unflatten`` of the source's structure) samples the source's actions from
    the same key, its log-probs and entropy equal too."""
    network, params = _actor_critic()
    h = sm.hybridize(network, params)
    pi, value = h(OBS)
    want_pi, want_value = network.apply(params, OBS)
    close((pi.logits, value), (want_pi.logits, want_value))
    with pytest.raises(sm.SignatureError, match=r"Categorical.*tuple\(jax.tree.leaves\(out\)\)"):
        sm.export(h, tmp_path / "refused", example=(OBS,))
    both = lambda pi, value: jnp.concatenate([pi.logits, value[:, None]], -1)  # noqa: E731
    one = sm.hybridize(lambda p, x: both(*h.apply(p, x)), h.params)
    ref = lambda x: both(*network.apply(params, x))  # noqa: E731
    every_feature(tmp_path / "one", one, ref, OBS, allow={"real_dynamic_slice"})  # VJP's slices
    leaves = sm.hybridize(lambda p, x: tuple(jax.tree.leaves(h.apply(p, x))), h.params)
    m = sm.load(sm.export(leaves, tmp_path / "leaves", example=(OBS,), batch="b").path)
    tree = jax.tree.structure(network.apply(params, OBS))
    got_pi, got_value = jax.tree.unflatten(tree, m(np.asarray(OBS)))
    close(got_value, want_value)
    for seed in range(3):
        key = jax.random.key(seed)
        action = got_pi.sample(seed=key)
        assert jnp.array_equal(action, want_pi.sample(seed=key))
        close(got_pi.log_prob(action), want_pi.log_prob(action))
    close(got_pi.entropy(), want_pi.entropy())


PPO_CONFIG = {  # ppo.py's __main__ config, cut to 2 updates of 4 envs x 16 steps, DEBUG off
    "LR": 2.5e-4,
    "NUM_ENVS": 4,
    "NUM_STEPS": 16,
    "TOTAL_TIMESTEPS": 2 * 4 * 16,
    "UPDATE_EPOCHS": 2,
    "NUM_MINIBATCHES": 2,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "ENT_COEF": 0.01,
    "VF_COEF": 0.5,
    "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh",
    "ENV_NAME": "CartPole-v1",
    "ANNEAL_LR": True,
    "DEBUG": False,
}


@pytest.fixture(scope="module")
def ppo_theirs():
    """ppo.py's ``make_train`` under one ``jax.jit``, as its ``__main__`` runs it (key 30)."""
    return jax.jit(zoo27.make_train(dict(PPO_CONFIG)))(jax.random.PRNGKey(30))


def _train(monkeypatch, apply):
    """``make_train`` as the author runs it, ``ActorCritic``'s apply ``apply`` (``init`` the
    network's own): it builds ``ActorCritic(n, activation=...)`` inside ``train``."""
    network, _ = _actor_critic()

    class Network:  # ActorCritic as make_train calls it
        def __init__(self, action_dim, activation):
            self.network = network.clone(action_dim=action_dim, activation=activation)

        def init(self, rng, x):
            return self.network.init(rng, x)

        def apply(self, params, x):
            return apply(params, x)

    with monkeypatch.context() as patch:
        patch.setattr(zoo27, "ActorCritic", Network)
        return jax.jit(zoo27.make_train(dict(PPO_CONFIG)))(jax.random.PRNGKey(30))


def _same_training(ours, theirs):
    close(ours["runner_state"][0].params, theirs["runner_state"][0].params)
    close(ours["metrics"], theirs["metrics"])


def test_purejaxrl_make_train_with_h_apply_equals_the_authors(monkeypatch, ppo_theirs):
    """The whole of ``make_train`` under one ``jax.jit`` (env steps, GAE, minibatch PPO
    updates, all ``lax.scan``), the network's apply the Hybrid's: the author's trained params
    and every metric, from the same key."""
    network, params = _actor_critic()
    h = sm.hybridize(network, params)
    _same_training(_train(monkeypatch, h.apply), ppo_theirs)
    trained = ppo_theirs["runner_state"][0].params
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), trained, params)
    assert max(jax.tree.leaves(moved)) > 1e-3  # it trained (from train's own init, not ours)
    assert ppo_theirs["metrics"]["returned_episode"].any()  # episodes ended: resets ran


def test_purejaxrl_make_train_over_a_loaded_policy_equals_the_authors(
    tmp_path, monkeypatch, ppo_theirs
):
    """PPO of an artifact whose source is lost: the network's apply a loaded model's
    ``m.apply`` (``vjp_order=1``), over the params tree ``train`` initializes and updates (as
    the source's), the distribution rebuilt from its leaves; the author's training."""
    network, params = _actor_critic()
    leaves = sm.hybridize(lambda p, x: tuple(jax.tree.leaves(network.apply(p, x))), params)
    m = sm.load(sm.export(leaves, tmp_path / "m", example=(OBS,), batch="b", vjp_order=1).path)
    tree = jax.tree.structure(network.apply(params, OBS))
    _same_training(_train(monkeypatch, lambda p, x: tree.unflatten(m.apply(p, x))), ppo_theirs)


class _Policy:  # the notebook's policy as GymnaxProblem calls it, its apply another's
    def __init__(self, policy, apply):
        self.init, self.apply = policy.init, apply


def _notebook():
    nb = zoo27.notebook_cartpole(jax.random.key(0), episode_length=20, num_rollouts=2,
                                 population_size=8)  # fmt: skip
    state = nb.es.init(jax.random.key(1), nb.solution, nb.params)
    population, state = nb.es.ask(jax.random.key(2), state, nb.params)
    return nb, state, population


def _problem(nb, apply):
    """The notebook's ``GymnaxProblem`` (its cell 11) over a policy whose apply is ``apply``: a
    new problem, as ``eval`` is jitted with the problem static (the same one would reuse it)."""
    return type(nb.problem)(env_name="CartPole-v1", policy=_Policy(nb.policy, apply),
                            episode_length=20, num_rollouts=2, use_normalize_obs=True)  # fmt: skip


def test_evosax_population_through_vmap_of_h_apply_and_m_apply(tmp_path):
    """The ES's population (the source's params tree, 8 members stacked) through
    ``jax.vmap(h.apply, (0, None))`` and through a loaded artifact's ``jax.vmap(m.apply, (0,
    None))``, jitted or not, equals the author's policy network member by member, no member
    answering with another's weights. m.apply refused that tree (a dict of m.params' names
    only, which the researcher would have built by hand from the paths export joins)."""
    from evosax.problems.networks import MLP, identity_output_fn

    nb, _, population = _notebook()
    logits = MLP(layer_sizes=(64, 64, 2), output_fn=identity_output_fn)  # the policy's, unsampled
    want = jax.vmap(logits.apply, (0, None))(population, OBS)
    h = sm.hybridize(logits, nb.solution)
    close(jax.vmap(h.apply, (0, None))(population, OBS), want)
    m = sm.load(sm.export(h, tmp_path / "p", example=(OBS,), batch="b").path)
    for run in (jax.vmap(m.apply, (0, None)), jax.jit(jax.vmap(m.apply, (0, None)))):
        got = run(population, OBS)
        close(got, want)
        for i in range(8):
            assert not any(np.allclose(got[i], want[j], atol=1e-3) for j in range(8) if j != i)
    close(m.apply(jax.tree.map(lambda w: w[3], population), OBS), want[3])
    for other in ({"a": population["params"]}, {"": population["params"]}):  # "": no path
        with pytest.raises(sm.SignatureError, match=r"or the tree whose paths they are.*got \["):
            m.apply(other, OBS)


def test_evosax_notebooks_eval_over_h_apply_and_a_loaded_policy(tmp_path):
    """The notebook's own ``problem.eval`` (each member's rollouts: ``lax.scan`` over steps
    under ``vmap`` over rollouts and over the population), its policy's apply ``h.apply``, then
    a loaded artifact's ``m.apply`` of the sampling policy (an observation and a typed key
    in, the action out): the author's fitness, member by member; one generation of the
    notebook's ``step`` over the loaded policy gives the author's ES state."""
    nb, _, population = _notebook()
    key = jax.random.key(7)
    theirs, _, _ = nb.problem.eval(key, population, nb.problem_state)
    assert len(set(np.asarray(theirs).tolist())) > 2  # members differ
    h = sm.hybridize(nb.policy, nb.solution)
    obs = jnp.zeros(4)
    sm.export(h, tmp_path / "policy", example=(obs, key), batch=None)
    m = sm.load(tmp_path / "policy")
    for apply in (h.apply, m.apply):
        ours, _, _ = _problem(nb, apply).eval(key, population, nb.problem_state)
        close(ours, theirs)


_EPSILON = {"init_value": 1.0, "end_value": 0.01, "transition_steps": 1000, "power": 1.0}


def _dqn():  # main's agent, over Catch's specs (a 10 x 5 board, 3 actions)
    return zoo27.DQN(observation_spec=specs.Array((10, 5), np.float32),
                     action_spec=specs.DiscreteArray(3), epsilon_cfg=_EPSILON,
                     target_period=zoo27.FLAGS.target_period,
                     learning_rate=zoo27.FLAGS.learning_rate)  # fmt: skip


def _transitions(step, n=8):
    """A batch as ``ReplayBuffer.sample`` gives it, drawn at random in Catch's shapes."""
    k = jax.random.split(jax.random.key(100 + step), 4)
    board = lambda k: jax.random.bernoulli(k, 0.1, (n, 10, 5)).astype(jnp.float32)  # noqa: E731
    return (board(k[0]), jax.random.randint(k[1], (n,), 0, 3), jax.random.normal(k[2], (n,)),
            jnp.full((n,), zoo27.FLAGS.discount_factor), board(k[3]))  # fmt: skip


_EnvOutput = collections.namedtuple("_EnvOutput", "observation")  # dm_env's TimeStep, cut


@pytest.mark.filterwarnings("ignore:Rlax .* will be deprecated")
def test_rlax_dqn_learner_and_actor_over_h_apply_and_m_apply(tmp_path):
    """simple_dqn.py's ``DQN``, its network's apply the Hybrid's, then a loaded artifact's
    ``m.apply`` (of Haiku's params tree, keys ``mlp/~/linear_0``; exported with
    ``vjp_order=1`` for its gradient): three ``learner_step`` (double Q-learning's loss, adam,
    the target's periodic update) and the ``actor_step`` after equal the author's agent."""
    theirs = _dqn()
    params = theirs.initial_params(jax.random.key(0))
    h = sm.hybridize(theirs._network.apply, params.online)
    x = _transitions(0)[0]
    sm.export(h, tmp_path / "q", example=(x,), batch="b", vjp_order=1)
    m = sm.load(tmp_path / "q")
    for apply in (h.apply, m.apply):
        ours = _dqn()
        ours._network = type("Network", (), {"apply": staticmethod(apply)})()
        p_theirs = p_ours = params
        s_theirs, s_ours = theirs.initial_learner_state(params), ours.initial_learner_state(params)
        for step in range(3):
            p_theirs, s_theirs = theirs.learner_step(p_theirs, _transitions(step), s_theirs, None)
            p_ours, s_ours = ours.learner_step(p_ours, _transitions(step), s_ours, None)
            close(p_ours, p_theirs)
        env_output, key = _EnvOutput(_transitions(5)[0][0]), jax.random.key(3)
        for evaluation in (True, False):
            got = ours.actor_step(p_ours, env_output, ours.initial_actor_state(), key, evaluation)
            close(got, theirs.actor_step(p_theirs, env_output, theirs.initial_actor_state(), key,
                                         evaluation))  # fmt: skip


def test_gymnax_cartpole_step_as_an_artifact_and_its_params_under_vmap(tmp_path):
    """gymnax's own ``env.step`` (CartPole-v1, its auto-reset included), its ``EnvParams`` the
    params (Python numbers): the Hybrid equals it; export refuses the ``EnvState`` input,
    naming the route (its leaves by place), which exports; 40 steps of the loaded environment,
    its state carried as its own outputs, equal gymnax's rollout through two resets; ``m.apply``
    takes the ``EnvParams`` as the source holds them (refused: their Python numbers have no
    dtype), and ``jax.vmap`` of it over three gravities equals gymnax's step member by member."""
    import gymnax

    env, env_params = gymnax.make("CartPole-v1")
    _, state = env.reset(jax.random.key(0), env_params)
    h = sm.hybridize(lambda p, key, state, action: env.step(key, state, action, p), env_params)
    key = jax.random.key(1)
    close(h(key, state, 1), env.step(key, state, 1, env_params))
    with pytest.raises(sm.SignatureError, match=r"args\[1\] is a EnvState .* of 5 arrays"):
        sm.export(h, tmp_path / "refused", example=(key, state, jnp.int32(1)), batch=None)
    leaves, tree = jax.tree.flatten(state)
    leaves = [np.asarray(x) for x in leaves]  # reset's time is weakly typed: the outputs' is not

    def by_place(p, key, *xs):  # the refusal's route: the state's arrays by place, out too
        return tuple(jax.tree.leaves(h.apply(p, key, tree.unflatten(xs[:5]), *xs[5:])))

    example = (key, *leaves, np.int32(1))
    sm.export(sm.hybridize(by_place, h.params), tmp_path / "env", example=example, batch=None)
    m = sm.load(tmp_path / "env")
    theirs, ours, dones = state, leaves, 0
    for t in range(40):
        step_key, action = jax.random.fold_in(key, t), np.int32(t % 3 != 0)
        obs, theirs, reward, done, info = env.step(step_key, theirs, action, env_params)
        got = m(step_key, *ours, action)
        close(got, (obs, *jax.tree.leaves(theirs), reward, done, info["discount"]))
        ours, dones = got[1:6], dones + int(done)
    assert dones >= 2  # episodes ended and gymnax's auto-reset ran in the artifact too
    close(m.apply(env_params, *example), m(*example))
    worlds = [env_params.replace(gravity=g) for g in (9.8, 1.6, 24.8)]
    stacked = jax.tree.map(lambda *v: jnp.stack([jnp.asarray(x) for x in v]), *worlds)
    got = jax.vmap(m.apply, (0, *[None] * 7))(stacked, *example)
    for i, world in enumerate(worlds):
        want = jax.tree.leaves(env.step(key, state, 1, world))
        close([g[i] for g in got], want)
    assert not np.allclose(got[5][0], got[5][1])  # theta_dot: each world its own gravity
