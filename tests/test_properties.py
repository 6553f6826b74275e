"""Property tests: for random MLPs, eager, hybridized and exported-then-loaded agree.

Hypothesis draws the model (depth 1-6, widths 1-300 with small widths most likely, any
activation of ``sm.ACTIVATIONS`` or none per layer, sometimes a ``HybridConcurrent`` block of
2-3 branches), the batch (1-64) and the dtype (float32 or bfloat16, params included). The
examples are split over two processes, each with a fixed seed and no example database, so CI
sees the same examples every time. The strategies, the model builder, the check and the two
Hypothesis settings profiles live in ``tests/workers/properties_worker.py``, which the other
processes run:

- ``ci`` (the default): 16 drawn examples, plus two written ones that between them use every
  activation of ``sm.ACTIVATIONS`` and none (16 draws would not reach them all);
- ``long``, the release run (1000 drawn examples)::

      SYMJAX_PROPERTY_PROFILE=long pytest tests/test_properties.py -n0

``SYMJAX_PROPERTY_EXAMPLES=N`` sets the number drawn in either.

What "agree" means, per dtype: eager runs op by op and rounds after each op; the compiled
program may fuse ops and keep intermediates at higher precision. So eager and compiled agree
to a tolerance (relative to the output's scale); the loaded artifact runs the same StableHLO
as the Hybrid, compiled by the same XLA, and agrees with it to a tighter one.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import STRICT_WARNINGS
from workers.properties_worker import EVERY_ACTIVATION, EXAMPLES, PARTS, run

import symjax_mlp as sm

WORKER = Path(__file__).parent / "workers" / "properties_worker.py"


@pytest.mark.slow
def test_eager_hybridized_and_loaded_agree(tmp_path):
    """Part 0 runs here while parts 1.. run in other processes: the examples are compile-bound
    and one process keeps one core busy."""
    others = [
        subprocess.Popen(
            [sys.executable, *STRICT_WARNINGS, str(WORKER), str(part), str(tmp_path / str(part))],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        for part in range(1, PARTS)
    ]
    try:
        seen = run(0, tmp_path / "0")
        for proc in others:
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, f"a part failed:\n{err[-6000:]}"
            seen.update(json.loads(out.splitlines()[-1]))
    finally:
        for proc in others:
            if proc.poll() is None:  # part 0 failed: stop the others
                proc.kill()
                proc.communicate()
    assert seen["examples"] == EXAMPLES + len(EVERY_ACTIVATION)
    assert {f"act:{a}" for a in (*sm.ACTIVATIONS, None)} <= set(seen), seen
    least = min(seen["float32"], seen["bfloat16"], seen["concurrent"], seen["wide"])
    assert least >= EXAMPLES // 20, seen  # every kind of model is drawn, in proportion
