"""One process of a multi-process ``sm.training.train`` run on localhost, for the fault tests.

Run by ``tests/test_multiprocess.py``, never collected by pytest::

    python tests/workers/multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT.npz [options]

It trains a small MLP on a fixed synthetic problem (:func:`problem`, also what the test trains
in one process) and saves the trained params as ``param_0, param_1, ...`` (``jax.tree.leaves``
order), ``step``, ``resumed_step`` (-1: a fresh start) and ``checkpoint_waits`` to
``OUT.npz``. Options: ``--checkpoint DIR``, ``--resume``, ``--init-from DIR``, ``--epochs N``,
``--seed S``, ``--blocks B``, ``--timeout S``; faults: ``--kill-after-save EPOCH`` (SIGKILL
itself while that epoch's asynchronous save is still being written, once an earlier one is
committed),
``--stall-after EPOCH`` (sleeps an hour after that epoch), ``--committing`` (this process's
Orbax says a save is always committing: only process 0's answer may decide a save).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

SIZES, LR, BATCH = (16, 4), 1e-2, 32


def problem():
    """A fixed classification problem: 256 training rows of 12 features, 4 classes."""
    import symjax_mlp as sm

    rng = np.random.default_rng(0)
    x = rng.normal(size=(320, 12)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(12, 4)), axis=1).astype(np.int32)
    return sm.training.Dataset(x[:256], y[:256], x[256:], y[256:], num_classes=4, name="toy")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("process_id", type=int)
    p.add_argument("num_processes", type=int)
    p.add_argument("port")
    p.add_argument("out")
    p.add_argument("--checkpoint")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--init-from")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--blocks", type=int)
    p.add_argument("--timeout", type=int, default=15)
    p.add_argument("--kill-after-save", type=int)
    p.add_argument("--stall-after", type=int)
    p.add_argument("--committing", action="store_true")
    args = p.parse_args()

    import jax
    import optax
    import orbax.checkpoint as ocp

    import symjax_mlp as sm

    if args.committing:
        ocp.CheckpointManager.is_saving_in_progress = lambda self: True

    sm.training.initialize(
        f"127.0.0.1:{args.port}", args.num_processes, args.process_id, timeout=args.timeout
    )

    def on_epoch(record) -> None:
        if record.epoch == args.kill_after_save:  # its save was started, not yet committed
            deadline = time.monotonic() + 30  # an earlier one committed (Orbax renamed it)
            while time.monotonic() < deadline and not any(
                p.name.isdigit() for p in Path(args.checkpoint).iterdir()
            ):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if record.epoch == args.stall_after:
            time.sleep(3600)

    result = sm.training.train(
        sm.mlp(SIZES),
        problem(),
        optimizer=optax.adam(LR),
        epochs=args.epochs,
        batch_size=BATCH,
        seed=args.seed,
        blocks=args.blocks,
        checkpoint=args.checkpoint,
        resume=args.resume,
        init_from=args.init_from,
        on_epoch=on_epoch,
    )
    out = {f"param_{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(result.params))}
    resumed = -1 if result.resumed_from is None else int(result.resumed_from.name)
    np.savez(
        args.out,
        step=result.step,
        resumed_step=resumed,
        checkpoint_waits=np.array(result.checkpoint_waits),
        superseded=np.array(result.checkpoints_superseded, dtype=np.int64),
        step_seconds=sum(r.seconds for r in result.history) / max(result.step, 1),
        **out,
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
