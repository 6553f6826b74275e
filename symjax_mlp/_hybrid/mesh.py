"""Data parallelism: one ``jax.jit`` with the batch split over the mesh's data axis, the params
replicated (XLA's SPMD partitioner). A batch that does not divide over the shards goes in
whole, replicated, and is constrained to the split inside the program: XLA splits it unevenly,
exact for any model (one mixing its rows, BatchNorm's statistics in training too).
``shard_step`` pads such a batch with weight-``0`` rows (see :func:`pad_rows`)."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from symjax_mlp._errors import ConfigError, SignatureError
from symjax_mlp._hybrid.settings import check_settings


def data_mesh(
    n_devices: int | None = None, *, axis: str = "data", devices: Sequence[Any] | None = None
) -> Mesh:
    """A 1-D mesh ``{axis: n_devices}`` over the first ``n_devices`` devices (default: all),
    in ``Auto`` (GSPMD) mode; after ``jax.distributed.initialize``, every process's devices.

    Raises:
      ValueError: fewer than ``n_devices`` devices are visible.

    Example:
      >>> import symjax_mlp as sm
      >>> dict(sm.data_mesh(1).shape)
      {'data': 1}
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices) if n_devices is None else n_devices
    check_settings(axis=(axis, str, "'data' (a mesh axis name)"))  # else jax names it str(axis)
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or not 1 <= n <= len(devices):
        raise ConfigError(
            f"data_mesh({n_devices!r}): JAX sees {len(devices)} device(s), so n_devices must "
            f"be 1..{len(devices)}. For more CPU devices, start the process with "
            "XLA_FLAGS=--xla_force_host_platform_device_count=N (or call "
            'jax.config.update("jax_num_cpu_devices", N)) before JAX initializes.'
        )
    n = int(n)  # a NumPy int too
    return jax.make_mesh((n,), (axis,), axis_types=(AxisType.Auto,), devices=devices[:n])


def program_mesh(exported: Any, n: int) -> Mesh:
    """The mesh an exported program of ``n`` devices was sharded over, as Shardy records it
    (``sdy.mesh @mesh = <["data"=2, "model"=4]>``: a model's own ``with_sharding_constraint``),
    over the first ``n`` devices; else :func:`data_mesh` of ``n`` (a sharded Hybrid's)."""
    meshes = re.findall(r"sdy\.mesh @\S+ = <\[([^\]]*)\]", exported.mlir_module())
    axes = [(a, int(k)) for a, k in re.findall(r'"(\w+)"=(\d+)', meshes[0])] if meshes else []
    if len(meshes) != 1 or not axes or math.prod(k for _, k in axes) != n:
        return data_mesh(n)
    names, sizes = zip(*axes, strict=True)
    return jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])  # fmt: skip


def auto_mesh(mesh: Mesh) -> Mesh:
    """``mesh`` with Auto axes (Explicit ones refuse some functions, e.g. trimming a batch)."""
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


def constrained(mesh: Mesh, axis: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the mesh's shardings as constraints (``jax.export`` records its size)."""
    _, rep, dat, _ = shardings(mesh, axis)

    def sharded(params: Any, *inputs: Any, **kw: Any) -> Any:
        params = jax.lax.with_sharding_constraint(params, rep)
        arrays = [x for x in inputs if hasattr(x, "shape")]
        placed = iter(jax.lax.with_sharding_constraint(arrays, dat))
        inputs = [next(placed) if hasattr(x, "shape") else x for x in inputs]
        return jax.lax.with_sharding_constraint(fn(params, *inputs, **kw), dat)

    return sharded


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Puts ``x`` (the global value) on ``sharding``, each process only its shards; a traced
    ``x`` is constrained to it instead."""
    if isinstance(x, jax.core.Tracer):
        return jax.lax.with_sharding_constraint(x, sharding)
    array = isinstance(x, jax.Array)
    if array and x.sharding == sharding:  # not just equivalent: the mesh is in the jit key
        return x
    if jax.process_count() == 1 or (array and not x.is_fully_addressable):
        return jax.device_put(x, sharding)
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def batch_size(dyn: Sequence[Any], caller: str, dyn_kw: dict[str, Any] | None = None) -> int:
    """The inputs' one leading dimension, each array in their tuples and dicts (an equinox
    ``eqx.nn.State``) named by its path where one has none or another."""
    inputs = [(f"args[{i}]", x) for i, x in enumerate(dyn)]
    inputs += [(f"kwargs[{k!r}]", v) for k, v in (dyn_kw or {}).items()]
    flat = jax.tree_util.tree_leaves_with_path
    shapes = {at + jax.tree_util.keystr(p): np.shape(a) for at, x in inputs for p, a in flat(x)}
    if scalar := next((at for at, shape in shapes.items() if shape == ()), None):
        raise SignatureError(
            f"{caller}: {scalar} is a scalar; every input needs the batch as its "
            "leading dimension to be split over the mesh."
        )
    sizes = {at: shape[0] for at, shape in shapes.items()}
    if len(set(sizes.values())) > 1:
        raise SignatureError(
            f"{caller}: the inputs' leading (batch) dimensions differ: {sizes}. Every input "
            "must have the same batch size."
        )
    return next(iter(sizes.values()), 0)


def pad_rows(x: Any, pad: int, *, fill: float | None = None) -> Any:
    """Appends ``pad`` rows: copies of the last row, or ``fill``."""
    if pad == 0:
        return x
    xp = jnp if isinstance(x, jax.Array) else np
    x = xp.asarray(x)
    shape = (pad, *x.shape[1:])
    rows = xp.repeat(x[-1:], pad, axis=0) if fill is None else xp.full(shape, fill, x.dtype)
    return xp.concatenate([x, rows])


def padding(batch: int, n: int, pad: bool, caller: str, taken: str = "to pad and trim") -> int:
    """The rows ``batch`` lacks to divide over ``n``; refused where not ``pad`` (``pad=True``
    takes it ``taken``)."""
    extra = -batch % n
    if extra and not pad:
        raise SignatureError(
            f"{caller}: batch {batch} does not divide over {n} shards. Pass a batch that is a "
            f"multiple of {n} (e.g. {batch + extra}), or shard with pad=True {taken}."
        )
    return extra


_BAKED = (
    "{name}.shard(...): params_as_constants=True compiles the params into one device's "
    "program, but a sharded Hybrid places them on every device. Shard it without: "
    "h.replace(params_as_constants=False).shard(mesh)."
)


@dataclasses.dataclass(frozen=True)
class DataParallel:
    """A sharded Hybrid's call: the ``batch`` split over ``axis`` of ``mesh`` (Auto axes), the
    params and state ``replicated``; a batch that does not divide over the shards split
    inside :meth:`uneven`'s program."""

    name: str
    mesh: Mesh
    axis: str
    pad: bool
    n_shards: int
    replicated: NamedSharding
    batch: NamedSharding
    # a program -> its twin for a batch that does not divide (see uneven)
    _uneven: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def over(
        cls, name: str, mesh: Mesh | None, axis: str, pad: bool, baked: bool = False
    ) -> DataParallel:
        """Checks ``mesh`` (default: :func:`data_mesh`), ``axis``, and that nothing is baked."""
        if baked:
            raise ConfigError(_BAKED.format(name=name))
        mesh, rep, dat, n = shardings(mesh, axis)
        return cls(name, mesh, axis, pad, n, rep, dat)

    def jit(self, trace: Callable[..., Any], stateful: bool) -> dict[str, Any]:
        """``jax.jit``'s arguments: ``trace`` taking the batch as one tuple, its outputs checked
        per example, and the in/out shardings."""
        rep, dat = self.replicated, self.batch

        def sharded(static: Any, leaves: Any, *call: Any) -> Any:  # (held,) dyn, dyn_kw
            held, (dyn, dyn_kw) = call[:-2], self.spread(call[-2:])  # (see uneven)
            if not stateful:
                return self.spread(self.per_example(trace(static, leaves, *dyn, **dyn_kw), dyn))
            out, new_held = trace(static, leaves, *held, dyn, dyn_kw)
            return self.spread(self.per_example(out, dyn)), new_held

        ins, outs = ((rep, rep, dat, dat), (dat, rep)) if stateful else ((rep, dat, dat), dat)
        return {"fun": sharded, "in_shardings": ins, "out_shardings": outs}

    def per_example(self, out: Any, dyn: Any) -> Any:
        """``out``, each leaf checked to lead with the batch."""
        batch = jax.tree.leaves(dyn)[0].shape[0]
        for path, leaf in jax.tree_util.tree_leaves_with_path(out):
            if leaf.ndim == 0 or leaf.shape[0] != batch:
                raise SignatureError(
                    f"{self.name}: output out{jax.tree_util.keystr(path)} has shape "
                    f"{leaf.shape}, but a sharded call needs per-example outputs with the batch "
                    f"({batch}) as leading dimension. Reduce over the batch after the call."
                )
        return out

    def prepare(
        self, jitted: Any, dyn: tuple[Any, ...], dyn_kw: dict[str, Any]
    ) -> tuple[Any, Any, Any]:
        """The program for the call's batch and its inputs placed: ``jitted`` and the inputs
        on :attr:`batch`; for a batch that does not divide over the shards, :meth:`uneven`'s
        program and the inputs replicated."""
        caller = f"{self.name}.shard(...)"
        if not dyn:
            raise SignatureError(f"{caller}: needs at least one batched input.")
        size, uneven = batch_size(dyn, caller, dyn_kw), "to split it unevenly inside"
        if padding(size, self.n_shards, self.pad, caller, uneven):
            jitted, sharding = self.uneven(jitted), self.replicated
        else:
            sharding = self.batch

        def put(x: Any) -> Any:  # an array, or a tuple or dict of them
            return jax.tree.map(lambda leaf: place(leaf, sharding), x)

        return jitted, tuple(map(put, dyn)), {k: put(v) for k, v in dyn_kw.items()}

    def uneven(self, jitted: Any) -> Any:
        """``jitted``'s twin for a batch that does not divide over the shards, taken and given
        replicated (a jax.Array cannot be split unevenly); :meth:`spread` splits it inside."""
        if (program := self._uneven.get(jitted)) is None:
            rep = self.replicated
            program = self._uneven[jitted] = jax.jit(  # the same function: its name, its trace
                jitted.__wrapped__, static_argnums=0, in_shardings=rep, out_shardings=rep
            )
        return program

    def spread(self, tree: Any) -> Any:
        """``tree`` constrained to :attr:`batch` where its batch does not divide over the
        shards (:meth:`uneven`'s program, traced); a batch that divides: as it is."""
        leaves = jax.tree.leaves(tree)
        if not leaves or leaves[0].shape[0] % self.n_shards == 0:
            return tree
        return jax.lax.with_sharding_constraint(tree, self.batch)

    def replicate(self, leaves: Sequence[Any]) -> list[Any]:
        return [place(leaf, self.replicated) for leaf in leaves]

    def call(self, jitted: Any, static: Any, leaves: Any, held: Any, dyn: Any, dyn_kw: Any) -> Any:
        """A call of :meth:`prepare`'s program, ``held`` (or ``None``) passed and taken back."""
        program, *call = self.prepare(jitted, dyn, dyn_kw)
        if held is None:
            out = program(static, leaves, *call)
        else:
            out = held.call(program, (static, leaves, *call))[0]
        if any(isinstance(y, jax.core.Tracer) for y in jax.tree.leaves(out)):
            # jax.grad's eager transpose of the jit refuses a cotangent of another sharding
            # (one a replicated factor gives it): the constraint reshards it as jit gave it
            sharding = self.batch if program is jitted else self.replicated
            out = jax.tree.map(lambda y: place(y, sharding), out)
        return out
