"""Run an artifact with IREE instead of JAX: ``load(path, runtime="iree")``.

``model.mlirbc`` (the ``jax.export`` StableHLO module, unchanged, checked by the loader as for
the JAX runtime) is compiled by ``iree.compiler`` for ``llvm-cpu`` with
``--iree-llvmcpu-target-cpu=host`` and run by ``iree.runtime``. What running it takes:

- The symbolic batch dimension stays dynamic (``tensor<?x512xf32>``); IREE compiles it as is.
- IREE's StableHLO input pipeline erases ``jax.export``'s ``@shape_assertion`` calls, so this
  module checks shapes itself, with the artifact's :class:`~symjax_mlp.Signature`, before
  every call.
- A multi-platform export takes a leading ``i32`` platform index (``main(%platform_index,
  ...)``) and ``stablehlo.case``-switches on it; we pass the index of ``"cpu"``. An export
  without ``"cpu"`` may hold accelerator-only lowerings and is refused.
- Unused params are dropped from the module (``module_kept_var_idx``): the manifest's
  ``mlir_arguments`` lists what ``main`` takes, in order.
- JAX's CPU custom calls (LAPACK ``lapack_*_ffi`` for ``jnp.linalg``) and sharded or
  effectful exports have no IREE lowering: they raise :class:`~symjax_mlp.ArtifactError`,
  never a silent fallback to JAX.
- IREE's compiler folds shapes computed from constants while it compiles, so a huge tensor
  could be built in the compiler's memory, unseen by the static op check. The loader's
  per-call bound (:class:`symjax_mlp._load.Guard`) is therefore applied to the module refined
  for the self-test's shapes before IREE compiles it, and to each new input signature
  before IREE runs it.

The compiled ``.vmfb`` is cached in a per-user directory (:func:`cache_dir`), keyed by the
sha256 of ``model.mlirbc``, the IREE version, the target and this host's CPU, and stored
with its own sha256 (a damaged entry is compiled again, never run). Compiled code is never
read from the artifact directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import platform
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from symjax_mlp._artifact.format import MLIRBC, program_file
from symjax_mlp._artifact.signature import Signature
from symjax_mlp._errors import ArtifactError
from symjax_mlp._files import cache_dir as cache_dir_of
from symjax_mlp._files import sha256, write_file_atomic
from symjax_mlp._selftest import BATCH

TARGET = "llvm-cpu"
DRIVER = "local-task"
_KNOWN_CUSTOM_CALLS = {"shape_assertion"}  # IREE erases these; everything else it rejects


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
    if manifest.get("ordered_effects", 0):
        raise ArtifactError(
            f"{where}: the exported function has ordered effects (e.g. io_callback), which "
            "IREE cannot run. Use runtime='jax'."
        )


def cache_dir() -> Path:
    """Where compiled ``.vmfb`` files are cached: ``$XDG_CACHE_HOME/symjax_mlp/iree``
    (default ``~/.cache/symjax_mlp/iree``), never the artifact."""
    return cache_dir_of("iree")


def vmfb_cache_key(module_sha256: str) -> str:
    """The cache file name for a module: sha256 of the module, IREE version, target and CPU."""
    text = " ".join([module_sha256, iree_version(), TARGET, _host_key(), *compile_flags()])
    return f"{hashlib.sha256(text.encode()).hexdigest()}.vmfb"


def _host_key() -> str:
    """A short fingerprint of this CPU (``host`` compiles for its exact features)."""
    text = platform.machine()
    with contextlib.suppress(OSError):
        info = Path("/proc/cpuinfo").read_text()
        for field in ("model name", "flags", "Features", "CPU part"):
            m = re.search(rf"^{field}\s*:\s*(.*)$", info, re.M)
            text += "|" + (m.group(1) if m else "")
    text += "|" + platform.processor()
    return f"{platform.machine()}-{hashlib.sha256(text.encode()).hexdigest()[:10]}"


def check_program(file: Path, report: Any) -> None:
    """Refuses modules IREE cannot compile (custom calls), read from the module that runs
    (``file``: its ``.mlirbc``)."""
    calls = sorted(set(report.custom_calls) - _KNOWN_CUSTOM_CALLS)
    if calls:
        raise ArtifactError(
            f"{file}: IREE cannot run this model: it calls the custom call(s) "
            f"{', '.join(calls)}, which are JAX/XLA runtime kernels (LAPACK for jnp.linalg, "
            "GPU libraries, ...) with no IREE lowering. Use runtime='jax', or express the "
            "computation with plain jnp/lax ops before exporting."
        )


def _compile(file: Path, mlirbc: bytes, *, cached: bool = True) -> bytes:
    """Returns the ``.vmfb`` for ``mlirbc``: from the user's cache, else compiled and cached."""
    ic, _ = _modules()
    # keyed by the module's own sha256, computed here, not read from the manifest
    cache = cache_dir() / vmfb_cache_key(sha256(mlirbc))
    if cached:
        with contextlib.suppress(OSError):  # an entry is "<sha256 hex>\n<vmfb>"
            digest, _, data = cache.read_bytes().partition(b"\n")
            if digest == sha256(data).encode():
                return data  # else damaged: compiled again, never run
    try:
        data = ic.compile_str(bytes(mlirbc), input_type="stablehlo", extra_args=compile_flags()[1:])
    except ic.CompilerToolError as e:
        tail = "\n".join(str(e).strip().splitlines()[-12:])
        raise ArtifactError(
            f"{file}: IREE {iree_version()} could not compile it for {TARGET}. "
            f"Use runtime='jax'. IREE said:\n{tail}"
        ) from e
    with contextlib.suppress(OSError):  # an unwritable cache directory: just not cached
        cache.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(cache, sha256(data).encode() + b"\n" + data)
    return data


def runner(
    path: Path,
    manifest: Mapping[str, Any],
    blobs: Mapping[str, Any],
    params: Sequence[np.ndarray],
    *,
    exported: Any,
    guard: Callable[..., None] | None = None,
    custom_calls: Any = None,
) -> tuple[Callable[[list[Any]], list[np.ndarray]], dict[str, np.ndarray]]:
    """Compiles (or reuses) the ``.vmfb`` and returns ``run(inputs) -> [np.ndarray, ...]``
    and the weights. ``exported`` is not run, only refined by JAX for ``guard`` (``None``
    when trusted), as the module docstring says; ``custom_calls``: the targets the module
    calls, for JAX's lowering."""
    _, ir = _modules()
    config = ir.Config(DRIVER)
    name = program_file(manifest, MLIRBC)
    signature = Signature.from_json(manifest["signature"])
    check = None
    checked: set[Any] = set()  # (shape, dtype) of the inputs of each call the guard passed
    if guard is not None:
        check = _checker(path, manifest, exported, params, guard, custom_calls)
        structs = _compiled_for(signature, exported)
        shapes = ", ".join(str(s.shape) for s in structs)
        check(
            structs,
            inputs=(
                f"for inputs of shapes {shapes} ({{n:,}} elements; IREE compiles one module for "
                f"every batch, checked here at the self-test's batch of {BATCH})"
            ),
        )
        checked.add(tuple((s.shape, s.dtype) for s in structs))
    for cached in (True, False):  # a damaged cache entry is compiled again, never trusted
        vmfb = _compile(path / name, blobs[name], cached=cached)
        try:
            context = ir.SystemContext(config=config)
            module = ir.VmModule.copy_buffer(context.instance, vmfb)
            context.add_vm_module(module)
            main = context.modules[module.name]["main"]
            break
        except (RuntimeError, ValueError, KeyError) as e:
            if not cached:
                raise ArtifactError(
                    f"{path / name}: IREE could not load the compiled module: {e}"
                ) from e
    names = [p["path"] for p in manifest["params"]]
    on_device = {
        n: ir.asdevicearray(config.device, np.asarray(p))
        for n, p in zip(names, params, strict=True)
    }
    slots: list[Any] = []  # per mlir argument: a device array, or the index of a call input
    inputs = {s.path: i for i, s in enumerate(signature.inputs)}
    for arg in manifest["mlir_arguments"]:
        if arg == "platform_index":
            slots.append(np.asarray(list(manifest["platforms"]).index("cpu"), np.int32))
        elif arg in inputs:
            slots.append(inputs[arg])
        elif arg in on_device:
            slots.append(on_device[arg])
        else:
            raise ArtifactError(
                f"{path / 'manifest.json'}: mlir_arguments names {arg!r}, which is neither a "
                "param nor an input of the artifact. The manifest was edited; export it again."
            )
    n_out = len(signature.outputs)

    def run(args: list[Any]) -> list[np.ndarray]:
        host = [np.asarray(a) for a in args]
        if check is not None:
            key = tuple([(a.shape, a.dtype) for a in host])
            if key not in checked:  # a new input signature: its refined shapes first
                check(host)
                if len(checked) < 256:
                    checked.add(key)
        result = main(*[host[s] if isinstance(s, int) else s for s in slots])
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(outs) != n_out:
            raise ArtifactError(f"{path / name}: IREE returned {len(outs)} outputs, not {n_out}.")
        return [np.asarray(o) for o in outs]

    return run, dict(zip(names, params, strict=True))


def _compiled_for(signature: Signature, exported: Any) -> list[Any]:
    """The input shapes IREE's module is checked at before it compiles: the self-test's
    (each symbolic dimension ``BATCH``, as ``export`` ran them), the dtypes the module takes."""
    import jax

    avals = exported.in_avals[len(exported.in_avals) - len(signature.inputs) :]
    return [
        jax.ShapeDtypeStruct(tuple(BATCH if isinstance(d, str) else d for d in s.shape), a.dtype)
        for s, a in zip(signature.inputs, avals, strict=True)
    ]


def _checker(
    path: Path, manifest: Mapping[str, Any], exported: Any, params: Sequence[np.ndarray],
    guard: Callable[..., None], custom_calls: Any,
) -> Callable[..., None]:  # fmt: skip
    """``check(xs, inputs=...)``: ``guard`` applied to ``exported`` refined by JAX for the
    shapes of ``xs`` (arrays or ``jax.ShapeDtypeStruct``), as the JAX runtime applies it;
    ``inputs``: how a refusal names them (``{n}``: their element count)."""
    import math

    import jax

    from symjax_mlp._runtimes.jax import refined

    call = jax.jit(exported.call)
    names = [p["path"] for p in manifest["params"]]
    weights = {n: jax.ShapeDtypeStruct(np.shape(a), np.asarray(a).dtype)
               for n, a in zip(names, params, strict=True)}  # fmt: skip

    def check(xs: Sequence[Any], *, inputs: str | None = None) -> None:
        shapes = tuple((tuple(x.shape), str(x.dtype)) for x in xs)
        n = sum(math.prod(s) for s, _ in shapes)
        structs = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in xs]
        guard(
            lambda: refined(path, manifest, call, (weights, *structs), custom_calls=custom_calls),
            n,
            shapes,
            inputs=None if inputs is None else inputs.format(n=n),
        )

    return check
