"""Writes one release's golden files for ``tests/test_day_seven.py``; never collected by pytest.

    git worktree add /tmp/wt-0.16 c8de88c   # the release's commit
    python tests/data/releases/write_release.py /tmp/wt-0.16 tests/data/releases/0.16.0 KEY.pem

runs that worktree's ``symjax_mlp`` (not the one installed: the venv's editable finder is taken
off ``sys.meta_path``) with this environment's JAX, and writes into the output directory:
``mlp`` (signed with the P-256 private key KEY.pem, whose public half must be ``pub.pem``
here), ``two``, ``strong``, ``weak`` and ``tolerance`` where that release could export them,
``ckpt`` (a one-process run's two checkpoints) and ``orbax`` (a two-process run's last Orbax
checkpoint), dated by ``SOURCE_DATE_EPOCH`` (default: 2026-12-07, when they were written), compiled
with the test suite's XLA flags (:data:`XLA_FLAGS`: the checkpoints' values depend on them).
The models, data and inputs are defined here once; the test imports them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np

RUN = {"epochs": 2, "batch_size": 8, "blocks": 2}  # both runs' settings
# tests/conftest.py's: XLA compiles the runs as the test's resumed run, bit for bit alike
XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def data():
    """The run's data, exact in float32 (no RNG stream, no libm): 16 rows to train on, 8 to test."""
    import symjax_mlp as sm

    xs = ((np.arange(96) * 37 % 19 - 9) / 4).astype(np.float32).reshape(24, 4)
    ys = (xs[:, 0] > 0).astype(np.int32) + (xs[:, 1] > 0).astype(np.int32)
    return sm.training.Dataset(xs[:16], ys[:16], xs[16:], ys[16:], num_classes=3, name="tiny")


def two():
    """A BatchNorm model of two inputs ``(x (b, 4), z (b, 1))``."""
    import flax.linen as nn

    class Two(nn.Module):
        @nn.compact
        def __call__(self, x, z, train: bool = False):
            y = nn.Dense(6)(x)
            y = nn.BatchNorm(use_running_average=not train, momentum=0.5)(y)
            return nn.Dense(2)(nn.relu(y)) * z

    return Two()


def scalar(p, x, s):
    """A bfloat16 weight times a scalar input: the answer's dtype follows the scalar's weak type."""
    return p["w"] * s, x * s


def _use(worktree: str) -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f)]
    sys.path.insert(0, worktree)
    import symjax_mlp

    assert symjax_mlp.__file__.startswith(worktree), symjax_mlp.__file__


def _exports(out: Path, key: str) -> None:
    import jax
    import jax.numpy as jnp

    import symjax_mlp as sm

    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    net = sm.mlp((8, 3))
    h = sm.hybridize(net, net.init(jax.random.key(0), jnp.asarray(x)))
    sm.export(h, out / "mlp", example=x)
    sm.sign(out / "mlp", key)
    z = np.array([[1.0], [2.0], [-0.5]], np.float32)
    model = two()
    v = model.init(jax.random.key(1), x, z)
    _, moved = model.apply(v, x * 3 + 1, z, train=True, mutable=["batch_stats"])
    sm.export(sm.hybridize(model, {**v, **moved}), out / "two", example=(x, z),
              kwargs={"train": False})  # fmt: skip
    hs = sm.hybridize(scalar, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    s = np.ones((2, 3), np.float32)
    sm.export(hs, out / "strong", example=(s, np.float32(1.5)), batch=None)
    for name, write in (
        ("weak", lambda: sm.export(hs, out / "weak", example=(s, jnp.asarray(1.5)), batch=None)),
        ("tolerance", lambda: sm.export(h, out / "tolerance", example=x, self_test_tolerance=1e-3)),
    ):
        try:
            write()
        except (TypeError, sm.SymjaxError) as e:  # not in that release, or it failed there
            print(f"{name}: not written ({type(e).__name__}: {str(e)[:200]})")
    sm.training.train(sm.mlp((8, 3)), data(), checkpoint=out / "ckpt", **RUN)


def _orbax_process(process_id: int, port: str, checkpoint: str) -> None:
    import symjax_mlp as sm

    sm.training.initialize(f"127.0.0.1:{port}", 2, process_id, timeout=60)
    sm.training.train(sm.mlp((8, 3)), data(), checkpoint=checkpoint, **RUN)


def main() -> None:
    worktree, out = sys.argv[1], Path(sys.argv[2]).resolve()
    os.environ.setdefault("SOURCE_DATE_EPOCH", "1796601600")
    os.environ["XLA_FLAGS"] = " ".join(XLA_FLAGS)  # before JAX starts, for the orbax run too
    if sys.argv[3] == "--orbax-process":
        _use(worktree)
        return _orbax_process(int(sys.argv[4]), sys.argv[5], str(out))
    _use(worktree)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    _exports(out, sys.argv[3])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="1")
    cmd = [sys.executable, __file__, worktree, str(out / "orbax"), "--orbax-process"]
    procs = [subprocess.Popen([*cmd, str(i), port], env=env) for i in range(2)]
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    steps = sorted(
        (p for p in (out / "orbax").iterdir() if p.name.isdigit()), key=lambda p: int(p.name)
    )
    for step in steps[:-1]:  # the last step is the one a user keeps
        shutil.rmtree(out / "orbax" / str(step))
    print("wrote", sorted(p.name for p in out.iterdir()))


if __name__ == "__main__":
    main()
