"""Run an artifact with JAX: ``load(path)`` (the default runtime).

``model.jaxexport`` is deserialized with ``jax.export.deserialize`` (flatbuffers, no pickle),
checked against the manifest and ``model.mlirbc``, and called through one ``jax.jit`` of
``Exported.call``, with the params as a dict of device arrays keyed by param path (weights
are bound by name). XLA compiles once per input shape, and a module loaded again in the same
process (same sha256) reuses the compilations. An artifact exported for N > 1 devices runs
under the caller's mesh of N devices, else a mesh of the first N. A module that the op check
shows calls no LAPACK kernel compiles without JAX's LAPACK set-up
(:func:`symjax_mlp._compat.skipping_lapack`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap

from symjax_mlp._artifact.format import (
    JAXEXPORT,
    MLIRBC,
    caller,
    check_calling_convention,
    compatibility_note,
    program_file,
)
from symjax_mlp._compat import skipping_lapack
from symjax_mlp._errors import ArtifactError, ConfigError, SymjaxError
from symjax_mlp._specs import shape_dims


def check_supported(path: Path, manifest: Mapping[str, Any]) -> None:
    """Refuses artifacts this JAX cannot run: calling convention, platform, device count."""
    check_calling_convention(manifest, file=path / JAXEXPORT)
    here = jax.export.default_export_platform()
    listed = tuple(manifest["platforms"])
    if here not in listed:
        raise ArtifactError(
            f"{path / 'manifest.json'}: the artifact was exported for {', '.join(listed)}, but "
            f"JAX here runs on {here}. Re-export it for this platform too, e.g. "
            f"export(h, path, example=x, platforms={(*listed, here)!r}, overwrite=True)."
        )
    need, have = manifest["nr_devices"], jax.device_count()
    if need > have:
        raise ArtifactError(
            f"{path / 'manifest.json'}: the artifact is sharded over {need} devices, but JAX "
            f"here sees {have} {here} device(s). Run it where {need} devices are visible, or "
            "re-export it unsharded."
        )


# sha256 of model.jaxexport -> (Exported, its _Program, the guard and rows it was made with),
# most recently loaded last.
_CALLS: dict[str, tuple[Any, Callable[..., Any], Any]] = {}
_MAX_CALLS = 8


def deserialize(path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, Any]) -> Any:
    """``model.jaxexport`` deserialized and checked against the manifest and ``model.mlirbc``.

    Both runtimes call it: the module IREE compiles (``model.mlirbc``) is then the very module
    ``jax.export`` runs, and the one whose ops the loader checks.
    """
    file = program_file(manifest, JAXEXPORT)
    key = manifest["files"][file]["sha256"]
    cached = _CALLS.get(key)
    if cached:
        exported = cached[0]
    else:
        try:
            exported = jax.export.deserialize(blobs[file])
        except Exception as e:  # an unreadable module: most likely made by an incompatible JAX
            raise ArtifactError(
                f"{path / file}: jax.export could not deserialize it ({type(e).__name__}: "
                f"{str(e)[:300]}). {compatibility_note(manifest)}"
            ) from e
    _check_agrees(path, manifest, blobs, exported)
    return exported


def runner(
    path: Path,
    manifest: Mapping[str, Any],
    blobs: Mapping[str, Any],
    params: Sequence[np.ndarray],
    *,
    exported: Any,
    guard: Callable[..., None] | None = None,
    custom_calls: Any = None,
    constants: bool = False,
) -> tuple[Callable[[list[Any]], list[Any]], dict[str, Any]]:
    """Returns ``run(inputs) -> [jax.Array, ...]`` and the weights it runs with (on device).

    ``guard`` (a :class:`symjax_mlp._load.Guard`, or ``None``) checks each new input
    signature before XLA compiles it, and each VJP module when ``jax.grad`` first calls it;
    loads whose guards and ``rows`` are equal share one :class:`_Program`.
    ``custom_calls``: the targets the module calls, or ``None``. ``constants``: run a jit
    that closes over the weights (XLA constants); the guard still checks the module that
    takes them.
    """
    if constants and manifest["nr_devices"] != 1:
        raise ConfigError(
            f"load({str(path)!r}, params_as_constants=True): the artifact runs sharded over "
            f"{manifest['nr_devices']} devices, and its weights are placed on each; load it "
            "without params_as_constants."
        )
    key = manifest["files"][program_file(manifest, JAXEXPORT)]["sha256"]
    cached = _CALLS.pop(key, None)  # the same module loaded again: reuse its compilations
    if not (cached and cached[0] is exported and cached[2] == (guard, manifest.get("rows"))):
        cached = exported, _Program(path, manifest, exported, guard), (guard, manifest.get("rows"))
    _CALLS[key] = cached
    while len(_CALLS) > _MAX_CALLS:
        _CALLS.pop(next(iter(_CALLS)))  # least recently loaded
    program = cached[1]
    names = [p["path"] for p in manifest["params"]]
    # device_put, not jnp.asarray (which makes two copies): the arrays read from the file are
    # 64-byte aligned, so on CPU the device buffer is the host buffer, no copy at all
    weights = {n: jax.device_put(a) for n, a in zip(names, params, strict=True)}
    checked: set[Any] = set()  # (shape, dtype) of the inputs of each call the guard passed
    tree = exported.out_tree
    single = tree.num_leaves == 1 and tree.num_nodes == 1  # one array, not a tuple of one
    if constants:  # the weights closed over: XLA constants
        run = jax.jit(lambda *inputs: program.fn(weights, *inputs))
    else:
        run = functools.partial(program.call, weights)

    def call_checked(inputs: list[Any]) -> list[Any]:
        if guard is not None:
            key = tuple([(x.shape, x.dtype) for x in inputs])  # str(dtype) costs microseconds
            if key not in checked:  # the first call of this signature: it compiles
                with skipping_lapack(custom_calls):
                    if program.check(program.call, (weights, *inputs)) and len(checked) < 256:
                        checked.add(key)
                    out = run(*inputs)
                return [out] if single else list(out)
        out = run(*inputs)
        return [out] if single else list(out)

    n = manifest["nr_devices"]
    if n == 1:
        return call_checked, weights
    # A sharded export runs on exactly n devices: under the caller's mesh of n devices (as
    # load(path, mesh=...) sets one), else under a mesh of the first n (check_supported saw enough).
    mesh = jax.make_mesh(
        (n,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:n]
    )

    def run_sharded(inputs: list[Any]) -> list[Any]:
        try:
            current = jax.sharding.get_mesh()
        except ValueError:  # under a trace (jax.grad's): only the mesh set around it counts
            if jax.sharding.get_abstract_mesh().size == n:
                return call_checked(inputs)
            raise ConfigError(
                f"load({str(path)!r}): the artifact runs sharded over {n} devices, and under a "
                "transformation (jax.grad, jax.vmap) it needs the mesh set around it: "
                f"with jax.set_mesh(jax.make_mesh(({n},), ('data',))): jax.grad(...)(x)."
            ) from None
        if not current.empty and current.size == n:
            return call_checked(inputs)
        with jax.set_mesh(mesh):
            return call_checked(inputs)

    return run_sharded, weights


def refined(
    path: Path, manifest: Mapping[str, Any], fn: Any, args: Sequence[Any], *,
    module: str = "the module", custom_calls: Any = None,
) -> Any:  # fmt: skip
    """The StableHLO XLA would compile for ``jax.jit(fn)(*args)`` (``args``: arrays or
    ``jax.ShapeDtypeStruct``): lowered, every shape refined to ``args``', with its MLIR
    context. ``module`` names what ``fn`` calls, for messages; ``custom_calls``, where
    known, the targets it calls (:func:`~symjax_mlp._compat.skipping_lapack`)."""
    import io

    import jax.extend.mlir as jex
    from jax.interpreters import mlir as jax_mlir

    lowered = fn if hasattr(fn, "lower") else jax.jit(fn)
    shapes = [tuple(a.shape) for a in args if not isinstance(a, Mapping)]  # not the params
    try:
        with skipping_lapack(custom_calls):
            ir_module = lowered.lower(*args).compiler_ir("stablehlo")
        buffer = io.BytesIO()
        ir_module.operation.write_bytecode(buffer)
        refined_bytes = jex.refine_polymorphic_shapes(
            buffer.getvalue(),
            enable_shape_assertions=True,
            validate_static_shapes=True,
            enable_shardy=jax.config.jax_use_shardy_partitioner,
        )
    except Exception as e:  # MLIR raises plain exceptions; jax.export ValueErrors
        raise ArtifactError(
            f"{path / program_file(manifest, JAXEXPORT)}: the shapes of {module} cannot be "
            f"resolved for inputs {shapes} ({type(e).__name__}: {str(e)[:300]})."
        ) from e
    context = jax_mlir.make_ir_context()
    with context:
        return jax_mlir.ir.Module.parse(refined_bytes), context


_NO_VJP = (
    "{caller}: jax.grad of the loaded model runs the artifact's VJP module of order {order}, "
    "and it was exported without one (vjp_order={have}). Export it again with "
    "vjp_order={order}: sm.export(h, path, example=x, vjp_order={order})."
)
_NO_VMAP = (
    "{caller}: jax.vmap over the loaded model merges the mapped axis into the artifact's batch "
    "and runs the program once, which is right only for a program that keeps rows apart; "
    "{why}. Map the calls one by one instead: jax.lax.map(m, xs)."
)
_UNBATCHED = (
    "{caller}: jax.vmap maps over {path}, which has no batch dimension {dim} in the artifact "
    "({spec}), so its rows cannot join the batch. Pass it unmapped (in_axes=None for it), or "
    "map the calls one by one: jax.lax.map."
)


class _Program:
    """The exported program under every JAX transform, with its one ``jax.jit`` (``call``).

    ``fn(weights, *inputs)`` is a ``custom_vjp`` over a ``custom_vmap`` of ``Exported.call``:

    - ``jax.grad`` runs the VJP module (``Exported.vjp()``), which the guard checks for the
      shapes it is called with before JAX lowers it, and so on for each higher order; an
      artifact exported without it is a :class:`~symjax_mlp.SymjaxError` naming
      ``vjp_order``, not JAX's bare ``ValueError``.
    - ``jax.vmap`` (``jax.custom_batching.custom_vmap``; ``Exported.call`` has no batching
      rule) moves each mapped input's axis next to its batch dimension, merges the two into
      one batch, runs ``call`` once (so a merged shape compiles once) and splits the outputs
      back (:meth:`merge`); nested vmaps merge in turn. Only for a program whose export
      recorded that it keeps rows apart (the manifest's ``rows``, :mod:`symjax_mlp._rows`),
      else refused with the reason. A VJP module under ``jax.vmap`` (``jax.vmap`` of
      ``jax.grad``) runs once per mapped element (``jax.lax.map``).
    """

    def __init__(self, path: Path, manifest: Mapping[str, Any], exported: Any, guard: Any):
        self.path, self.manifest, self.guard = path, manifest, guard
        self.caller = caller(path, manifest)
        self.fn = self.wrap(exported)
        self.call = jax.jit(self.fn)

    def check(self, fn: Any, args: Sequence[Any], n: int | None = None, order: int = 0) -> bool:
        """Has the guard check ``fn``'s module refined for ``args`` (the weights a dict);
        ``n``: the call's input element count (default: ``args``' but the weights).
        Whether it checked: not when trusted, nor under a symbolic trace (checked when
        compiled for real shapes)."""
        inputs = [x for x in args if not isinstance(x, Mapping)]
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in inputs)
        if self.guard is None or not all(isinstance(d, int) for s, _ in shapes for d in s):
            return False
        structs = [
            jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            if not isinstance(x, Mapping) or any(map(_traced, x.values())) else x
            for x in args
        ]  # fmt: skip
        what = f"its VJP module of order {order}" if order else "the module"
        n = sum(math.prod(s) for s, _ in shapes) if n is None else n
        refine = functools.partial(refined, self.path, self.manifest, fn, structs, module=what)
        self.guard(refine, n, shapes, order=order)
        return True

    def wrap(self, module: Any, order: int = 0, n: int | None = None) -> Callable[..., Any]:
        """``module.call`` (the program, or its VJP module of ``order``) as the class says."""
        batched = custom_vmap(module.call)
        batched.def_vmap(self.merge if order == 0 else functools.partial(_one_by_one, module.call))

        @jax.custom_vjp
        def call(*args: Any) -> Any:
            return batched(*args)

        def forward(*args: Any) -> tuple[Any, Any]:  # call, not batched: jax.grad of jax.grad
            return call(*args), args

        def backward(args: Any, cts: Any) -> Any:
            if not module.has_vjp():
                have = self.manifest.get("vjp_order", 0)
                raise SymjaxError(_NO_VJP.format(caller=self.caller, order=order + 1, have=have))
            vjp = module.vjp()
            primals, cts = jax.tree.leaves(args), jax.tree.leaves(cts)
            expected = vjp.in_avals[len(primals) :]
            if len(expected) != len(cts):
                raise ArtifactError(
                    f"{self.path / program_file(self.manifest, JAXEXPORT)}: its VJP module of "
                    f"order {order + 1} takes {len(vjp.in_avals)} inputs, not the "
                    f"{len(primals)} primals and {len(cts)} cotangents jax.grad passes it. It "
                    "was edited; export it again."
                )
            cts = [  # float0 where the module expects it (integer outputs), as jax.export does
                np.zeros(c.shape, jax.dtypes.float0) if a.dtype == jax.dtypes.float0 else c
                for c, a in zip(cts, expected, strict=True)
            ]
            vjp_args = [*primals, *cts]
            m = sum(math.prod(x.shape) for x in jax.tree.leaves(args[1:])) if n is None else n
            self.check(vjp.call, vjp_args, m, order + 1)
            out = self.wrap(vjp, order + 1, m)(*vjp_args)
            return tuple(jax.tree.unflatten(jax.tree.structure(args), jax.tree.leaves(out)))

        call.defvjp(forward, backward)
        return call

    def merge(self, size: int, mapped: list[Any], weights: Any, *inputs: Any) -> Any:
        """The program's ``jax.vmap`` rule: ``size`` rows of each input joined to its batch."""
        rows, sig = self.manifest.get("rows") or {}, self.manifest["signature"]
        if not rows.get("independent"):
            why = rows.get("why") or (
                "this artifact records no verdict on that (it was exported by an older "
                "symjax_mlp); export it again to enable jax.vmap"
            )
            raise SymjaxError(_NO_VMAP.format(caller=self.caller, why=why))
        dim, merged = rows["dim"], []
        for spec, x, on in zip(sig["inputs"], inputs, mapped[1:], strict=True):
            if dim not in spec["shape"]:
                if on:
                    what = {"path": spec["path"], "spec": spec["shape"], "dim": dim}
                    raise SymjaxError(_UNBATCHED.format(caller=self.caller, **what))
                merged.append(x)
                continue
            k = spec["shape"].index(dim)
            x = jnp.moveaxis(x if on else jnp.broadcast_to(x, (size, *x.shape)), 0, k)
            merged.append(x.reshape(*x.shape[:k], -1, *x.shape[k + 2 :]))
        self.check(self.call, (weights, *merged))
        out, split = self.call(weights, *merged), []
        single = sig["output_kind"] == "array"
        for spec, y in zip(sig["outputs"], [out] if single else out, strict=True):
            k = spec["shape"].index(dim) if dim in spec["shape"] else None
            y = y if k is None else y.reshape(*y.shape[:k], size, -1, *y.shape[k + 1 :])
            split.append(y if k is None else jnp.moveaxis(y, k, 0))
        batched = [dim in spec["shape"] for spec in sig["outputs"]]
        return (split[0], batched[0]) if single else (tuple(split), tuple(batched))


def _one_by_one(fn: Callable[..., Any], size: int, mapped: list[bool], *args: Any) -> Any:
    """A ``jax.vmap`` rule that runs ``fn`` once per mapped element (``jax.lax.map``)."""

    def one(xs: list[Any]) -> Any:
        it = iter(xs)
        return fn(*[next(it) if on else a for a, on in zip(args, mapped, strict=True)])

    out = jax.lax.map(one, [a for a, on in zip(args, mapped, strict=True) if on])
    return out, jax.tree.map(lambda _: True, out)


def _traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_agrees(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, bytes], exported: Any
) -> None:
    """Checks the deserialized module against the manifest and ``model.mlirbc``.

    Checksums prove each file is what the manifest recorded; this proves the files belong
    together, and that both runtimes run one program.
    """
    sig = manifest["signature"]
    n_dev = manifest["nr_devices"]
    jaxexport, mlirbc = program_file(manifest, JAXEXPORT), program_file(manifest, MLIRBC)
    symbolic = any(not isinstance(d, int) for a in exported.in_avals for d in a.shape)

    def types(specs: Any) -> list[tuple[tuple[Any, ...], str]]:
        return [(tuple(s["shape"]), s["dtype"]) for s in specs]

    params = sorted(manifest["params"], key=lambda p: p["path"])  # a dict flattens sorted
    want_in, want_out = types(params) + types(sig["inputs"]), types(sig["outputs"])
    got_in = [(shape_dims(a.shape), str(a.dtype)) for a in exported.in_avals]
    got_out = [(shape_dims(a.shape), str(a.dtype)) for a in exported.out_avals]
    names = dict.fromkeys((p["path"] for p in params), 0)
    in_tree = jax.tree.structure(((names, *[0] * len(sig["inputs"])), {}))
    n_out = len(sig["outputs"])
    out_tree = jax.tree.structure(0 if sig["output_kind"] == "array" else (0,) * n_out)
    all_names = [*names, *(s["path"] for s in sig["inputs"])]
    kept = list(exported.module_kept_var_idx)  # the inputs main() takes; IREE runs this list
    args = (["platform_index"] if len(exported.platforms) > 1 else []) + [
        all_names[i] if 0 <= i < len(all_names) else f"#{i}" for i in kept
    ]
    checks = [
        (
            args == list(manifest["mlir_arguments"]) and kept == sorted(set(kept)),
            f"passes {args} to its StableHLO main, not {list(manifest['mlir_arguments'])}",
        ),
        (exported.in_tree == in_tree, f"takes {exported.in_tree}, not {in_tree}"),
        (got_in == want_in, f"takes {got_in}, not {want_in}"),
        (exported.out_tree == out_tree, f"returns {exported.out_tree}, not {out_tree}"),
        (got_out == want_out, f"returns {got_out}, not {want_out}"),
        (
            list(exported.platforms) == list(manifest["platforms"]),
            f"runs on {list(exported.platforms)}, not {list(manifest['platforms'])}",
        ),
        (
            exported.nr_devices == manifest["nr_devices"],
            f"runs on {exported.nr_devices} device(s), not {manifest['nr_devices']}",
        ),
        (
            exported.calling_convention_version == manifest["calling_convention_version"],
            f"has calling convention {exported.calling_convention_version}",
        ),
        (
            len(exported.ordered_effects) == manifest.get("ordered_effects", 0),
            f"has {len(exported.ordered_effects)} ordered effect(s)",
        ),
        (
            bytes(exported.mlir_module_serialized) == blobs[mlirbc],
            f"holds a StableHLO module other than {mlirbc}'s",
        ),
        (
            not exported.disabled_safety_checks,
            f"was exported with jax.export's safety checks disabled "
            f"({', '.join(map(str, exported.disabled_safety_checks))[:200]})",
        ),
        (not exported.unordered_effects, "has effects (host callbacks)"),
        (
            len(exported.in_shardings_hlo) == len(exported.in_avals)
            and len(exported.out_shardings_hlo) == len(exported.out_avals)
            and (n_dev > 1 or not any(exported.in_shardings_hlo + exported.out_shardings_hlo)),
            "has shardings that do not fit its inputs, outputs or device count",
        ),
        (
            bool(exported.uses_global_constants) == (symbolic or len(exported.platforms) > 1),
            "says it uses global constants, which it does not (or the reverse)",
        ),
    ]
    problems = [what for ok, what in checks if not ok]
    if problems:
        raise ArtifactError(
            f"{path / jaxexport} does not match {path / 'manifest.json'} and {mlirbc}: the module "
            + "; ".join(problems)
            + ". The files come from different exports, or one was edited; export it again."
        )
