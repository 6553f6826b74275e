"""Run an artifact with IREE instead of JAX: ``load(path, runtime="iree")``.

``model.mlirbc`` (the ``jax.export`` StableHLO module, unchanged) is compiled by
``iree.compiler`` for ``llvm-cpu`` with ``--iree-llvmcpu-target-cpu=host`` and run by
``iree.runtime``. What that takes, found by reading the module and IREE's input conversion:

- The symbolic batch dimension stays dynamic (``tensor<?x512xf32>``); IREE compiles it as is.
- ``jax.export`` guards symbolic dimensions with ``stablehlo.custom_call @shape_assertion``;
  IREE's StableHLO input pipeline erases those calls, so IREE does not check shapes. This
  module checks them itself, with the artifact's :class:`~symjax_mlp.manifest.Signature`,
  before every call (a batch of 0 is rejected here, not by IREE).
- A multi-platform export takes a leading ``i32`` platform index (``main(%platform_index,
  ...)``) and ``stablehlo.case``-switches on it; we pass the index of ``"cpu"``. An export
  without ``"cpu"`` may hold accelerator-only lowerings and is refused.
- Unused params are dropped from the module (``module_kept_var_idx``): the manifest's
  ``mlir_arguments`` lists what ``main`` takes, in order.
- JAX's CPU custom calls (LAPACK ``lapack_*_ffi`` for ``jnp.linalg``) and sharded or
  effectful exports have no IREE lowering: they raise :class:`~symjax_mlp.ArtifactError`,
  never a silent fallback to JAX.

The compiled ``.vmfb`` is cached in the artifact directory under a name keyed by the IREE
version, the target (llvm-cpu, this host's CPU) and the module's sha256, with a ``.sha256``
sidecar. The manifest does not list cache files, so adding one never breaks the checksums.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from symjax_mlp.errors import ArtifactError
from symjax_mlp.manifest import MLIR, MLIRBC, Signature, sha256

__all__ = ["check_supported", "compile_flags", "runner", "vmfb_cache_name"]

TARGET = "llvm-cpu"
DRIVER = "local-task"
_CUSTOM_CALL = re.compile(r"stablehlo\.custom_call\s+@([\w.$-]+)")
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


def vmfb_cache_name() -> str:
    """``model.iree-<version>.llvm-cpu-<host key>.vmfb``: the cache file for this IREE/host."""
    return f"model.iree-{iree_version()}.{TARGET}-{_host_key()}.vmfb"


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


def _compile(path: Path, manifest: Mapping[str, Any], mlirbc: bytes, mlir_text: str) -> bytes:
    """Returns the ``.vmfb`` for ``mlirbc``: from the cache if it is valid, else compiled."""
    ic, _ = _modules()
    calls = sorted(set(_CUSTOM_CALL.findall(mlir_text)) - _KNOWN_CUSTOM_CALLS)
    if calls:
        raise ArtifactError(
            f"{path / MLIR}: IREE cannot run this model: it calls the custom call(s) "
            f"{', '.join(calls)}, which are JAX/XLA runtime kernels (LAPACK for jnp.linalg, "
            "GPU libraries, ...) with no IREE lowering. Use runtime='jax', or express the "
            "computation with plain jnp/lax ops before exporting."
        )
    module_sha = manifest["files"][MLIRBC]["sha256"]
    cache = path / vmfb_cache_name()
    stamp = cache.with_name(cache.name + ".sha256")
    with contextlib.suppress(OSError):
        recorded = stamp.read_text().split()
        data = cache.read_bytes()
        if recorded == [sha256(data), module_sha, *compile_flags()]:
            return data
    try:
        data = ic.compile_str(mlirbc, input_type="stablehlo", extra_args=compile_flags()[1:])
    except ic.CompilerToolError as e:
        tail = "\n".join(str(e).strip().splitlines()[-12:])
        raise ArtifactError(
            f"{path / MLIRBC}: IREE {iree_version()} could not compile it for {TARGET}. "
            f"Use runtime='jax'. IREE said:\n{tail}"
        ) from e
    with contextlib.suppress(OSError):  # a read-only artifact simply is not cached
        _write_atomic(cache, data)
        _write_atomic(stamp, " ".join([sha256(data), module_sha, *compile_flags()]).encode())
    return data


def _write_atomic(file: Path, data: bytes) -> None:
    tmp = file.with_name(f".{file.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, file)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def runner(
    path: Path,
    manifest: Mapping[str, Any],
    blobs: Mapping[str, bytes],
    params: Sequence[np.ndarray],
) -> Callable[[list[Any]], list[np.ndarray]]:
    """Compiles (or reuses) the ``.vmfb`` and returns ``run(inputs) -> [np.ndarray, ...]``."""
    _, ir = _modules()
    vmfb = _compile(path, manifest, blobs[MLIRBC], blobs[MLIR].decode())
    try:
        config = ir.Config(DRIVER)
        context = ir.SystemContext(config=config)
        module = ir.VmModule.copy_buffer(context.instance, vmfb)
        context.add_vm_module(module)
        main = context.modules[module.name]["main"]
    except (RuntimeError, ValueError, KeyError) as e:
        raise ArtifactError(f"{path / MLIRBC}: IREE could not load the compiled module: {e}") from e
    signature = Signature.from_json(manifest["signature"])
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
        result = main(*[host[s] if isinstance(s, int) else s for s in slots])
        outs = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(outs) != n_out:
            raise ArtifactError(f"{path / MLIRBC}: IREE returned {len(outs)} outputs, not {n_out}.")
        return [np.asarray(o) for o in outs]

    return run
