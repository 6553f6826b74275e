"""Meshes and placement for data parallelism: one XLA program drives every device.

A sharded :class:`~symjax_mlp.Hybrid` (``h.shard(mesh)``) splits the batch over the mesh's
data axis (``NamedSharding(mesh, P(axis))``) and replicates the params (``P()``); its one
``jax.jit`` carries those in/out shardings, so the XLA SPMD partitioner writes the per-device
program and there is no Python loop over devices. Across hosts, call
``jax.distributed.initialize`` first and pass ``data_mesh()``: the same code runs as one
program over every process's devices.

A batch that does not divide by the number of shards is padded and the result trimmed:
inference pads by repeating the last row (outputs must be per-example, with the batch as
leading dimension, which is checked), training pads with weight ``0`` (a weighted loss ignores
those rows exactly). ``pad=False`` raises :class:`~symjax_mlp.SignatureError` instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from symjax_mlp._errors import ConfigError, SignatureError


def data_mesh(
    n_devices: int | None = None, *, axis: str = "data", devices: Sequence[Any] | None = None
) -> Mesh:
    """A 1-D mesh ``{axis: n_devices}`` over the first ``n_devices`` devices (default: all).

    Built with ``jax.make_mesh`` in ``Auto`` (GSPMD) mode, so any function runs on it
    unchanged. After ``jax.distributed.initialize`` it spans every process's devices.

    Raises:
      ValueError: fewer than ``n_devices`` devices are visible.

    Example:
      >>> import symjax_mlp as sm
      >>> dict(sm.data_mesh(1).shape)
      {'data': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if n_devices is None else n_devices
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= len(devices):
        raise ConfigError(
            f"data_mesh({n_devices!r}): JAX sees {len(devices)} device(s), so n_devices must "
            f"be 1..{len(devices)}. For more CPU devices, start the process with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (or call "
            'jax.config.update("jax_num_cpu_devices", N)) before JAX initializes.'
        )
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:n])


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with Auto axes: GSPMD partitions any function, where Explicit axes would
    reject some (e.g. trimming a padded batch)."""
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * mesh.devices.ndim)


def shardings(mesh: Mesh | None, axis: str) -> tuple[Mesh, NamedSharding, NamedSharding, int]:
    mesh = data_mesh(axis=axis) if mesh is None else mesh
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"expected a jax.sharding.Mesh (see data_mesh()); got {type(mesh)}.")
    if axis not in mesh.axis_names:
        raise ConfigError(
            f"axis={axis!r} is not an axis of the mesh {dict(mesh.shape)}; pass axis= one of "
            f"{mesh.axis_names}."
        )
    mesh = auto_mesh(mesh)
    return mesh, NamedSharding(mesh, P()), NamedSharding(mesh, P(axis)), mesh.shape[axis]


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Puts ``x`` (the global value) on ``sharding``; each process places only its shards.
    A traced ``x`` (under ``jax.grad``, ``jax.jit``) is constrained to it instead."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    if isinstance(x, jax.Array):
        if x.sharding == sharding:  # not just equivalent: the mesh is part of the jit key
            return x
        if jax.process_count() == 1 or not x.is_fully_addressable:
            return jax.device_put(x, sharding)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_size(arrays: Sequence[Any], caller: str) -> int:
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


def pad_rows(x: Any, pad: int, *, fill: float | None = None) -> Any:
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


def padding(batch: int, n: int, pad: bool, caller: str) -> int:
    extra = -batch % n
    if extra and not pad:
        raise SignatureError(
            f"{caller}: batch {batch} does not divide over {n} shards. Pass a batch that is a "
            f"multiple of {n} (e.g. {batch + extra}), or shard with pad=True to pad and trim."
        )
    return extra
