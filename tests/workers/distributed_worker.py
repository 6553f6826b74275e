"""One process of a 2-process ``jax.distributed`` run on localhost (gloo CPU collectives).

Run by ``tests/test_distributed.py``, never collected by pytest::

    python tests/workers/distributed_worker.py PROCESS_ID PORT PROBLEM.npz OUT.npz

``PROBLEM.npz`` holds the problem, written by the test: ``sizes`` (the MLP), ``lr`` (adam),
``steps``, ``x``, ``y`` and the params as ``param_0``, ``param_1``, ... in ``jax.tree.leaves``
order of ``net.init``. Each process trains data-parallel on ``sm.data_mesh()`` (spanning both
processes' devices), runs sharded inference on ``x[:13]``, and saves to ``OUT.npz``: the
trained params (same naming), the per-step losses, the gathered inference rows and
``counts = [process_count, device_count, local_device_count]``.
"""

from __future__ import annotations

import sys

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

import symjax_mlp as sm


def main(process_id: str, port: str, problem_file: str, out_file: str) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id), initialization_timeout=60
    )
    with np.load(problem_file) as f:
        problem = {k: f[k] for k in f.files}
    net, optimizer = sm.mlp(tuple(problem["sizes"].tolist())), optax.adam(float(problem["lr"]))
    x, y = problem["x"], problem["y"]
    treedef = jax.tree.structure(jax.eval_shape(net.init, jax.random.key(0), x[:1]))
    leaves = [problem[f"param_{i}"] for i in range(treedef.num_leaves)]
    variables = jax.tree.unflatten(treedef, leaves)

    mesh = sm.data_mesh()  # spans both processes' devices
    step = sm.training.shard_step(sm.training.train_step(net, optimizer), mesh)
    params, losses = variables["params"], []
    opt_state = jax.jit(optimizer.init)(params)
    for _ in range(int(problem["steps"])):
        params, opt_state, metrics = step(params, opt_state, x, y)
        losses.append(float(metrics["loss"]))
    out = sm.shard(sm.hybridize(net, variables), mesh)(x[:13])

    trained = jax.device_get(jax.tree.leaves({"params": params}))
    res = {f"param_{i}": np.asarray(a) for i, a in enumerate(trained)}
    res["losses"] = np.array(losses)
    res["infer_13"] = multihost_utils.process_allgather(out, tiled=True)
    res["counts"] = np.array([jax.process_count(), jax.device_count(), jax.local_device_count()])
    np.savez(out_file, **res)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
