"""Code we did not write, round twenty-three (b) (tests/zoo23b.py; source and commit there):
JAX MD's FEATURES.md example over every feature.

- ``energy.soft_sphere_pair`` over a periodic box and its ``quantity.force``: over a batch of
  systems (``jax.vmap``, the systems the batch, symbolic) every feature, the energy's and
  the force's; the force is minus the grad of the loaded energy. One system hybridized as
  it is (the particles its leading axis, exported symbolic as any batch): the loaded
  model's forces are JAX MD's for other numbers of particles, and a Batcher never merges two
  systems' particles into one (its rows are not shown independent: each request runs alone).
"""

import jax
import numpy as np
import pytest
from features import close, every_feature

import symjax_mlp as sm

pytestmark = [
    pytest.mark.slow,  # each a compile or more (~1 s or more)
    # JAX MD asks for float64 (util.high_precision_sum, its casts), which JAX in 32 bits (ours)
    # truncates to float32 with this warning; JAX MD's README enables x64 for 64 bits.
    pytest.mark.filterwarnings("ignore:Explicitly requested dtype float64 requested in"),
]

SYSTEMS = 3.0 * jax.random.uniform(jax.random.key(1), (4, 8, 2))


@pytest.fixture(scope="module")
def example():
    """``(R, energy_fn, force_fn)`` of FEATURES.md's example, 8 particles of 2 dimensions in a
    box of side 3 (its density is 1000 in 32 x 32). Imported here, not at collection: JAX MD's
    import takes ~8 s, which the default (fast) selection would pay for no test."""
    import zoo23b

    r, _, energy_fn, force_fn = zoo23b.features_example(N=8, spatial_dimension=2, box_size=3.0)
    return r, energy_fn, force_fn


@pytest.mark.parametrize("quantity", ["energy", "force"])
def test_jax_md_systems_every_feature(tmp_path, example, quantity):
    """The example's energy and force over a batch of systems, ``jax.vmap`` as JAX MD batches
    them; the loaded energy's grad is minus JAX MD's force."""
    _, ENERGY, FORCE = example
    f = jax.vmap({"energy": ENERGY, "force": FORCE}[quantity])
    assert float(np.abs(f(SYSTEMS)).min()) > 0  # the particles overlap: no zero energy
    m = every_feature(tmp_path, sm.hybridize(lambda _, rs: f(rs), {}), f, SYSTEMS)
    if quantity == "energy":
        close(-jax.grad(lambda rs: m(rs).sum())(SYSTEMS[:2]), jax.vmap(FORCE)(SYSTEMS[:2]))


def test_jax_md_one_system_is_served_alone(tmp_path, example):
    """One system's force, its particles the leading axis: exported with that axis symbolic
    (export's default), the loaded model gives JAX MD's forces at 8 and 5 particles; served,
    two requests of 5 and 3 particles get each their own system's forces, never the forces
    of the 8 particles merged, as the module does not show its rows independent."""
    R, _, FORCE = example
    h = sm.hybridize(lambda _, r: FORCE(r), {})
    close(h(R), FORCE(R))
    sm.export(h, tmp_path / "f", example=(R,))
    m = sm.load(tmp_path / "f")
    for r in (R, R[:5]):
        close(m(np.asarray(r)), FORCE(r))
    merged = FORCE(R)
    with sm.serving.Batcher(m, max_batch=8) as b:
        assert b.why_alone  # a reason why each request runs alone (a shape made of rows)
        got = [b.submit(np.asarray(r)) for r in (R[:5], R[5:])]
        got = [g.result(30) for g in got]
    close(got, [FORCE(R[:5]), FORCE(R[5:])])
    assert np.abs(np.concatenate(got) - merged).max() > 1e-3  # merged would differ
