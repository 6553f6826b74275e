"""Run an artifact with IREE instead of JAX: ``load(path, runtime="iree")``.

For each new input shape JAX lowers the checked module for ``cpu``, every symbolic dimension
refined (IREE cannot compile a dynamic reshape of rank > 2), the loader's ``Guard`` bounds it,
and ``iree.compiler`` compiles it for ``llvm-cpu``; calls run on the ``local-sync`` driver, one
at a time. What IREE cannot run (no ``cpu`` lowering, JAX's custom calls, sharded or effectful
exports) is refused before anything compiles. Each ``.vmfb`` is cached per user, keyed by the
module, IREE, the flags and this CPU, and signed with this user's key: a damaged or planted
entry is compiled again, never run; compiled code is never read from the artifact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
import platform
import re
import threading
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from symjax_mlp import _selftest as selftest
from symjax_mlp._artifact.format import MLIRBC, program_file
from symjax_mlp._artifact.signature import Signature, sizes_at
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import read_cached, sha256, write_cached
from symjax_mlp._selftest import BATCH

TARGET = "llvm-cpu"
DRIVER = "local-sync"
MAX_MODULES = 64  # static modules kept per loaded model, the oldest dropped first
_KNOWN_CUSTOM_CALLS = {"shape_assertion"}  # IREE erases these; everything else it rejects
MAX_OPS = 8192  # once inlined: IREE's compile time grows with their square


def _modules() -> tuple[Any, Any]:
    try:
        import iree.compiler as ic
        import iree.runtime as ir
    except ImportError as e:
        raise ArtifactError(
            "load(runtime='iree') needs IREE's compiler and runtime: "
            "pip install 'symjax_mlp[iree]' (iree-base-compiler, iree-base-runtime). "
            f"Import failed: {e}"
        ) from e
    return ic, ir


def iree_version() -> str:
    """The installed IREE compiler version, e.g. ``3.13.0rc20261016``."""
    from iree.compiler import version

    return str(version.VERSION)


def compile_flags() -> list[str]:
    """The ``iree-compile`` flags used for an artifact (the same as the CLI recipe)."""
    return [
        "--iree-input-type=stablehlo",
        "--iree-hal-target-device=local",
        f"--iree-hal-local-target-device-backends={TARGET}",
        "--iree-llvmcpu-target-cpu=host",
    ]


def check_supported(path: Path, manifest: Mapping[str, Any]) -> None:
    """Refuses, with the reason, artifacts IREE's llvm-cpu cannot run (before compiling)."""
    _modules()
    where = path / "manifest.json"
    if "cpu" not in manifest["platforms"]:
        raise ArtifactError(
            f"{where}: runtime='iree' compiles the cpu lowering for IREE's llvm-cpu, but the "
            f"artifact was exported for {', '.join(manifest['platforms'])} only. Re-export with "
            "'cpu' among the platforms, e.g. platforms=('cpu', 'cuda')."
        )
    if manifest["nr_devices"] != 1:
        raise ArtifactError(
            f"{where}: the artifact is sharded over {manifest['nr_devices']} devices; IREE "
            "runs single-device exports only. Use runtime='jax', or export unsharded."
        )
    keys = [s["path"] for s in manifest["signature"]["inputs"] if s["dtype"].startswith("key")]
    if keys:
        raise ArtifactError(
            f"{where}: the input(s) {', '.join(keys)} are JAX rng keys, which IREE's buffers "
            "cannot hold. Use runtime='jax', or export a function of the key's raw bits "
            "(jax.random.key_data) instead."
        )
    if manifest.get("ordered_effects", 0):
        raise ArtifactError(
            f"{where}: the exported function has ordered effects (e.g. io_callback), which "
            "IREE cannot run. Use runtime='jax'."
        )


def vmfb_cache_key(module_sha256: str) -> str:
    """The cache file name for a module: sha256 of the module, IREE version, target and CPU."""
    text = " ".join([module_sha256, iree_version(), TARGET, _host_key(), *compile_flags()])
    return f"{sha256(text.encode())}.vmfb"


def _host_key() -> str:
    """A short fingerprint of this CPU (``host`` compiles for its exact features)."""
    text = platform.machine()
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        for field in ("model name", "flags", "Features", "CPU part"):
            m = re.search(rf"^{field}\s*:\s*(.*)$", info, re.M)
            text += "|" + (m.group(1) if m else "")
    text += "|" + platform.processor()
    return f"{platform.machine()}-{sha256(text.encode())[:10]}"


def check_program(file: Path, report: Any) -> None:
    """Refuses modules that make custom calls or are too large to compile in seconds."""
    compute = any(p.key == "compute" for p in report.problems)  # load refuses it, naming allow=
    if report.ops > MAX_OPS and not compute:
        raise ArtifactError(
            f"{file}: IREE cannot run this model in bounded time: its module has {report.ops:,} "
            f"ops once every call is inlined, more than the {MAX_OPS:,} IREE compiles in seconds "
            "(its compile time grows with their square: 60,000 took over 10 minutes). Refused "
            "before compiling; use runtime='jax', or trust=True if you trust it and can wait."
        )
    calls = sorted(set(report.custom_calls) - _KNOWN_CUSTOM_CALLS)
    if calls:
        raise ArtifactError(
            f"{file}: IREE cannot run this model: it calls the custom call(s) "
            f"{', '.join(calls)}, which are JAX/XLA runtime kernels (LAPACK for jnp.linalg, "
            "GPU libraries, ...) with no IREE lowering. Use runtime='jax', or express the "
            "computation with plain jnp/lax ops before exporting."
        )


def _compile(file: Path, mlir: bytes, shapes: Any, *, cached: bool = True) -> bytes:
    """Returns the ``.vmfb`` for ``mlir``: from the user's cache, else compiled and cached."""
    ic, _ = _modules()
    name = vmfb_cache_key(sha256(mlir))  # the very module compiled
    if cached and (data := read_cached("iree", name)) is not None:
        return data  # else absent, damaged or planted: compiled again, never run
    try:
        data = ic.compile_str(mlir, input_type="stablehlo", extra_args=compile_flags()[1:])
    except ic.CompilerToolError as e:
        tail = "\n".join(str(e).strip().splitlines()[-12:])
        raise ArtifactError(
            f"{file}: IREE {iree_version()} could not compile it for {TARGET} (its static "
            f"module for inputs {shapes}). Use runtime='jax'. IREE said:\n{tail}"
        ) from e
    write_cached("iree", name, data)
    return data


def runner(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, Any],
    params: Sequence[np.ndarray], *, exported: Any, guard: Callable[..., None] | None = None,
    custom_calls: Any = None,
) -> tuple[Callable[[list[Any]], list[np.ndarray]], dict[str, np.ndarray]]:  # fmt: skip
    """``run(inputs) -> [np.ndarray, ...]`` and the weights: ``run`` compiles a static module
    for each new input shape (the self-test's now); JAX lowers ``exported``, never runs it."""
    import jax
    import jax.extend.mlir as jex
    from iree.runtime.dtypes import map_dtype_to_hal_element_type
    from jax.extend.mlir.dialects import stablehlo as hlo

    from symjax_mlp._compat import without_source_locations
    from symjax_mlp._runtimes.transforms import refined

    _, ir = _modules()
    config, file = ir.Config(DRIVER), path / program_file(manifest, MLIRBC)
    device, usage = config.device, (ir.MemoryType.DEVICE_LOCAL, ir.BufferUsage.DEFAULT)
    signature = Signature.from_json(manifest["signature"])
    names = [p["path"] for p in manifest["params"]]
    weights = dict(zip(names, params, strict=True))
    avals = exported.in_avals[len(exported.in_avals) - len(signature.inputs) :]  # the inputs'
    dtypes = [np.dtype(a.dtype) for a in avals]
    out_dtypes = [np.dtype(a.dtype) for a in exported.out_avals]
    if odd := [f"{s.path} is {d}" for s, d in zip(signature.inputs, dtypes, strict=True)
               if map_dtype_to_hal_element_type(d) is None]:  # fmt: skip
        raise ArtifactError(  # NumPy keeps an int4 a byte, IREE two to a byte
            f"{file}: the input {odd[0]}, a dtype IREE's runtime has no buffer type for. Use "
            "runtime='jax', or export a model taking it as int8 (or float32) instead."
        )

    def place(a: np.ndarray) -> Any:
        kind = map_dtype_to_hal_element_type(a.dtype)
        return device.allocator.allocate_buffer_copy(*usage, device, a, kind)

    # main's arguments, as jax flattens (weights, *inputs): the weights by sorted name
    placed = [place(np.asarray(a, order="C")) for a in jax.tree.leaves(weights)]
    specs = {n: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype) for n, a in weights.items()}
    call = jax.jit(exported.call, keep_unused=True)  # lowered for cpu, whatever JAX's default
    cpu = ("cpu",)
    lowering = types.SimpleNamespace(lower=lambda *a: call.trace(*a).lower(lowering_platforms=cpu))
    week_4 = hlo.StablehloCompatibilityRequirement.WEEK_4
    version = hlo.get_version_from_compatibility_requirement(week_4)
    calls: dict[tuple[Any, ...], Callable[[list[np.ndarray]], list[np.ndarray]]] = {}
    compiling, calling = threading.Lock(), threading.Lock()

    def static(shapes: tuple[Any, ...], inputs: str | None = None) -> Callable[..., Any]:
        structs = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes, strict=True)]
        with without_source_locations():
            module, context = refined(path, manifest, lowering, (specs, *structs),
                                      custom_calls=custom_calls)  # fmt: skip
        described = tuple((s, str(d)) for s, d in zip(shapes, dtypes, strict=True))
        if guard is not None:
            n = sum(map(math.prod, shapes))
            guard(lambda: (module, context), n, described, inputs=inputs and inputs.format(n=n))
        with context:
            buffer = io.BytesIO()
            module.operation.write_bytecode(buffer)
        # as jax.export writes it: StableHLO's portable form, which IREE's MLIR reads
        portable = jex.serialize_portable_artifact(buffer.getvalue(), version)
        system, module, main = _vm_function(ir, config, file, portable, shapes)
        # a static module's results have static shapes: read once, not off every call's views
        results = [tuple(r.shape) for r in jax.tree.leaves(jax.eval_shape(call, specs, *structs))]
        reads = list(enumerate(zip(results, out_dtypes, strict=True)))
        vm, args = system.vm_context, ir.VmVariantList(len(placed) + len(shapes))
        views = [*placed, *(place(np.zeros(s, d)) for s, d in zip(shapes, dtypes, strict=True))]
        for view in views:  # main's arguments, made once: the inputs are written into place
            args.push_ref(view.ref)
        mapped = [v.map() for v in views[len(placed) :]]
        into = [m.asarray(s, d) for m, s, d in zip(mapped, shapes, dtypes, strict=True)]
        lists, buffer_view, array, n = ir.VmVariantList, ir.HalBufferView, np.ndarray, len(reads)

        # each result is copied out of its mapped buffer (the buffers die with ``out``)
        if len(into) == 1 and n == 1:  # one input, one result: the common case, no loops
            (into1,), ((_, (shape1, dtype1)),) = into, reads

            def invoke(inputs: list[Any]) -> list[np.ndarray]:
                out = lists(1)
                with calling:  # one call at a time: they share the input buffers
                    into1[...] = inputs[0]
                    vm.invoke(main, args, out)
                    return [array(shape1, dtype1, out.get_as_object(0, buffer_view).map()).copy()]

        else:

            def invoke(inputs: list[Any]) -> list[np.ndarray]:
                out = lists(n)
                with calling:
                    for a, x in zip(into, inputs, strict=True):
                        a[...] = x
                    vm.invoke(main, args, out)
                    return [array(s, d, out.get_as_object(i, buffer_view).map()).copy()
                            for i, (s, d) in reads]  # fmt: skip

        invoke.holds = (system, module, views, mapped)  # type: ignore[attr-defined]
        return invoke

    def run(args: list[Any]) -> list[np.ndarray]:
        # arrays: LoadedModel checked them
        shapes = (args[0].shape,) if len(args) == 1 else tuple([a.shape for a in args])
        invoke = calls.get(shapes)
        if invoke is None:
            with compiling:
                invoke = calls.get(shapes) or static(shapes)
                while len(calls) >= MAX_MODULES:
                    calls.pop(next(iter(calls)))
                calls[shapes] = invoke
        return invoke(args)

    found = None  # the self-test's shapes: each symbolic dim 2, or a constrained export's
    with contextlib.suppress(ArtifactError):  # unreadable: the self-test, if run, says so
        found = selftest.vectors(path, manifest, blobs)
    # none: drawn as export draws them, a dimension at its term's value ("b + 15": 17)
    loose = dataclasses.replace(signature, constraints=())
    sizes = sizes_at(signature, BATCH) or sizes_at(loose, BATCH)
    first = tuple(x.shape for x in found[1]) if found else tuple(
        selftest.drawn_shapes(signature.inputs, sizes)
    )  # fmt: skip
    calls[first] = static(  # at load: a module that cannot compile fails here
        first,
        f"for inputs of shapes {', '.join(map(str, first))} ({{n:,}} elements; IREE compiles "
        "one module per input shape, the self-test's at load)",
    )
    return run, weights


def _vm_function(ir: Any, config: Any, file: Path, mlir: bytes, shapes: Any) -> tuple[Any, ...]:
    """The context holding the compiled ``mlir`` (cached), the module, and its ``main``."""
    for cached in (True, False):  # a damaged cache entry is compiled again, never trusted
        vmfb = _compile(file, mlir, shapes, cached=cached)
        try:
            context = ir.SystemContext(config=config)
            module = ir.VmModule.copy_buffer(context.instance, vmfb)
            context.add_vm_module(module)
            return context, module, module.lookup_function("main")
        except (RuntimeError, ValueError, KeyError) as e:
            error = e
    raise ArtifactError(f"{file}: IREE could not load the compiled module: {error}") from error
