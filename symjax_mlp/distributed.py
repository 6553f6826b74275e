"""Data parallelism over a device mesh: one XLA program drives every device.

:func:`shard` turns a :class:`~symjax_mlp.Hybrid` into a :class:`Sharded` callable: the batch
is split over the mesh's data axis (``NamedSharding(mesh, P(axis))``), the params are
replicated (``P()``), and the call is a single ``jax.jit`` with those in/out shardings, so the
XLA SPMD partitioner writes the per-device program; there is no Python loop over devices.
:func:`shard_step` does the same for a training step (:func:`symjax_mlp.step.train_step`):
the loss sums over the sharded batch, so XLA inserts the all-reduce of the gradients itself.
Across hosts, call ``jax.distributed.initialize`` first and pass ``data_mesh()``: the same
code runs as one program over every process's devices.

A batch that does not divide by the number of shards is padded and the result trimmed:
inference pads by repeating the last row (outputs must be per-example, with the batch as
leading dimension, which is checked), training pads with weight ``0`` (the weighted loss of
``train_step`` ignores those rows exactly). Pass ``pad=False`` to get a
:class:`~symjax_mlp.SignatureError` instead.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from symjax_mlp.errors import ArtifactError, SignatureError
from symjax_mlp.hybrid import _TRACER_ERRORS, Hybrid, TraceEvent

__all__ = [
    "LoadedSharded",
    "Sharded",
    "ShardedStep",
    "bench_devices",
    "data_mesh",
    "load_sharded",
    "shard",
    "shard_step",
]

CPU_NOTE = (
    "CPU virtual devices share this machine's cores: these rows show correctness (each device "
    "count gives the 1-device result), not how it scales. Run on a multi-GPU/TPU host for scaling."
)


def data_mesh(
    n_devices: int | None = None, *, axis: str = "data", devices: Sequence[Any] | None = None
) -> Mesh:
    """A 1-D mesh ``{axis: n_devices}`` over the first ``n_devices`` devices (default: all).

    Built with ``jax.make_mesh`` in ``Auto`` (GSPMD) mode, so any function runs on it
    unchanged. After ``jax.distributed.initialize`` it spans every process's devices.

    Raises:
      ValueError: fewer than ``n_devices`` devices are visible.

    Example:
      >>> data_mesh(1).shape
      {'data': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if n_devices is None else n_devices
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(devices):
        raise ValueError(
            f"data_mesh({n_devices!r}): JAX sees {len(devices)} device(s), so n_devices must "
            f"be 1..{len(devices)}. For more CPU devices, start the process with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (or call "
            'jax.config.update("jax_num_cpu_devices", N)) before JAX initializes.'
        )
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:n])


def _auto(mesh: Mesh) -> Mesh:
    """``mesh`` with Auto axes: GSPMD partitions any function, where Explicit axes would
    reject some (e.g. trimming a padded batch)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def _shardings(mesh: Mesh | None, axis: str) -> tuple[Mesh, NamedSharding, NamedSharding, int]:
    mesh = data_mesh(axis=axis) if mesh is None else mesh
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a jax.sharding.Mesh (see data_mesh()); got {type(mesh)}.")
    if axis not in mesh.axis_names:
        raise ValueError(
            f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}; pass axis= one of "
            f"{mesh.axis_names}."
        )
    mesh = _auto(mesh)
    return mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P(axis)), mesh.shape[axis]


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Puts ``x`` (the global value) on ``sharding``; each process places only its shards."""
    if isinstance(x, jax.Array):
        if x.sharding == sharding:  # not just equivalent: the mesh is part of the jit key
            return x
        if jax.process_count() == 1 or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _batch_size(arrays: Sequence[Any], caller: str) -> int:
    sizes = []
    for i, a in enumerate(arrays):
        shape = np.shape(a)
        if not shape:
            raise SignatureError(
                f"{caller}: args[{i}] is a scalar; every input needs the batch as its leading "
                "dimension to be split over the mesh."
            )
        sizes.append(shape[0])
    if len(set(sizes)) > 1:
        raise SignatureError(
            f"{caller}: the inputs' leading (batch) dimensions differ: {sizes}. Every input "
            "must have the same batch size."
        )
    return sizes[0] if sizes else 0


def _pad(x: Any, pad: int, *, fill: float | None = None) -> Any:
    """Appends ``pad`` rows: copies of the last row, or ``fill``."""
    if pad == 0:
        return x
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.asarray(x)
    if fill is None:
        rows = xp.repeat(x[-1:], pad, axis=0)
    else:
        rows = xp.full((pad, *x.shape[1:]), fill, x.dtype)
    return xp.concatenate([x, rows])


def _padding(batch: int, n: int, pad: bool, caller: str) -> int:
    extra = -batch % n
    if extra and not pad:
        raise SignatureError(
            f"{caller}: batch {batch} does not divide over {n} shards. Pass a batch that is a "
            f"multiple of {n} (e.g. {batch + extra}), or shard with pad=True to pad and trim."
        )
    return extra


class Sharded:
    """A :class:`~symjax_mlp.Hybrid` run data-parallel: batch split over a mesh axis.

    Create one with :func:`shard` (or ``h.shard(mesh)``). ``s(x)`` places ``x`` with
    ``NamedSharding(mesh, P(axis))`` and runs one ``jax.jit`` compiled with in/out shardings;
    the params were replicated once, at construction. Traces are counted as on a Hybrid.

    Attributes:
      hybrid: the unsharded :class:`~symjax_mlp.Hybrid`.
      mesh, axis: where the batch is split; ``n_shards`` is ``mesh.shape[axis]``.
      pad: pad an indivisible batch (repeating its last row) and trim the result.
      params: the replicated params (a pytree of global ``jax.Array``).
    """

    def __init__(
        self, h: Hybrid, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True
    ):
        if not isinstance(h, Hybrid):
            raise TypeError(
                f"shard() expects a Hybrid; got {type(h).__name__}. Write "
                "shard(sm.hybridize(model, variables), mesh)."
            )
        self.hybrid = h
        self.mesh, self.replicated, self.batch_sharding, self.n_shards = _shardings(mesh, axis)
        self.axis, self.pad, self.name, self.fn = axis, pad, h.name, h.fn
        self._twin = h.hybridize(True)  # own trace log, shared callbacks
        self._leaves = [_place(leaf, self.replicated) for leaf in h._leaves]
        self.params = jax.tree.unflatten(h._treedef, self._leaves)
        self._jitted = jax.jit(
            self._run,
            in_shardings=(self.replicated, self.batch_sharding),
            out_shardings=self.batch_sharding,
        )

    def _run(self, leaves: list[jax.Array], inputs: tuple[jax.Array, ...]) -> Any:
        out = self._twin._trace(leaves, *inputs)
        batch = inputs[0].shape[0]
        for path, leaf in jax.tree_util.tree_leaves_with_path(out):
            if leaf.ndim == 0 or leaf.shape[0] != batch:
                raise SignatureError(
                    f"{self.name}: output out{jax.tree_util.keystr(path)} has shape "
                    f"{leaf.shape}, but a sharded call needs per-example outputs with the batch "
                    f"({batch}) as leading dimension. Reduce over the batch after the call."
                )
        return out

    def _prepare(self, inputs: tuple[Any, ...]) -> tuple[int, tuple[jax.Array, ...]]:
        caller = f"{self.name}.shard(...)"
        if not inputs:
            raise SignatureError(f"{caller}: needs at least one batched input.")
        batch = _batch_size(inputs, caller)
        extra = _padding(batch, self.n_shards, self.pad, caller)
        return batch, tuple(_place(_pad(x, extra), self.batch_sharding) for x in inputs)

    def __call__(self, *inputs: jax.typing.ArrayLike) -> Any:
        """Runs the sharded program; the result has the unpadded batch."""
        batch, placed = self._prepare(inputs)
        try:
            out = self._jitted(self._leaves, placed)
        except _TRACER_ERRORS as e:
            raise self._twin._control_flow_error(e) from e
        if placed[0].shape[0] == batch:
            return out
        return jax.tree.map(lambda y: y[:batch], out)

    def lower(self, *inputs: jax.typing.ArrayLike) -> jax.stages.Lowered:
        """Lowers for ``inputs`` (padded as a call would be); one SPMD module for all devices."""
        return self._jitted.lower(self._leaves, self._prepare(inputs)[1])

    def compile(self, *inputs: jax.typing.ArrayLike) -> jax.stages.Compiled:
        """Lowers and compiles; ``.as_text()`` shows the partitioned per-device HLO."""
        return self.lower(*inputs).compile()

    @property
    def trace_count(self) -> int:
        """How many times the sharded program was traced (once per padded input signature)."""
        return self._twin.trace_count

    @property
    def trace_log(self) -> tuple[TraceEvent, ...]:
        """One :class:`~symjax_mlp.TraceEvent` per trace of the sharded program, oldest first."""
        return self._twin.trace_log

    def export(
        self,
        path: str | os.PathLike[str],
        *,
        example: Any,
        batch: str | None = "b",
        platforms: Sequence[str] = ("cpu",),
        overwrite: bool = False,
    ):
        """Exports the sharded program with :func:`symjax_mlp.export`; it records the mesh.

        The exported function carries sharding constraints (batch over ``axis``, params
        replicated), so ``jax.export`` records ``nr_devices = mesh.size`` in the manifest.
        Run it with :func:`load_sharded` on a mesh of exactly that many devices; any batch
        size works there (XLA pads uneven shards inside the program).

        Returns:
          The :class:`~symjax_mlp.Artifact`.
        """
        from symjax_mlp.export import export

        fn, rep, dat = self.fn, self.replicated, self.batch_sharding

        def sharded(params: Any, *inputs: jax.Array) -> Any:
            params = jax.lax.with_sharding_constraint(params, rep)
            inputs = jax.lax.with_sharding_constraint(inputs, dat)
            return jax.lax.with_sharding_constraint(fn(params, *inputs), dat)

        h = Hybrid(sharded, self.hybrid.params, name=self.name)
        return export(
            h, path, example=example, batch=batch, platforms=platforms, overwrite=overwrite
        )

    def __repr__(self) -> str:
        return f"Sharded({self.name}, mesh={dict(self.mesh.shape)}, axis={self.axis!r})"


def shard(h: Hybrid, mesh: Mesh | None = None, *, axis: str = "data", pad: bool = True) -> Sharded:
    """Runs ``h`` data-parallel over ``mesh``: batch split over ``axis``, params replicated.

    Args:
      h: the :class:`~symjax_mlp.Hybrid`; its function must treat examples independently
        (true of an MLP) for padding to be exact.
      mesh: a ``jax.sharding.Mesh`` (default: :func:`data_mesh` over every device).
      axis: the mesh axis the batch is split over.
      pad: pad an indivisible batch and trim the result (``False``: raise).

    Returns:
      A :class:`Sharded`; ``shard(h)(x)`` equals ``h(x)`` up to float rounding.

    Raises:
      ValueError: ``axis`` is not an axis of ``mesh``.

    Example:
      >>> s = shard(h, data_mesh())
      >>> s(x).shape == h(x).shape
      True
    """
    return Sharded(h, mesh, axis=axis, pad=pad)


class ShardedStep:
    """A training step run data-parallel; create it with :func:`shard_step`.

    ``s(params, opt_state, x, y, w=None)`` replicates params and optimizer state, pads the
    batch to a multiple of ``n_shards`` with weight 0, splits it over ``axis``, and runs one
    ``jax.jit`` (params and optimizer state donated). Gradients of the weighted-mean loss are
    summed across devices by XLA (an all-reduce in the compiled program).
    """

    def __init__(
        self, step: Callable[..., Any], mesh: Mesh | None, axis: str, donate: bool, pad: bool
    ):
        self.step = step
        self.mesh, self.replicated, self.batch_sharding, self.n_shards = _shardings(mesh, axis)
        self.axis, self.pad = axis, pad
        rep, dat = self.replicated, self.batch_sharding
        self._jitted = jax.jit(
            step,
            in_shardings=(rep, rep, dat, dat, dat),
            out_shardings=(rep, rep, rep),
            donate_argnums=(0, 1) if donate else (),
        )

    def replicate(self, tree: Any) -> Any:
        """``tree`` placed on every device of the mesh (params, optimizer state)."""
        return jax.tree.map(lambda a: _place(a, self.replicated), tree)

    def shard_batch(self, x: Any, y: Any, w: Any = None) -> tuple[jax.Array, ...]:
        """``(x, y, w)`` padded with weight-0 rows to a multiple of ``n_shards``, then split."""
        batch = _batch_size((x, y) if w is None else (x, y, w), "shard_step(...)")
        w = np.ones(batch, np.float32) if w is None else w
        extra = _padding(batch, self.n_shards, self.pad, "shard_step(...)")
        arrays = (_pad(x, extra), _pad(y, extra), _pad(w, extra, fill=0))
        return tuple(_place(a, self.batch_sharding) for a in arrays)

    def __call__(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any = None) -> Any:
        """One step: ``(params, opt_state, metrics)``, all replicated."""
        return self._jitted(
            self.replicate(params), self.replicate(opt_state), *self.shard_batch(x, y, w)
        )

    def lower(self, params: Any, opt_state: Any, x: Any, y: Any, w: Any = None):
        """The lowered step; ``.compile().as_text()`` shows XLA's all-reduce of the gradients."""
        return self._jitted.lower(
            self.replicate(params), self.replicate(opt_state), *self.shard_batch(x, y, w)
        )


def shard_step(
    step: Callable[..., Any],
    mesh: Mesh | None = None,
    *,
    axis: str = "data",
    donate: bool = True,
    pad: bool = True,
) -> ShardedStep:
    """Runs a training step data-parallel: batch split over ``axis``, state replicated.

    Args:
      step: ``step(params, opt_state, x, y, w) -> (params, opt_state, metrics)`` whose loss is
        a ``w``-weighted mean over the batch, e.g. :func:`symjax_mlp.step.train_step`.
      mesh: a ``jax.sharding.Mesh`` (default: :func:`data_mesh` over every device, all
        processes included after ``jax.distributed.initialize``).
      axis: the mesh axis the batch is split over.
      donate: donate params and optimizer state to the step (their old buffers are reused).
      pad: pad an indivisible batch with weight-0 rows, exact for a ``w``-weighted loss
        (``False``: raise :class:`~symjax_mlp.SignatureError`).

    Returns:
      A :class:`ShardedStep`; its params after N steps equal single-device training up to
      float rounding.

    Example:
      >>> step = shard_step(train_step(net, optax.adam(1e-3)), data_mesh())
      >>> params, opt_state, metrics = step(params, opt_state, x, y)
    """
    return ShardedStep(step, mesh, axis, donate, pad)


class LoadedSharded:
    """A sharded artifact bound to a mesh; calls run under ``jax.set_mesh(mesh)``."""

    def __init__(self, model: Any, mesh: Mesh):
        self.model, self.mesh = model, mesh
        self.signature, self.manifest = model.signature, model.manifest

    def __call__(self, *inputs: jax.typing.ArrayLike) -> Any:
        with jax.set_mesh(self.mesh):
            return self.model(*inputs)


def load_sharded(path: str | os.PathLike[str], mesh: Mesh | None = None) -> LoadedSharded:
    """Loads an artifact written by :meth:`Sharded.export` and binds it to a matching mesh.

    Args:
      path: the artifact directory.
      mesh: a mesh of exactly the artifact's ``nr_devices`` devices (default: the first
        ``nr_devices`` devices).

    Raises:
      ArtifactError: fewer devices are visible than the artifact was exported for, or
        ``mesh`` has another device count.
    """
    from symjax_mlp.export import load

    model = load(path)  # checks files, platform, and that enough devices are visible
    need = int(model.manifest["nr_devices"])
    mesh = data_mesh(need) if mesh is None else _auto(mesh)
    if mesh.size != need:
        raise ArtifactError(
            f"load_sharded({str(path)!r}): the artifact was exported for {need} devices, but "
            f"the mesh {dict(mesh.shape)} has {mesh.size}. jax.export programs run on the "
            f"device count they were exported for: pass a mesh of {need} devices, e.g. "
            f"data_mesh({need}), or re-export on a mesh of {mesh.size}."
        )
    return LoadedSharded(model, mesh)


# -- throughput against device count ----------------------------------------------------------
def _counts(n: int) -> list[int]:
    return sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})


def _bench_here(n_devices, sizes, in_features, batch, repeats, train_steps, seed) -> dict:
    import optax

    from symjax_mlp.hybrid import hybridize
    from symjax_mlp.models import mlp
    from symjax_mlp.step import train_step

    net, optimizer = mlp(tuple(sizes)), optax.sgd(1e-2)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, in_features), np.float32)
    y = rng.integers(0, sizes[-1], batch).astype(np.int32)
    variables = jax.device_get(jax.jit(net.init)(jax.random.key(seed), x[:1]))
    h, step = hybridize(net, variables), train_step(net, optimizer)
    rows, ref = [], None
    for k in _counts(n_devices):
        mesh = data_mesh(k)
        s = shard(h, mesh)
        xs = _place(x, s.batch_sharding)  # time the program, not the host-to-device copy
        t0 = time.perf_counter()
        out = jax.block_until_ready(s(xs))
        compile_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(repeats):
            out = s(xs)
        jax.block_until_ready(out)
        infer = repeats * batch / (time.perf_counter() - t0)
        ds = shard_step(step, mesh)
        params, data = variables["params"], ds.shard_batch(x, y)
        params, state, _ = ds(
            params, jax.jit(optimizer.init)(params), *data
        )  # compile + first step
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for _ in range(train_steps):
            params, state, _ = ds(params, state, *data)
        jax.block_until_ready(params)
        trained = train_steps * batch / (time.perf_counter() - t0)
        got = (np.asarray(out), [np.asarray(a) for a in jax.tree.leaves(params)])
        ref = got if ref is None else ref
        rows.append(
            {
                "devices": k,
                "inference_examples_per_s": infer,
                "train_examples_per_s": trained,
                "inference_speedup": infer / rows[0]["inference_examples_per_s"] if rows else 1.0,
                "compile_seconds": compile_s,
                "max_abs_diff": float(np.max(np.abs(got[0] - ref[0]))),
                "params_max_abs_diff": max(
                    float(np.max(np.abs(a - b))) for a, b in zip(got[1], ref[1], strict=True)
                ),
            }
        )
    for row in rows:
        row["matches_1_device"] = row["max_abs_diff"] <= 1e-5 and row["params_max_abs_diff"] <= 1e-5
    backend = jax.default_backend()
    return {
        "backend": backend,
        "device_kind": jax.devices()[0].device_kind,
        "n_devices": n_devices,
        "virtual_cpu_devices": backend == "cpu",
        "note": CPU_NOTE if backend == "cpu" else "real devices: rows show data-parallel scaling",
        "batch": batch,
        "sizes": list(sizes),
        "in_features": in_features,
        "repeats": repeats,
        "train_steps": train_steps,
        "rows": rows,
    }


_CHILD = (
    "import json, sys; from symjax_mlp.distributed import _bench_here; "
    "print(json.dumps(_bench_here(**json.loads(sys.argv[1]))))"
)


def bench_devices(
    n_devices: int,
    *,
    sizes: Sequence[int] = (256, 128, 2),
    in_features: int = 512,
    batch: int = 4096,
    repeats: int = 20,
    train_steps: int = 10,
    seed: int = 0,
    timeout: float = 600.0,
) -> dict[str, Any]:
    """Throughput of sharded inference and training on 1, 2, 4, ... ``n_devices`` devices.

    Each count gets a :func:`data_mesh` of that many devices; the global ``batch`` is fixed
    (strong scaling) and every row is checked against the 1-device row. When fewer than
    ``n_devices`` devices are visible and JAX runs on the CPU, the benchmark runs in a fresh
    subprocess with ``n_devices`` virtual CPU devices; those share the host's cores, so the
    rows show correctness, not scaling (``result["note"]`` says so).

    Returns:
      A dict: ``backend``, ``device_kind``, ``n_devices``, ``virtual_cpu_devices``, ``note``,
      ``batch``, ``sizes``, ``in_features``, ``repeats``, ``train_steps``, ``in_subprocess``
      and ``rows``, one per device count, with ``devices``, ``inference_examples_per_s``,
      ``train_examples_per_s``, ``inference_speedup``, ``compile_seconds``,
      ``max_abs_diff``, ``params_max_abs_diff`` and ``matches_1_device``.

    Raises:
      ValueError: ``n_devices < 1``, or more accelerators are asked for than are visible.
      RuntimeError: the subprocess failed (its stderr is in the message).
    """
    if not isinstance(n_devices, int) or n_devices < 1:
        raise ValueError(f"bench_devices: n_devices must be an int >= 1; got {n_devices!r}.")
    kwargs = {
        "n_devices": n_devices,
        "sizes": list(sizes),
        "in_features": in_features,
        "batch": batch,
        "repeats": repeats,
        "train_steps": train_steps,
        "seed": seed,
    }
    if n_devices <= jax.device_count():
        return {**_bench_here(**kwargs), "in_subprocess": False}
    if jax.default_backend() != "cpu":
        raise ValueError(
            f"bench_devices({n_devices}): only {jax.device_count()} {jax.default_backend()} "
            f"device(s) are visible. Ask for at most {jax.device_count()}."
        )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(n_devices))
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "force_host_platform_device_count" not in f)
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"bench_devices({n_devices}): the {n_devices}-device subprocess failed "
            f"(exit {proc.returncode}):\n{proc.stderr[-3000:]}"
        )
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "in_subprocess": True}
