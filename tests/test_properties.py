"""Property tests: for random MLPs, eager, hybridized and exported-then-loaded agree.

Hypothesis draws the model (depth 1-6, widths 1-300 with small widths most likely, any
activation of ``sm.ACTIVATIONS`` or none per layer, sometimes a ``HybridConcurrent`` block of
2-3 branches), the batch (1-64) and the dtype (float32 or bfloat16, params included). The
examples are split in two parts, a test each (xdist runs them side by side, in its workers),
each with a fixed seed and no example database, so CI sees the same examples every time. The
strategies, the model builder, the check and the two Hypothesis settings profiles live in
``tests/workers/properties_worker.py``:

- ``ci`` (the default): 16 drawn examples, plus two written ones that between them use every
  activation of ``sm.ACTIVATIONS`` and none (16 draws would not reach them all);
- ``long``, the release run (1000 drawn examples)::

      SYMJAX_PROPERTY_PROFILE=long pytest tests/test_properties.py -n 2

``SYMJAX_PROPERTY_EXAMPLES=N`` sets the number drawn in either.

What "agree" means, per dtype: eager runs op by op and rounds after each op; the compiled
program may fuse ops and keep intermediates at higher precision. So eager and compiled agree
to a tolerance (relative to the output's scale); the loaded artifact runs the same StableHLO
as the Hybrid, compiled by the same XLA, and agrees with it to a tighter one.
"""

import pytest
from workers.properties_worker import EVERY_ACTIVATION, EXAMPLES, PARTS, dense_layers, run

import symjax_mlp as sm


@pytest.mark.parametrize("part", range(PARTS))
def test_eager_hybridized_and_loaded_agree(part, tmp_path):
    written = EVERY_ACTIVATION[part::PARTS]
    seen = run(part, tmp_path)
    assert seen["examples"] == EXAMPLES // PARTS + len(written)
    assert {f"act:{a}" for spec in written for _, a in dense_layers(spec)} <= set(seen), seen
    least = min(seen["float32"], seen["bfloat16"], seen["concurrent"], seen["wide"])
    assert least >= EXAMPLES // PARTS // 20, seen  # every kind of model is drawn, in proportion


def test_the_written_examples_use_every_activation_and_none():
    used = {act for spec in EVERY_ACTIVATION for _, act in dense_layers(spec)}
    assert used == {*sm.ACTIVATIONS, None}
