"""Code we did not write, round thirty-four: OTT-JAX's input convex neural network as its
neural dual builds it, for tests/test_authors_round34.py (ott-jax 0.6.0 from the package
index, which is ott-jax/ott at 6aace50f673b877cc3394d0b53a24da0bbf11308 but for plot.py, as
tests/zoo24.py records).

- src/ott/neural/methods/neuraldual.py, ``W2NeuralDual.__init__``: its default potentials,
  the two lines ``neural_f = icnn.ICNN(dim_data=dim_data, dim_hidden=[64, 64, 64, 64])`` and
  ``neural_g = ...`` as written, in ``default_potentials`` (ours: a function holding them, so
  the tests build the networks without training the dual); ``icnn.ICNN`` itself (its
  ``__call__`` ends in ``z.squeeze()``) and ``BasePotential.potential_gradient_fn`` (the
  transport map, ``jax.vmap(jax.grad(...))``) are ott's, imported.

google-research/scenic (not installed; scenic's DETR is tests/zoo22.py's):

- scenic/model_lib/matchers/common.py at 0cce82dbc32df69b6017021cc2992b3f82248a05:
  ``slicer`` and ``cpu_matcher`` (scipy's matching in ``jax.pure_callback`` under a
  ``jax.custom_vjp`` of no gradient) as written;
- scenic/model_lib/matchers/hungarian.py at 0820cbfa0c9c24c698423ad6f7b45c51410c5c25:
  ``hungarian_matcher`` as written (its ``from scenic...common import cpu_matcher`` is the
  function above).

Ours: the import under a filter of the DeprecationWarning importing jaxopt (an ott dependency)
raises.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import scipy.optimize as sciopt

with warnings.catch_warnings():  # jaxopt, which ott imports, warns it is unmaintained
    warnings.filterwarnings("ignore", "JAXopt is no longer maintained", DeprecationWarning)
    from ott.neural.networks import icnn


def default_potentials(dim_data):
    neural_f = icnn.ICNN(dim_data=dim_data, dim_hidden=[64, 64, 64, 64])
    neural_g = icnn.ICNN(dim_data=dim_data, dim_hidden=[64, 64, 64, 64])
    return neural_f, neural_g


# --- scenic: scenic/model_lib/matchers/common.py --------------------------------------------


def slicer(cost, n_present_col, matching_fn):
    """Maps matching_fn over examples after removing padding to speed up matching.

    Args:
      cost: Cost matrix or batch of cost matrices with any number of batch
        dimensions. Requires n_row >= n_col.
      n_present_col: Number of non-padding columns of the cost matrices, or None
        if padding should not be removed.
      matching_fn: A matching function that operates on a single cost matrix.

    Returns:
      Matchings of shape [batch, 2, n_col].

    Raises:
      ValueError if n_row < n_col and n_present_col is not None.
    """
    batch_shape = cost.shape[:-2]
    cost = cost.reshape(-1, *cost.shape[-2:])

    if n_present_col is None:
        matches = np.stack([matching_fn(c) for c in cost])
        return matches.reshape(*batch_shape, *matches.shape[1:])

    n_present_col = n_present_col.reshape(-1)
    assert cost.shape[:1] == n_present_col.shape, (
        cost.shape,
        n_present_col.shape,
    )

    batch, n_row, n_col = cost.shape
    if n_row < n_col:
        raise ValueError(f"Slicer requires that n_row ({n_row}) >= n_col ({n_col}).")

    eye = np.eye(n_row, dtype=bool)
    matches = []
    for i in range(batch):
        present_col = max(n_present_col[i], 1)  # One col even if all are padded.
        cost_m = cost[i, :, :present_col]  # Slicing should avoid a copy.

        row, col = matching_fn(cost_m)

        # Add padded matches (if padding was done correctly these can be random).
        unmatched_row = np.where(~eye[row].max(axis=0))[0]  # Faster than setdiff1d.
        unmatched_row = unmatched_row.astype(np.int32)
        unmatched_col = np.arange(present_col, n_col, dtype=np.int32)

        # Assume n_row >= n_col >= n_present_col.
        n_common = n_col - present_col
        unmatched_row = unmatched_row[:n_common]

        # Reconstruct the matching.
        row = np.concatenate([row, unmatched_row], axis=0)
        col = np.concatenate([col, unmatched_col], axis=0)

        matches.append(np.stack([row, col], axis=0))

    matches = np.stack(matches)

    return matches.reshape(*batch_shape, *matches.shape[1:])


def cpu_matcher(matching_fn):
    """Wraps matching function to be usable within jitted functions.

    Args:
      matching_fn: function; A matching function that aligns the predictions of
        the model with targets.

    Returns:
      Matching function with host callback that can be jitted.
    """

    # The callback function can only take a single argument.
    def slice_and_match(args):
        cost, ncol = args
        return slicer(cost, ncol, matching_fn)

    @jax.custom_vjp
    def matching_fn_hcb(cost, n_cols=None):
        *b, n, m = cost.shape
        return jax.pure_callback(
            slice_and_match,
            jax.ShapeDtypeStruct(b + [2, min(n, m)], jnp.int32),  # noqa: RUF005 - as written
            (cost, n_cols),
            vmap_method="broadcast_all",
        )

    # Define forward and backward passes.
    def matching_fn_hcb_vjp_fwd(cost, n_cols):
        return matching_fn_hcb(cost, n_cols), None

    def matching_fn_hcb_vjp_bwd(*_):
        return (None, None)  # Return no gradient.

    matching_fn_hcb.defvjp(matching_fn_hcb_vjp_fwd, matching_fn_hcb_vjp_bwd)

    # Note: When called from TPU, errors in the callback will NOT cause the code
    # to fail, but will produce nonsensical matching outputs. Test the callback
    # carefully with jax.jit(callback, backend='cpu') first.
    return matching_fn_hcb


# --- scenic: scenic/model_lib/matchers/hungarian.py -----------------------------------------


@cpu_matcher
def hungarian_matcher(cost):
    """Computes Hungarian Matching given a single cost matrix.

    Relevant DETR code:
    https://github.com/facebookresearch/detr/blob/647917626d5017e63c1217b99537deb2dcb370d6/models/matcher.py#L35

    Args:
      cost: Matching cost matrix of shape [N, M].

    Returns:
      Array of shape [min(N, M), 2] where each row contains a matched pair of
      indices into the rows (N) and columns (M) of the cost matrix.
    """
    # Matrix is transposed to maintain the convention of other matchers:
    col_ind, row_ind = sciopt.linear_sum_assignment(cost.T)
    return np.stack([row_ind, col_ind]).astype(np.int32)
