"""Code we did not write, round twenty (tests/zoo20.py; sources and commit there), over every
feature: hybridize, ``h(x)`` equal to the plain model, its graph, export + load + call equal,
grads/Hessians over the loaded model, a Batcher's answers, and the authors' training.

- image_segmentation.md: the ``UNETR`` (its ViT cut to hidden size 4, two heads, ``mlp_dim``
  8, one channel of 16 x 16 images, one patch; its ten layers kept, as the decoder reads
  the fourth, seventh and tenth; ``feature_size`` 2, three classes) evaluated through
  ``nnx.view(model, deterministic=True)`` over every feature, batch symbolic; three of the
  example's ``train_step`` (``nnx.Optimizer`` of ``optax.adam`` on its linear schedule,
  cross-entropy plus Jaccard loss, a fork of the rngs a step, MLPBlock's dropout from the
  rngs it holds) equal three of the example's ``compute_losses_and_logits`` over
  ``h.apply_with_state`` of the training view, its state carried from step to step.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
import zoo20
from features import close, every_feature
from flax import nnx

import symjax_mlp as sm

pytestmark = pytest.mark.slow  # each a compile of a ten-layer ViT or more (~30 s or more)


def _unetr():
    """The example's UNETR, sizes cut; built once per call from ``nnx.Rngs(0)``."""
    vit = zoo20.ViTConfig(in_channels=1, img_size=16, patch_size=16, num_layers=10,
                          num_heads=2, mlp_dim=8, hidden_size=4)  # fmt: skip
    return zoo20.UNETR(zoo20.ModelConfig(out_channels=3, vit_config=vit, feature_size=2),
                       rngs=nnx.Rngs(0))  # fmt: skip


X = jax.random.normal(jax.random.key(1), (3, 16, 16, 1))
MASKS = jax.random.randint(jax.random.key(2), (3, 16, 16), 0, 3)


def test_unetr_eval_view_every_feature(tmp_path):
    """The UNETR's eval view over every feature, compared with the view under ``jax.jit``
    (the model eager takes most of a minute). JAX's own per-row grads of it, vmapped and row
    by row, differ by 1.5e-4 in float32: ``atol`` 5e-4."""
    eval_model = nnx.view(_unetr(), deterministic=True)
    allow = {"convolution", "dynamic_gather", "real_dynamic_slice", "scatter"}
    ref = jax.jit(lambda r: eval_model(r))
    every_feature(tmp_path, sm.hybridize(eval_model), ref, X, allow=allow, rtol=1e-4, atol=5e-4)


def test_unetr_the_examples_train_steps():
    """Three of the example's ``train_step`` (it donates the model: run on a copy of its
    arrays, as two UNETRs built alike differ, see zoo20) equal three of its
    ``compute_losses_and_logits`` over ``h.apply_with_state`` of the training view, the
    state carried from step to step, each given an ``nnx.Rngs`` of the same fork's key: the
    losses and the weights alike."""
    model = _unetr()
    theirs = nnx.clone(model)
    nnx.update(theirs, jax.tree.map(jnp.copy, nnx.state(theirs)))
    h = sm.hybridize(nnx.view(model, deterministic=False))
    learning_rate, momentum, steps = 0.003, 0.9, 10  # num_epochs * total_steps cut to 10
    tx = optax.adam(optax.linear_schedule(learning_rate, 0.0, steps), momentum)
    params, state, opt = h.params, h.state, tx.init(h.params)

    def loss(p, s, key):
        def apply(images, rngs):
            logits, apply.state = h.apply_with_state(p, s, images, rngs=rngs)
            return logits

        value, _ = zoo20.compute_losses_and_logits(apply, X, MASKS, nnx.Rngs(key))
        return value, apply.state

    optimizer = nnx.Optimizer(theirs, tx, wrt=nnx.Param)
    ours_rngs, their_rngs, ours, want = nnx.Rngs(12), nnx.Rngs(12), [], []
    for _ in range(3):
        key = ours_rngs.fork().default.key[...]
        (value, state), grads = jax.value_and_grad(loss, has_aux=True)(params, state, key)
        updates, opt = tx.update(grads, opt, params)
        params = optax.apply_updates(params, updates)
        ours.append(value)
        train_view = nnx.view(theirs, deterministic=False)
        want.append(zoo20.unetr_train_step(train_view, optimizer, their_rngs, (X, MASKS))[0])
    close(ours, want)
    want = nnx.to_pure_dict(nnx.state(theirs, nnx.Param))
    # encoder1's 1x1 kernel of one channel feeds an InstanceNorm, which cancels its scale:
    # its true grad is 0, both sides' are rounding (1e-8, apart by 1e-9), and adam makes
    # each such step one of about the learning rate: that kernel is compared within 3 steps.
    noise = [p["encoder1"]["layer"]["conv_norm3"]["layers"].pop(0) for p in (params, want)]
    close(*noise, rtol=0, atol=3 * learning_rate)
    close(params, want)
