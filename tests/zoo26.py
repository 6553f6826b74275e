"""Code we did not write, round twenty-six: the Equinox ecosystem and plain JAX, never run here
before (flowjax 19.1.2, haliax 1.4.dev453, e3nn-jax 0.21.0 from the package index), as their
authors wrote it, for tests/test_authors_round26.py.

danielward27/flowjax at cabcb42bcfdd12baa16c020078ec5e097efeaac0:

- docs/examples/unconditional.ipynb, cells 4, 6 and 8 (the two-moons data, the
  ``masked_autoregressive_flow`` of ``RationalQuadraticSpline``s, ``fit_to_data``), as
  ``unconditional``; cut: ``n_samples`` (10000) and ``fit_to_data``'s epochs are its
  arguments, the flow has 2 layers of width 16 (``flow_layers=2, nn_width=16``; the defaults
  are 8 and 50), ``show_progress=False``, and the untrained flow is returned too; plotting
  (cells 10, 12) left out.

stanford-crfm/haliax at f41e7d40c63dc486b69c5d854270a9158fe3dd39:

- README.md, "Example: Attention": as written, the axes' sizes cut (``position`` 1024 -> 6,
  ``head`` 8 -> 2, ``key`` 64 -> 4, ``embed`` 512 -> 8); ``import haliax`` added, which the
  README's ``haliax.nn.softmax`` needs; ours: haliax imported under a filter of the one
  DeprecationWarning it raises (``jax.experimental.shard_map``).

e3nn/e3nn-jax at 04e761c8e9a42c339cc712fb8b9af85ddd618eab:

- examples/tetris_point.py: ``tetris``, ``Layer`` and ``Model`` as written (``train`` and
  its timing left out).

patrick-kidger/jaxtyping at f4083b20aed1e41355041331ebfa5dc109c1c851:

- jaxtyping/_decorator.py, ``jaxtyped``'s docstring: ``batch_outer_product`` type-checked by
  beartype, its ``torch.Tensor`` read as ``jax.Array`` (``Array as Tensor``).

All four formatted by ``ruff format`` (a comment's space, ``1E9`` as ``1e9``, lines
joined); the code is as written.
"""

# ruff: noqa: B905, E741, F722 - as the authors wrote it (F722: jaxtyping's shape strings)

import warnings

import e3nn_jax as e3nn
import equinox as eqx
import flax
import jax
import jax.numpy as jnp
import jax.random as jr
import jraph
from flowjax.bijections import RationalQuadraticSpline
from flowjax.distributions import Normal
from flowjax.flows import masked_autoregressive_flow
from flowjax.tasks import two_moons
from flowjax.train import fit_to_data
from jaxtyping import Array as Tensor  # the docstring's torch Tensor
from jaxtyping import Float, jaxtyped

with warnings.catch_warnings():  # haliax reads jax.experimental.shard_map, deprecated in jax 0.8
    warnings.filterwarnings("ignore", "jax.experimental.shard_map is deprecated")
    import haliax
    import haliax as hax
    import haliax.nn as hnn

# --- flowjax: docs/examples/unconditional.ipynb ------------------------------------------------


def unconditional(n_samples=10000, max_epochs=None):
    """Cells 4, 6 and 8: the data ``x``, the flow untrained and trained (``fit_to_data``'s own
    epochs where ``max_epochs`` is ``None``), and its losses."""
    rng = jr.key(0)
    x = two_moons(rng, n_samples)
    x = (x - x.mean(axis=0)) / x.std(axis=0)  # Standardize

    key, subkey = jr.split(jr.key(0))
    flow = masked_autoregressive_flow(
        subkey,
        base_dist=Normal(jnp.zeros(x.shape[1])),
        transformer=RationalQuadraticSpline(knots=8, interval=4),
        flow_layers=2,  # cut
        nn_width=16,  # cut
    )
    untrained = flow  # ours

    key, subkey = jr.split(key)
    epochs = {} if max_epochs is None else {"max_epochs": max_epochs}  # cut
    flow, losses = fit_to_data(subkey, flow, x, learning_rate=1e-3, show_progress=False, **epochs)
    return x, untrained, flow, losses


# --- haliax: README.md, Example: Attention -------------------------------------------------------

Pos = hax.Axis("position", 6)  # sequence length
KPos = Pos.alias("key_position")
Head = hax.Axis("head", 2)  # number of attention heads
Key = hax.Axis("key", 4)  # key size
Embed = hax.Axis("embed", 8)  # embedding size

# alternatively:
# Pos, KPos, Head, Key, Embed = hax.make_axes(pos=1024, key_pos=1024, head=8, key=64, embed=512)


def attention_scores(Key, KPos, query, key, mask):
    # how similar is each query to each key
    scores = hax.dot(query, key, axis=Key) / jnp.sqrt(Key.size)

    if mask is not None:
        scores -= 1e9 * (1.0 - mask)

    # convert to probabilities
    scores = haliax.nn.softmax(scores, KPos)
    return scores


def attention(Key, KPos, query, key, value, mask):
    scores = attention_scores(Key, KPos, query, key, mask)
    answers = hax.dot(scores, value, axis=KPos)

    return answers


# Causal Mask means that if pos >= key_pos, then pos can attend to key_pos
causal_mask = hax.arange(Pos).broadcast_axis(KPos) >= hax.arange(KPos)


class Attention(eqx.Module):
    proj_q: hnn.Linear  # [Embed] -> [Head, Key]
    proj_k: hnn.Linear  # [Embed] -> [Head, Key]
    proj_v: hnn.Linear  # [Embed] -> [Head, Key]
    proj_answer: hnn.Linear  # output projection from [Head, Key] -> [Embed]

    @staticmethod
    def init(Embed, Head, Key, *, key):
        k_q, k_k, k_v, k_ans = jax.random.split(key, 4)
        proj_q = hnn.Linear.init(In=Embed, Out=(Head, Key), key=k_q)
        proj_k = hnn.Linear.init(In=Embed, Out=(Head, Key), key=k_k)
        proj_v = hnn.Linear.init(In=Embed, Out=(Head, Key), key=k_v)
        proj_answer = hnn.Linear.init(In=(Head, Key), Out=Embed, key=k_ans)
        return Attention(proj_q, proj_k, proj_v, proj_answer)

    def __call__(self, x, mask=None):
        q = self.proj_q(x)
        # Rename "position" to "key_position" for self attention
        k = self.proj_k(x).rename({"position": "key_position"})
        v = self.proj_v(x).rename({"position": "key_position"})

        answers = attention(Key, KPos, q, k, v, causal_mask)

        x = self.proj_answer(answers)
        return x


# --- e3nn-jax: examples/tetris_point.py ----------------------------------------------------------


def tetris() -> jraph.GraphsTuple:
    pos = [
        [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 1, 0]],  # chiral_shape_1
        [[1, 1, 1], [1, 1, 2], [2, 1, 1], [2, 0, 1]],  # chiral_shape_2
        [[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0]],  # square
        [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 3]],  # line
        [[0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]],  # corner
        [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 0]],  # L
        [[0, 0, 0], [0, 0, 1], [0, 0, 2], [0, 1, 1]],  # T
        [[0, 0, 0], [1, 0, 0], [1, 1, 0], [2, 1, 0]],  # zigzag
    ]
    pos = jnp.array(pos, dtype=jnp.float32)
    labels = jnp.arange(8)

    graphs = []

    for p, l in zip(pos, labels):
        senders, receivers = e3nn.radius_graph(p, 1.1)

        graphs += [
            jraph.GraphsTuple(
                nodes=p.reshape((4, 3)),  # [num_nodes, 3]
                edges=None,
                globals=l[None],  # [num_graphs]
                senders=senders,  # [num_edges]
                receivers=receivers,  # [num_edges]
                n_node=jnp.array([len(p)]),  # [num_graphs]
                n_edge=jnp.array([len(senders)]),  # [num_graphs]
            )
        ]

    return jraph.batch(graphs)


class Layer(flax.linen.Module):
    target_irreps: e3nn.Irreps
    denominator: float
    sh_lmax: int = 3

    @flax.linen.compact
    def __call__(self, graphs, positions):
        target_irreps = e3nn.Irreps(self.target_irreps)

        def update_edge_fn(edge_features, sender_features, receiver_features, globals):
            sh = e3nn.spherical_harmonics(
                list(range(1, self.sh_lmax + 1)),
                positions[graphs.receivers] - positions[graphs.senders],
                True,
            )
            return e3nn.concatenate(
                [sender_features, e3nn.tensor_product(sender_features, sh)]
            ).regroup()

        def update_node_fn(node_features, sender_features, receiver_features, globals):
            node_feats = receiver_features / self.denominator
            node_feats = e3nn.flax.Linear(target_irreps, name="linear_pre")(node_feats)
            node_feats = e3nn.scalar_activation(node_feats)
            node_feats = e3nn.flax.Linear(target_irreps, name="linear_post")(node_feats)
            shortcut = e3nn.flax.Linear(node_feats.irreps, name="shortcut", force_irreps_out=True)(
                node_features
            )
            return shortcut + node_feats

        return jraph.GraphNetwork(update_edge_fn, update_node_fn)(graphs)


class Model(flax.linen.Module):
    @flax.linen.compact
    def __call__(self, graphs):
        positions = e3nn.IrrepsArray("1o", graphs.nodes)
        graphs = graphs._replace(nodes=jnp.ones((len(positions), 1)))

        layers = 2 * ["32x0e + 32x0o + 8x1e + 8x1o + 8x2e + 8x2o"] + ["0o + 7x0e"]

        for irreps in layers:
            graphs = Layer(irreps, 1.5)(graphs, positions)

        # Readout logits
        pred = e3nn.scatter_sum(graphs.nodes.array, nel=graphs.n_node)  # [num_graphs, 1 + 7]
        odd, even1, even2 = pred[:, :1], pred[:, 1:2], pred[:, 2:]
        logits = jnp.concatenate([odd * even1, -odd * even1, even2], axis=1)
        assert logits.shape == (len(graphs.n_node), 8)  # [num_graphs, num_classes]

        return logits


# --- jaxtyping: jaxtyping/_decorator.py, jaxtyped's docstring ------------------------------------

# Use your favourite typechecker: usually one of the two lines below.
from beartype import beartype as typechecker  # noqa: E402


# Type-check a function
@jaxtyped(typechecker=typechecker)
def batch_outer_product(x: Float[Tensor, "b c1"],
                        y: Float[Tensor, "b c2"]
                      ) -> Float[Tensor, "b c1 c2"]:  # fmt: skip
    return x[:, :, None] * y[:, None, :]
