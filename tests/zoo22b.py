"""Code we did not write, round twenty-two (b): Flax's ogbg_molpcba example's graph networks,
as their authors wrote them (sizes cut by the tests), for tests/test_authors_round22.py.

google/flax at 18f8f311c275d57f46d95e41b15aa97b454754c0:

- examples/ogbg_molpcba/models.py, whole: ``add_graphs_tuples``, ``MLP``, ``GraphNet`` and
  ``GraphConvNet`` (over jraph 0.0.6.dev0's ``GraphsTuple``, ``GraphNetwork``,
  ``GraphConvolution``, ``GraphMapFeatures``).
- examples/ogbg_molpcba/train.py: ``binary_cross_entropy_with_mask``, ``replace_globals``,
  ``get_predicted_logits``, ``get_valid_mask`` and ``train_step`` (its ``@jax.jit`` kept; the
  clu ``TrainMetrics`` it returns left out, clu being no dependency here: it returns the
  state and the mean loss). Left out: the input pipeline (TFDS ogbg_molpcba), the metrics,
  the evaluation and the training loop.
"""

# ruff: noqa: RUF059 - the authors' code, as written

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import jraph
from flax import linen as nn
from flax.training import train_state


def add_graphs_tuples(
    graphs: jraph.GraphsTuple, other_graphs: jraph.GraphsTuple
) -> jraph.GraphsTuple:
    """Adds the nodes, edges and global features from other_graphs to graphs."""
    return graphs._replace(
        nodes=graphs.nodes + other_graphs.nodes,  # pyrefly: ignore[unsupported-operation]
        edges=graphs.edges + other_graphs.edges,  # pyrefly: ignore[unsupported-operation]
        globals=graphs.globals + other_graphs.globals,  # pyrefly: ignore[unsupported-operation]
    )


class MLP(nn.Module):
    """A multi-layer perceptron."""

    feature_sizes: Sequence[int]
    dropout_rate: float = 0
    deterministic: bool = True
    activation: Callable[[jnp.ndarray], jnp.ndarray] = nn.relu

    @nn.compact
    def __call__(self, inputs):
        x = inputs
        for size in self.feature_sizes:
            x = nn.Dense(features=size)(x)
            x = self.activation(x)
            x = nn.Dropout(rate=self.dropout_rate, deterministic=self.deterministic)(x)
        return x


class GraphNet(nn.Module):
    """A complete Graph Network model defined with Jraph."""

    latent_size: int
    num_mlp_layers: int
    message_passing_steps: int
    output_globals_size: int
    dropout_rate: float = 0
    skip_connections: bool = True
    use_edge_model: bool = True
    layer_norm: bool = True
    deterministic: bool = True

    @nn.compact
    def __call__(self, graphs: jraph.GraphsTuple) -> jraph.GraphsTuple:
        # We will first linearly project the original features as 'embeddings'.
        embedder = jraph.GraphMapFeatures(
            embed_node_fn=nn.Dense(self.latent_size),
            embed_edge_fn=nn.Dense(self.latent_size),
            embed_global_fn=nn.Dense(self.latent_size),
        )
        processed_graphs = embedder(graphs)

        # Now, we will apply a Graph Network once for each message-passing round.
        mlp_feature_sizes = [self.latent_size] * self.num_mlp_layers
        for _ in range(self.message_passing_steps):
            if self.use_edge_model:
                update_edge_fn = jraph.concatenated_args(
                    MLP(
                        mlp_feature_sizes,
                        dropout_rate=self.dropout_rate,
                        deterministic=self.deterministic,
                    )
                )
            else:
                update_edge_fn = None

            update_node_fn = jraph.concatenated_args(
                MLP(
                    mlp_feature_sizes,
                    dropout_rate=self.dropout_rate,
                    deterministic=self.deterministic,
                )
            )
            update_global_fn = jraph.concatenated_args(
                MLP(
                    mlp_feature_sizes,
                    dropout_rate=self.dropout_rate,
                    deterministic=self.deterministic,
                )
            )

            graph_net = jraph.GraphNetwork(
                update_node_fn=update_node_fn,  # pyrefly: ignore[bad-argument-type]
                update_edge_fn=update_edge_fn,  # pyrefly: ignore[bad-argument-type]
                update_global_fn=update_global_fn,  # pyrefly: ignore[bad-argument-type]
            )

            if self.skip_connections:
                processed_graphs = add_graphs_tuples(graph_net(processed_graphs), processed_graphs)
            else:
                processed_graphs = graph_net(processed_graphs)

            if self.layer_norm:
                processed_graphs = processed_graphs._replace(
                    nodes=nn.LayerNorm()(processed_graphs.nodes),
                    edges=nn.LayerNorm()(processed_graphs.edges),
                    globals=nn.LayerNorm()(processed_graphs.globals),
                )

        # Since our graph-level predictions will be at globals, we will
        # decode to get the required output logits.
        decoder = jraph.GraphMapFeatures(embed_global_fn=nn.Dense(self.output_globals_size))
        processed_graphs = decoder(processed_graphs)

        return processed_graphs


class GraphConvNet(nn.Module):
    """A Graph Convolution Network + Pooling model defined with Jraph."""

    latent_size: int
    num_mlp_layers: int
    message_passing_steps: int
    output_globals_size: int
    dropout_rate: float = 0
    skip_connections: bool = True
    layer_norm: bool = True
    deterministic: bool = True
    pooling_fn: Callable[
        [
            jnp.ndarray,
            jnp.ndarray,
            jnp.ndarray,
        ],  # pytype: disable=annotation-type-mismatch  # jax-ndarray
        jnp.ndarray,
    ] = jraph.segment_mean  # pyrefly: ignore[bad-assignment]

    def pool(self, graphs: jraph.GraphsTuple) -> jraph.GraphsTuple:
        """Pooling operation, taken from Jraph."""

        # Equivalent to jnp.sum(n_node), but JIT-able.
        sum_n_node = graphs.nodes.shape[0]  # pytype: disable=attribute-error  # jax-ndarray
        # To aggregate nodes from each graph to global features,
        # we first construct tensors that map the node to the corresponding graph.
        # Example: if you have `n_node=[1,2]`, we construct the tensor [0, 1, 1].
        n_graph = graphs.n_node.shape[0]
        node_graph_indices = jnp.repeat(
            jnp.arange(n_graph),
            graphs.n_node,
            axis=0,
            total_repeat_length=sum_n_node,
        )
        # We use the aggregation function to pool the nodes per graph.
        pooled = self.pooling_fn(
            graphs.nodes, node_graph_indices, n_graph
        )  # pytype: disable=wrong-arg-types  # jax-ndarray
        return graphs._replace(globals=pooled)

    @nn.compact
    def __call__(self, graphs: jraph.GraphsTuple) -> jraph.GraphsTuple:
        # We will first linearly project the original node features as 'embeddings'.
        embedder = jraph.GraphMapFeatures(embed_node_fn=nn.Dense(self.latent_size))
        processed_graphs = embedder(graphs)

        # Now, we will apply the GCN once for each message-passing round.
        for _ in range(self.message_passing_steps):
            mlp_feature_sizes = [self.latent_size] * self.num_mlp_layers
            update_node_fn = jraph.concatenated_args(
                MLP(
                    mlp_feature_sizes,
                    dropout_rate=self.dropout_rate,
                    deterministic=self.deterministic,
                )
            )
            graph_conv = jraph.GraphConvolution(
                update_node_fn=update_node_fn,
                add_self_edges=True,  # pyrefly: ignore[bad-argument-type]
            )

            if self.skip_connections:
                processed_graphs = add_graphs_tuples(graph_conv(processed_graphs), processed_graphs)
            else:
                processed_graphs = graph_conv(processed_graphs)

            if self.layer_norm:
                processed_graphs = processed_graphs._replace(
                    nodes=nn.LayerNorm()(processed_graphs.nodes),
                )

        # We apply the pooling operation to get a 'global' embedding.
        processed_graphs = self.pool(processed_graphs)

        # Now, we decode this to get the required output logits.
        decoder = jraph.GraphMapFeatures(embed_global_fn=nn.Dense(self.output_globals_size))
        processed_graphs = decoder(processed_graphs)

        return processed_graphs


# --- examples/ogbg_molpcba/train.py ---


def binary_cross_entropy_with_mask(*, logits: jnp.ndarray, labels: jnp.ndarray, mask: jnp.ndarray):
    """Binary cross entropy loss for unnormalized logits, with masked elements."""
    assert logits.shape == labels.shape == mask.shape
    assert len(logits.shape) == 2

    # To prevent propagation of NaNs during grad().
    # We mask over the loss for invalid targets later.
    labels = jnp.where(mask, labels, -1)

    # Numerically stable implementation of BCE loss.
    # This mimics TensorFlow's tf.nn.sigmoid_cross_entropy_with_logits().
    positive_logits = logits >= 0
    relu_logits = jnp.where(positive_logits, logits, 0)
    abs_logits = jnp.where(positive_logits, logits, -logits)
    return relu_logits - (logits * labels) + (jnp.log(1 + jnp.exp(-abs_logits)))


def replace_globals(graphs: jraph.GraphsTuple) -> jraph.GraphsTuple:
    """Replaces the globals attribute with a constant feature for each graph."""
    return graphs._replace(globals=jnp.ones([graphs.n_node.shape[0], 1]))


def get_predicted_logits(
    state: train_state.TrainState,
    graphs: jraph.GraphsTuple,
    rngs: dict[str, jnp.ndarray] | None,
) -> jnp.ndarray:
    """Get predicted logits from the network for input graphs."""
    pred_graphs = state.apply_fn(state.params, graphs, rngs=rngs)
    logits = pred_graphs.globals
    return logits


def get_valid_mask(labels: jnp.ndarray, graphs: jraph.GraphsTuple) -> jnp.ndarray:
    """Gets the binary mask indicating only valid labels and graphs."""
    # We have to ignore all NaN values - which indicate labels for which
    # the current graphs have no label.
    labels_mask = ~jnp.isnan(labels)

    # Since we have extra 'dummy' graphs in our batch due to padding, we want
    # to mask out any loss associated with the dummy graphs.
    # Since we padded with `pad_with_graphs` we can recover the mask by using
    # get_graph_padding_mask.
    graph_mask = jraph.get_graph_padding_mask(graphs)

    # Combine the mask over labels with the mask over graphs.
    return labels_mask & graph_mask[:, None]  # pyrefly: ignore[bad-index, unsupported-operation]


@jax.jit
def train_step(
    state: train_state.TrainState,
    graphs: jraph.GraphsTuple,
    rngs: dict[str, jnp.ndarray],
) -> tuple[train_state.TrainState, jnp.ndarray]:
    """Performs one update step over the current batch of graphs."""

    def loss_fn(params, graphs):
        curr_state = state.replace(params=params)

        # Extract labels.
        labels = graphs.globals

        # Replace the global feature for graph classification.
        graphs = replace_globals(graphs)

        # Compute logits and resulting loss.
        logits = get_predicted_logits(curr_state, graphs, rngs)
        mask = get_valid_mask(labels, graphs)
        loss = binary_cross_entropy_with_mask(logits=logits, labels=labels, mask=mask)
        mean_loss = jnp.sum(jnp.where(mask, loss, 0)) / jnp.sum(mask)

        return mean_loss, (loss, logits, labels, mask)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    (_, (loss, logits, labels, mask)), grads = grad_fn(state.params, graphs)
    state = state.apply_gradients(grads=grads)

    # (clu's TrainMetrics.single_from_model_output(loss=loss, ...) left out)
    return state, jnp.sum(jnp.where(mask, loss, 0)) / jnp.sum(mask)
