"""Code we did not write, round thirty-one: DeepMind's small libraries and JAX MD, as their
authors wrote it (sizes are the tests'), for tests/test_authors_round31.py. None had run here
before (mctx 0.0.71 from the package index; jax-md 0.2.29 and jmp 0.0.4 were installed, never
driven).

kenjyoung/mctx_learning_demo at a14a2b2279a2baec3f73c903d2dbcdac53318b45 (the "Basic Learning
Demo with Mctx" of mctx's README, its example projects: AlphaZero on random mazes, Haiku):

- basic_tree_search.py: ``dotdict``, ``activation_dict``, ``V_function``, ``pi_function``,
  ``get_recurrent_fn`` (a ``mctx.RecurrentFnOutput`` of the Haiku networks' applies over the
  environment's exact step), ``get_init_fn``, ``get_AC_loss`` and
  ``get_agent_environment_interaction_loop_function`` (``mctx.gumbel_muzero_policy``, the
  networks trained towards its ``action_weights``, all one ``lax.scan``) as written; its
  argparse and ``json.load(open(args.config))`` are cut to ``config``, config.json's values as
  written but ``batch_size`` (128), ``num_simulations`` (50) and ``num_hidden_units`` (200),
  made small; its training run and pickling (the script's tail) left out.
- jax_environments.py: ``ProcMaze`` as written (``Asterix`` and the module's ``move_map`` left
  out).
- optimizers.py: ``adamw`` as written.

jax-md/jax-md at a41c7d19f6468f4e5263c32c12c9ed6cba26ebff:

- examples/nve_simulation.py: the cells "Setup Simulation Parameters" to "Construct
  Simulation Operators" in ``nve_simulation``, ``N`` and ``box_size`` its arguments (5000 and
  80.0 there); its ``config.update('jax_enable_x64', True)`` is the caller's (the tests run it
  under ``jax.enable_x64(True)``); matplotlib's cells left out; the run loop's
  ``lax.fori_loop(0, 10, step, state)`` is the test's.
- examples/neural_networks.py: the cells "Define the Periodic Space" to "Optimizer" (the
  graph network potential, ``energy.graph_network_neighbor_list``, an nnx model split to its
  state; its energy, force, losses and ``update_step``) in ``neural_network_potential``; the
  silicon data set it downloads is the test's random positions in its box; ``update_epoch``,
  training and the NVT simulation left out.

google-deepmind/jmp at 9c1cdbbf78da8b2bfaee475d42611c72626e31d0:

- README.md: "Policies" (``my_policy``, ``layer``) and "Loss scaling" (``my_loss_fn``,
  ``train_step`` with the dynamic loss scale) as written; its ``...`` are filled in
  ``readme_train_step`` (a squared loss of ``layer``, and SGD as ``apply_optimizer``), the
  README's names kept.

Ours: the files' two spaces of indent are made four (``ruff format``); the code is as written.
"""

# ruff: noqa: B007, E501, E731, F841, RUF059 - as the authors wrote it

import functools
import types
from functools import partial

import haiku as hk
import jax
import jax as jx
import jax.numpy as jnp
import jmp
import mctx
import optax
from flax import nnx
from jax import grad, jit, random, vmap
from jax import numpy as np
from jax.example_libraries.optimizers import make_schedule, optimizer
from jax_md import energy, simulate, space

# --- mctx_learning_demo: optimizers.py ----------------------------------------------------------


@optimizer
def adamw(step_size, b1=0.9, b2=0.999, eps=1e-8, wd=1e-6):
    """Construct optimizer triple for Adam.
    Args:
      step_size: positive scalar, or a callable representing a step size schedule
        that maps the iteration index to a positive scalar.
      b1: optional, a positive scalar value for beta_1, the exponential decay rate
        for the first moment estimates (default 0.9).
      b2: optional, a positive scalar value for beta_2, the exponential decay rate
        for the second moment estimates (default 0.999).
      eps: optional, a positive scalar value for epsilon, a small constant for
        numerical stability (default 1e-8).
    Returns:
      An (init_fun, update_fun, get_params) triple.
    """
    step_size = make_schedule(step_size)

    def init(x0):
        m0 = jnp.zeros_like(x0)
        v0 = jnp.zeros_like(x0)
        return x0, m0, v0

    def update(i, g, state):
        x, m, v = state
        m = (1 - b1) * g + b1 * m  # First  moment estimate.
        v = (1 - b2) * jnp.square(g) + b2 * v  # Second moment estimate.
        mhat = m / (1 - jnp.asarray(b1, m.dtype) ** (i + 1))  # Bias correction.
        vhat = v / (1 - jnp.asarray(b2, m.dtype) ** (i + 1))
        x = x - step_size(i) * (mhat / (jnp.sqrt(vhat) + eps)) - wd * x
        return x, m, v

    def get_params(state):
        x, _, _ = state
        return x

    return init, update, get_params


# --- mctx_learning_demo: jax_environments.py ----------------------------------------------------


class ProcMaze:
    def __init__(self, grid_size=10, goal_reward=False, timeout=None):
        self.move_map = jnp.asarray([[0, 0], [-1, 0], [0, -1], [1, 0], [0, 1]])
        self.timeout = timeout

        self._num_actions = 5
        self.grid_size = grid_size
        self.channels = {"player": 0, "goal": 1, "wall": 2, "empty": 3}

    @partial(jit, static_argnums=(0,))
    def step(self, action, env_state):
        goal, wall_grid, pos, t = env_state

        # Move if the new position is on the grid and open
        new_pos = jnp.clip(pos + self.move_map[action], 0, self.grid_size - 1)
        pos = jnp.where(jnp.logical_not(wall_grid[new_pos[0], new_pos[1]]), new_pos, pos)

        # Treminated if we reach the goal
        terminal = jnp.array_equal(pos, goal)
        if self.timeout is not None:
            terminal = jnp.logical_or(terminal, t >= self.timeout)

        reward = -1

        t += 1

        env_state = goal, wall_grid, pos, t

        return env_state, self.get_observation(env_state), reward, terminal, {}

    @partial(jit, static_argnums=(0,))
    def reset(self, key):
        def push(stack, top, x):
            stack = stack.at[top].set(x)
            top += 1
            return stack, top

        def pop(stack, top):
            top -= 1
            return stack[top], top

        # takes and flattened index, returns neighbours as (x,y) pair
        def neighbours(cell):
            coord_tuple = jnp.unravel_index(cell, (self.grid_size, self.grid_size))
            coord_array = jnp.stack(list(coord_tuple))
            return coord_array + self.move_map

        # takes (x,y) pair
        def can_expand(cell, visited):
            # A neighbour can be expanded as long as it is on the grid, it has not been visited, and it's only visited neighbour is the current cell
            flat_cell = jnp.ravel_multi_index(
                (cell[0], cell[1]), (self.grid_size, self.grid_size), mode="clip"
            )
            not_visited = jnp.logical_not(visited[flat_cell])
            ns = neighbours(flat_cell)
            ns_on_grid = jnp.all(jnp.logical_and(ns >= 0, ns <= self.grid_size - 1), axis=1)
            flat_ns = jnp.ravel_multi_index(
                (ns[:, 0], ns[:, 1]), (self.grid_size, self.grid_size), mode="clip"
            )
            # Only count neighbours which are actually on the grid
            only_one_visited_neighbor = jnp.equal(
                jnp.sum(jnp.logical_and(visited[flat_ns], ns_on_grid)), 1
            )
            on_grid = jnp.all(jnp.logical_and(cell >= 0, cell <= self.grid_size - 1))
            return jnp.logical_and(jnp.logical_and(not_visited, only_one_visited_neighbor), on_grid)

        can_expand = vmap(can_expand, in_axes=(0, None))

        wall_grid = jnp.ones((self.grid_size, self.grid_size), dtype=bool)

        # Visited node map
        visited = jnp.zeros(self.grid_size * self.grid_size, dtype=bool)

        # big enough to hold every location in the grid, indices should be flattened to store here
        stack = jnp.zeros(self.grid_size * self.grid_size, dtype=int)
        top = 0

        # Location of current cell being searched
        key, subkey = jx.random.split(key)
        curr = jx.random.choice(subkey, self.grid_size, (2,))
        flat_curr = jnp.ravel_multi_index(
            (curr[0], curr[1]), (self.grid_size, self.grid_size), mode="clip"
        )
        wall_grid = wall_grid.at[curr[0], curr[1]].set(False)

        visited = visited.at[flat_curr].set(True)
        stack, top = push(stack, top, flat_curr)

        def cond_fun(carry):
            visited, stack, top, wall_grid, key = carry
            # continue until stack is empty
            return top != 0

        def body_fun(carry):
            visited, stack, top, wall_grid, key = carry
            curr, top = pop(stack, top)
            ns = neighbours(curr)
            flat_ns = jnp.ravel_multi_index(
                (ns[:, 0], ns[:, 1]), (self.grid_size, self.grid_size), mode="clip"
            )

            expandable = can_expand(ns, visited)

            has_expandable_neighbour = jnp.any(expandable)

            # This will all be used only conditioned on has_expandable neighbor
            _stack, _top = push(stack, top, curr)
            key, subkey = jx.random.split(key)
            selected = jx.random.choice(subkey, flat_ns, p=expandable / jnp.sum(expandable))
            _stack, _top = push(_stack, _top, selected)
            _wall_grid = wall_grid.at[
                jnp.unravel_index(selected, (self.grid_size, self.grid_size))
            ].set(False)
            _visited = visited.at[selected].set(True)

            stack = jnp.where(has_expandable_neighbour, _stack, stack)
            top = jnp.where(has_expandable_neighbour, _top, top)
            wall_grid = jnp.where(has_expandable_neighbour, _wall_grid, wall_grid)
            visited = jnp.where(has_expandable_neighbour, _visited, visited)
            return (visited, stack, top, wall_grid, key)

        key, subkey = jx.random.split(key)
        carry = (visited, stack, top, wall_grid, subkey)
        visited, stack, top, wall_grid, key = jx.lax.while_loop(cond_fun, body_fun, carry)

        flat_open = jnp.logical_not(jnp.ravel(wall_grid))

        key, subkey = jx.random.split(key)
        pos = jx.random.choice(
            subkey, self.grid_size * self.grid_size, p=flat_open / jnp.sum(flat_open)
        )
        pos = jnp.stack(list(jnp.unravel_index(pos, (self.grid_size, self.grid_size))))
        key, subkey = jx.random.split(key)
        goal = jx.random.choice(
            subkey, self.grid_size * self.grid_size, p=flat_open / jnp.sum(flat_open)
        )
        goal = jnp.stack(list(jnp.unravel_index(goal, (self.grid_size, self.grid_size))))

        wall_grid = wall_grid.at[goal[0], goal[1]].set(False)
        wall_grid = wall_grid.at[pos[0], pos[1]].set(False)
        t = 0
        env_state = goal, wall_grid, pos, t
        return env_state

    @partial(jit, static_argnums=(0,))
    def get_observation(self, env_state):
        goal, wall_grid, pos, t = env_state
        obs = jnp.zeros((self.grid_size, self.grid_size, len(self.channels)), dtype=bool)
        obs = obs.at[pos[0], pos[1], self.channels["player"]].set(True)
        obs = obs.at[goal[0], goal[1], self.channels["goal"]].set(True)
        obs = obs.at[:, :, self.channels["wall"]].set(wall_grid)
        obs = obs.at[:, :, self.channels["empty"]].set(jnp.logical_not(wall_grid))
        return obs

    def num_actions(self):
        return self._num_actions


# --- mctx_learning_demo: basic_tree_search.py ---------------------------------------------------


# Copied from: https://stackoverflow.com/a/23689767
class dotdict(dict):
    """dot.notation access to dictionary attributes"""

    __getattr__ = dict.get
    __setattr__ = dict.__setitem__
    __delattr__ = dict.__delitem__


activation_dict = {"relu": jx.nn.relu, "silu": jx.nn.silu, "elu": jx.nn.elu}

config = dotdict({  # config.json, batch_size, num_simulations and num_hidden_units made small
    "num_hidden_layers": 3,
    "num_hidden_units": 32,
    "V_alpha": 0.0001,
    "pi_alpha": 0.00004,
    "b1_adam": 0.9,
    "b2_adam": 0.99,
    "eps_adam": 1e-5,
    "wd_adam": 1e-6,
    "discount": 0.99,
    "use_mixed_value": True,
    "value_scale": 0.1,
    "value_target": "maxq",
    "target_update_frequency": 100,
    "batch_size": 4,
    "avg_return_smoothing": 0.9,
    "num_simulations": 8,
    "num_steps": 100000,
    "eval_frequency": 100,
    "environment": "ProcMaze",
    "env_config": {"grid_size": 5, "timeout": 64},
    "activation": "elu",
})  # fmt: skip

config.update({"agent_type": "basic_tree_search", "seed": 0})


class V_function(hk.Module):
    def __init__(self, config, name=None):
        super().__init__(name=name)
        self.num_hidden_units = config.num_hidden_units
        self.num_hidden_layers = config.num_hidden_layers
        self.activation_function = activation_dict[config.activation]

    def __call__(self, obs):
        x = jnp.ravel(obs)
        for i in range(self.num_hidden_layers):
            x = self.activation_function(hk.Linear(self.num_hidden_units)(x))
        V = hk.Linear(1)(x)[0]
        return V


class pi_function(hk.Module):
    def __init__(self, config, num_actions, name=None):
        super().__init__(name=name)
        self.num_hidden_units = config.num_hidden_units
        self.num_hidden_layers = config.num_hidden_layers
        self.activation_function = activation_dict[config.activation]
        self.num_actions = num_actions

    def __call__(self, obs):
        x = jnp.ravel(obs)
        for i in range(self.num_hidden_layers):
            x = self.activation_function(hk.Linear(self.num_hidden_units)(x))
        pi_logit = hk.Linear(self.num_actions)(x)
        return pi_logit


# this assumes the agent has access to the exact environment dynamics
def get_recurrent_fn(env, V_func, pi_func):
    batch_step = vmap(env.step, in_axes=(0, 0))
    batch_pi_func = vmap(pi_func, in_axes=(None, 0))
    batch_V_func = vmap(V_func, in_axes=(None, 0))

    def recurrent_fn(params, key, actions, env_states):
        V_params = params["V"]
        pi_params = params["pi"]
        key, subkey = jx.random.split(key)
        subkeys = jx.random.split(subkey, num=config.batch_size)
        env_states, obs, rewards, terminals, _ = batch_step(actions, env_states)
        V = batch_V_func(V_params, obs.astype(float))
        pi_logit = batch_pi_func(pi_params, obs.astype(float))
        recurrent_fn_output = mctx.RecurrentFnOutput(
            reward=rewards,
            discount=(1.0 - terminals) * config.discount,
            prior_logits=pi_logit,
            value=V,
        )
        return recurrent_fn_output, env_states

    return recurrent_fn


def get_init_fn(env):
    batch_reset = vmap(env.reset)

    def init_fn(key):
        dummy_state = env.reset(key)
        obs = env.get_observation(dummy_state)
        dummy_obs = obs.astype(float)

        key, subkey = jx.random.split(key)
        subkeys = jx.random.split(subkey, num=config.batch_size)
        env_states = batch_reset(subkeys)
        num_actions = env.num_actions()

        V_net = hk.without_apply_rng(
            hk.transform(lambda obs: V_function(config)(obs.astype(float)))
        )
        key, subkey = jx.random.split(key)
        V_params = V_net.init(subkey, dummy_obs)
        V_func = V_net.apply

        V_target_params = V_params

        pi_net = hk.without_apply_rng(
            hk.transform(lambda obs: pi_function(config, num_actions)(obs.astype(float)))
        )
        key, subkey = jx.random.split(key)
        pi_params = pi_net.init(subkey, dummy_obs)
        pi_func = pi_net.apply

        V_opt_init, V_opt_update, get_V_params = adamw(
            config.V_alpha,
            eps=config.eps_adam,
            b1=config.b1_adam,
            b2=config.b2_adam,
            wd=config.wd_adam,
        )
        V_opt_state = V_opt_init(V_params)

        pi_opt_init, pi_opt_update, get_pi_params = adamw(
            config.pi_alpha,
            eps=config.eps_adam,
            b1=config.b1_adam,
            b2=config.b2_adam,
            wd=config.wd_adam,
        )
        pi_opt_state = pi_opt_init(pi_params)

        return (
            env_states,
            V_func,
            pi_func,
            V_opt_state,
            pi_opt_state,
            V_opt_update,
            pi_opt_update,
            get_V_params,
            V_target_params,
            get_pi_params,
        )

    return init_fn


def get_AC_loss(pi_func, V_func):
    def AC_loss(pi_params, V_params, pi_target, V_target, obs):
        pi_logits = pi_func(pi_params, obs.astype(float))
        V = V_func(V_params, obs.astype(float))

        pi_loss = jnp.sum(pi_target * (jnp.log(pi_target) - jx.nn.log_softmax(pi_logits)))
        V_loss = (V_target - V) ** 2

        return jnp.sum(pi_loss + V_loss)

    return AC_loss


def get_agent_environment_interaction_loop_function(
    env,
    V_func,
    pi_func,
    recurrent_fn,
    V_opt_update,
    pi_opt_update,
    get_V_params,
    get_pi_params,
    num_actions,
    iterations,
):
    batch_loss = lambda *x: jnp.mean(
        vmap(get_AC_loss(pi_func, V_func), in_axes=(None, None, 0, 0, 0))(*x)
    )
    loss_grad = grad(batch_loss, argnums=(0, 1))
    batch_step = vmap(env.step, in_axes=(0, 0))
    batch_obs = vmap(env.get_observation)
    batch_reset = vmap(env.reset)
    batch_V_func = vmap(V_func, in_axes=(None, 0))
    batch_pi_func = vmap(pi_func, in_axes=(None, 0))

    def agent_environment_interaction_loop_function(S):
        def loop_function(S, data):
            obs = batch_obs(S["env_states"])
            pi_logits = batch_pi_func(get_pi_params(S["pi_opt_state"]), obs.astype(float))
            V = batch_V_func(S["V_target_params"], obs.astype(float))

            root = mctx.RootFnOutput(prior_logits=pi_logits, value=V, embedding=S["env_states"])

            S["key"], subkey = jx.random.split(S["key"])
            policy_output = mctx.gumbel_muzero_policy(
                params={"V": S["V_target_params"], "pi": get_pi_params(S["pi_opt_state"])},
                rng_key=subkey,
                root=root,
                recurrent_fn=recurrent_fn,
                num_simulations=config.num_simulations,
                max_num_considered_actions=num_actions,
                qtransform=functools.partial(
                    mctx.qtransform_completed_by_mix_value,
                    use_mixed_value=config.use_mixed_value,
                    value_scale=config.value_scale,
                ),
            )

            # tree search derived targets for policy and value function
            search_policy = policy_output.action_weights
            if config.value_target == "maxq":
                search_value = policy_output.search_tree.qvalues(
                    jnp.full(config.batch_size, policy_output.search_tree.ROOT_INDEX)
                )[jnp.arange(config.batch_size), policy_output.action]
            elif config.value_target == "nodev":
                search_value = policy_output.search_tree.node_values[
                    :, policy_output.search_tree.ROOT_INDEX
                ]
            else:
                raise ValueError("Unknown value target.")

            # compute loss gradient compared to tree search targets and update parameters
            pi_grads, V_grads = loss_grad(
                get_pi_params(S["pi_opt_state"]),
                get_V_params(S["V_opt_state"]),
                search_policy,
                search_value,
                obs,
            )
            S["pi_opt_state"] = pi_opt_update(S["opt_t"], pi_grads, S["pi_opt_state"])
            S["V_opt_state"] = V_opt_update(S["opt_t"], V_grads, S["V_opt_state"])
            S["opt_t"] += 1

            # Update target params after a particular number of parameter updates
            S["V_target_params"] = jx.tree_util.tree_map(
                lambda x, y: jnp.where(S["opt_t"] % config.target_update_frequency == 0, x, y),
                get_V_params(S["V_opt_state"]),
                S["V_target_params"],
            )

            # always take action recommended by tree search
            actions = policy_output.action

            # step the environment
            S["env_states"], obs, reward, terminal, _ = batch_step(actions, S["env_states"])

            # reset environment if terminated
            S["key"], subkey = jx.random.split(S["key"])
            subkeys = jx.random.split(subkey, num=config.batch_size)
            S["env_states"] = jx.tree_util.tree_map(
                lambda x, y: jnp.where(
                    jnp.reshape(terminal, [terminal.shape[0]] + [1] * (len(x.shape) - 1)), x, y
                ),
                batch_reset(subkeys),
                S["env_states"],
            )

            # update statistics for computing average return
            S["episode_return"] += reward
            S["avg_return"] = jnp.where(
                terminal,
                S["avg_return"] * config.avg_return_smoothing
                + S["episode_return"] * (1 - config.avg_return_smoothing),
                S["avg_return"],
            )
            S["episode_return"] = jnp.where(terminal, 0, S["episode_return"])
            S["num_episodes"] = jnp.where(terminal, S["num_episodes"] + 1, S["num_episodes"])
            return S, None

        S["key"], subkey = jx.random.split(S["key"])
        S, _ = jx.lax.scan(loop_function, S, None, length=iterations)

        return S

    return agent_environment_interaction_loop_function


# --- jax-md: examples/nve_simulation.py --------------------------------------------------------


def nve_simulation(N, box_size):
    """The notebook's cells from "Setup Simulation Parameters" to "Construct Simulation
    Operators", as written (``N = 5000``, ``box_size = 80.0`` there): their names."""
    # %% [markdown]
    # ## Setup Simulation Parameters

    # %%
    dimension = 2
    displacement, shift = space.periodic(box_size)

    # %% [markdown]
    # ## Generate Random Positions and Particle Sizes
    #
    # Next we need to generate some random positions as well as particle sizes.

    # %%
    key = random.PRNGKey(0)

    # %%
    R = random.uniform(key, (N, dimension), minval=0.0, maxval=box_size, dtype=np.float64)

    # The system ought to be a 50:50 mixture of two types of particles, one
    # large and one small.
    sigma = np.array([[1.0, 1.2], [1.2, 1.4]])
    N_2 = int(N / 2)
    species = np.where(np.arange(N) < N_2, 0, 1)

    # %% [markdown]
    # ## Construct Simulation Operators
    #
    # Then we need to construct our simulation operators.

    # %%
    energy_fn = energy.soft_sphere_pair(displacement, species=species, sigma=sigma)
    init, apply = simulate.nve(energy_fn, shift, 1e-2)
    step = jit(lambda i, state: apply(state))
    state = init(key, R, kT=0.0)
    return types.SimpleNamespace(**locals())


def neural_network_potential(positions):
    """examples/neural_networks.py's cells from "Define the Periodic Space" to "Optimizer", as
    written (its ``nnx.display`` and prints left out); ``positions`` stands for the silicon
    data set's (64 atoms a frame, downloaded there): their names."""
    # %% [markdown]
    # ## Define the Periodic Space
    #
    # We create a space for our systems to live in using ``periodic`` boundary
    # conditions.

    # %%
    box_size = 10.862
    displacement, shift = space.periodic(box_size)

    # %% [markdown]
    # ## Construct the Graph Network
    # (the notebook's words cut)

    # %%
    key = random.PRNGKey(0)
    neighbor_fn, energy_fn = energy.graph_network_neighbor_list(
        displacement, box_size, r_cutoff=3.0, dr_threshold=0.0, key=key
    )

    # %% [markdown]
    # ## Allocate a Neighbor Prototype
    # (the notebook's words cut)

    # %%
    neighbor = neighbor_fn.allocate(positions[0], extra_capacity=6)

    # %% [markdown]
    # ## Define Energy and Force Functions
    # (the notebook's words cut)

    # %%
    graphdef, state = nnx.split(energy_fn.model)
    init_params = state
    params = init_params

    def apply(state, *args, **kwargs):
        out, _ = graphdef.apply(state)(*args, **kwargs)
        return out

    def train_energy(params, R):
        return apply(params, R, neighbor.update(R))

    vectorized_energy_fn = jit(vmap(train_energy, (None, 0)))
    vectorized_force_fn = jit(
        vmap(lambda params, R: -grad(train_energy, argnums=1)(params, R), (None, 0))
    )

    # %% [markdown]
    # ## Define Losses
    #
    # We define losses for the energy and the force as well as a total loss that
    # combines the two terms.  We fit both using Mean-Squared-Error (MSE) loss.

    # %%
    @jit
    def energy_loss(params, R, energy_targets):
        return np.mean((vectorized_energy_fn(params, R) - energy_targets) ** 2)

    @jit
    def force_loss(params, R, force_targets):
        dforces = vectorized_force_fn(params, R) - force_targets
        return np.mean(np.sum(dforces**2, axis=(1, 2)))

    @jit
    def loss(params, R, targets):
        return energy_loss(params, R, targets[0]) + force_loss(params, R, targets[1])

    # %% [markdown]
    # ## Optimizer
    #
    # We create an optimizer using Adam with gradient clipping and write helper
    # functions to perform a single update step and an entire epoch of updates.

    # %%
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))

    @jit
    def update_step(params, opt_state, R, labels):
        updates, opt_state = opt.update(grad(loss)(params, R, labels), opt_state)
        return optax.apply_updates(params, updates), opt_state

    return types.SimpleNamespace(**locals())


# --- jmp: README.md ----------------------------------------------------------------------------

half = jnp.float16  # On TPU this should be jnp.bfloat16.
full = jnp.float32

# Our policy specifies that we will store parameters in full precision but will
# compute and return output in half precision.
my_policy = jmp.Policy(compute_dtype=half, param_dtype=full, output_dtype=half)


def layer(params, x):
    params, x = my_policy.cast_to_compute((params, x))
    w, b = params
    y = x @ w + b
    return my_policy.cast_to_output(y)


def readme_train_step(layer, lr=0.1):
    """The README's ``my_loss_fn`` and ``train_step`` (dynamic loss scale) over ``layer``, its
    ``...`` filled: the loss a squared error of ``layer``'s output (in full precision, as
    the README's regularization would be), ``apply_optimizer`` SGD at ``lr``."""

    def apply_optimizer(params, grads):
        return jax.tree.map(lambda p, g: p - lr * g, params, grads)

    def my_loss_fn(params, loss_scale: jmp.LossScale, x, y):
        loss = jnp.mean((layer(params, x).astype(full) - y) ** 2)
        # You should apply regularization etc before scaling.
        loss = loss_scale.scale(loss)
        return loss

    def train_step(params, loss_scale: jmp.LossScale, x, y):
        grads = jax.grad(my_loss_fn)(params, loss_scale, x, y)
        grads = loss_scale.unscale(grads)
        # You should put gradient clipping etc after unscaling.

        # You definitely want to skip non-finite updates with the dynamic loss scale,
        # but you might also want to consider skipping them when using a static loss
        # scale if you experience NaN's when training.
        skip_nonfinite_updates = isinstance(loss_scale, jmp.DynamicLossScale)

        if skip_nonfinite_updates:
            grads_finite = jmp.all_finite(grads)
            # Adjust our loss scale depending on whether gradients were finite. The
            # loss scale will be periodically increased if gradients remain finite and
            # will be decreased if not.
            loss_scale = loss_scale.adjust(grads_finite)
            # Only apply our optimizer if grads are finite, if any element of any
            # gradient is non-finite the whole update is discarded.
            params = jmp.select_tree(grads_finite, apply_optimizer(params, grads), params)
        else:
            # With static or no loss scaling just apply our optimizer.
            params = apply_optimizer(params, grads)

        # Since our loss scale is dynamic we need to return the new value from
        # each step. All loss scales are `PyTree`s.
        return params, loss_scale

    return train_step
