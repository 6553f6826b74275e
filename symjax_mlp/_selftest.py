"""Self-test vectors: seeded inputs of an artifact's signature and the outputs they gave at
export, in ``selftest.safetensors``; ``load`` refuses a model that no longer reproduces them."""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import safetensors
from jax.errors import JaxRuntimeError

from symjax_mlp._artifact.format import JAXEXPORT, SELFTEST, printable, program_file
from symjax_mlp._artifact.signature import Signature
from symjax_mlp._artifact.weights import decode_params
from symjax_mlp._artifact.weights import encode as encode_tensors
from symjax_mlp._compat import skipping_lapack
from symjax_mlp._errors import ArtifactError, SignatureError, SymjaxError, first_line
from symjax_mlp._hybrid.mesh import program_mesh
from symjax_mlp._npy import draw, host

BATCH = 2  # rows per symbolic batch dimension in the vectors
MAX_INPUT_BYTES = 1 << 20  # inputs of vectors at the example's shapes (a constraint refuses 2)
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}  # XLA may fuse differently across CPUs and versions
ULPS = 4  # a narrower float's outputs: this many of its epsilons (relative and absolute)


COMPUTE = "compute"  # a vector of no element: the narrowest float the program computes in
_NARROW = {"bf16": ml_dtypes.bfloat16, "f16": np.float16}  # StableHLO's, as NumPy's


def tolerance(dtype: Any, compute: Any = None, given: Any = None) -> dict[str, float]:
    """``given`` (the export's ``self_test_tolerance``) or ``TOLERANCE``, and for a float
    narrower than float32 (the output's, or ``compute``, one its program computes in: bfloat16
    matmuls of float32 outputs) at least ``ULPS`` of its epsilon."""
    eps = [float(ml_dtypes.finfo(d).eps) for d in (dtype, compute) if _is_float(d)]
    return {k: max(v, ULPS * max(eps, default=0.0)) for k, v in (given or TOLERANCE).items()}


def _is_float(dtype: Any) -> bool:
    """Whether ``dtype`` is a float ml_dtypes.finfo reads (not None, an int or a bool)."""
    try:
        return dtype is not None and ml_dtypes.finfo(dtype) is not None
    except (ValueError, TypeError):
        return False


def narrowest(module: str) -> Any:
    """The narrowest float (bfloat16, then float16) an exported program's StableHLO text computes
    in, its tensors' element types; ``None`` if none is narrower than float32."""
    found = set(re.findall(r"[x<](bf16|f16)>", module))
    return next((_NARROW[t] for t in _NARROW if t in found), None)


def drawn_shapes(specs: Sequence[Any], sizes: Mapping[str, int] | None = None) -> list[tuple]:
    """``specs``' shapes, a symbolic dimension at its size in ``sizes`` (``"b + 15"``: 17 where
    ``b`` is 2), else ``BATCH``."""
    at = sizes or {}
    return [tuple(at.get(d, BATCH) if isinstance(d, str) else d for d in s.shape) for s in specs]


def inputs(
    specs: Sequence[Any], seed: int = 0, sizes: Mapping[str, int] | None = None
) -> list[np.ndarray] | None:
    """Seeded random inputs of ``specs``' :func:`drawn_shapes` (integers below 4), or ``None``
    when an input cannot be stored (an rng key)."""
    if any(str(spec.dtype).startswith("key") for spec in specs):
        return None
    rng = np.random.default_rng(seed)
    shapes = drawn_shapes(specs, sizes)
    return [draw(rng, s, str(spec.dtype), high=4) for s, spec in zip(shapes, specs, strict=True)]


def as_traced(signature: Signature, xs: Sequence[Any]) -> list[Any]:
    """``xs``, arrays, each weakly typed scalar input as the program was traced on one: a
    Python number (``a.item()``), which is all such an input takes."""
    weak = [s.weak_type for s in signature.inputs]
    return [a.item() if w and not np.shape(a) else a for a, w in zip(xs, weak, strict=True)]


DRAWN_BYTES = 256 << 20  # inputs drawn for the vectors (or export's comparison) at most


def drawn(specs: Any, seed: int = 0, sizes: Any = None) -> list[np.ndarray] | None:
    """:func:`inputs` of ``specs``; ``None`` past :data:`DRAWN_BYTES` (a static shape of 2**40
    rows exports, but no process could draw it, nor run it here)."""
    held = [(s, shape) for s, shape in zip(specs, drawn_shapes(specs, sizes), strict=True)
            if not str(s.dtype).startswith("key")]  # fmt: skip
    total = sum(math.prod(shape) * np.dtype(str(s.dtype)).itemsize for s, shape in held)
    return None if total > DRAWN_BYTES else inputs(specs, seed=seed, sizes=sizes)


def encode(
    xs: Sequence[np.ndarray], outs: Sequence[np.ndarray], compute: Any = None
) -> bytes | None:
    """The vectors as safetensors: ``args[i]`` and ``out[i]``, and ``compute`` (:func:`narrowest`)
    as an empty vector of that dtype; ``None`` if load could not read them back (a float8 or
    int4 tensor, which safetensors or its reader lacks)."""
    tensors = {f"args[{i}]": x for i, x in enumerate(xs)}
    tensors |= {f"out[{i}]": y for i, y in enumerate(outs)}
    tensors |= {} if compute is None else {COMPUTE: np.zeros(0, compute)}
    try:
        data = encode_tensors(tensors, {"format": "symjax_mlp.selftest"})
        decode_params(data, file=SELFTEST)
    except (safetensors.SafetensorError, ArtifactError):
        return None
    return data


_NOT_THE_SOURCE = (
    "export({name}): the exported program does not give the model's results at the example's "
    "shapes ({shapes}): out[{i}] {differs}. {why}"
)
_SHAPE_BRANCH = (
    "The model's Python code decides on a shape (e.g. if x.shape[0] == 1:), and for the "
    "symbolic dimensions it took another branch than for the example. Decide on values with "
    "jnp.where or jax.lax.cond, or export static shapes with batch=None."
)


def against_source(name: str, got: Any, want: Any, xs: Sequence[Any], symbolic: bool) -> None:
    """Raises a ``SignatureError`` unless ``got`` (the exported program's outputs for ``xs``,
    inputs of the example's shapes) is what ``want`` (the model's) is."""
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
        if (differs := difference(host(g), host(w))) is not None:
            differs = differs.replace(" at export", " in the model")
            shapes = ", ".join(f"{np.asarray(x).dtype}{list(np.shape(x))}" for x in xs)
            why = _SHAPE_BRANCH if symbolic else "Do not ship it; report it, with the model."
            raise SignatureError(
                _NOT_THE_SOURCE.format(name=name, shapes=shapes, i=i, differs=differs, why=why)
            )


_UNRESOLVED = (
    "export({name}): the program is sharded over {n} devices ({mesh}) and its shapes are "
    "symbolic ({inputs}), and JAX cannot resolve them for a call (its shape refinement fails: "
    "{error}, below): load() would refuse every call, as jax.export's own call fails. (JAX "
    "fails so for a program exported under jax.set_mesh of Explicit axes.) Pass batch=None to "
    "export the example's static shapes, sharded as they are, or export outside "
    "jax.set_mesh (on one device) where the model runs without the mesh."
)


def check_resolves(name: str, exported: Any, params: Any, xs: Sequence[Any]) -> None:
    """Raises a ``SignatureError`` where a sharded program's symbolic shapes do not resolve
    for ``xs`` (drawn at the signature's shapes) on the mesh load runs it on: each call of
    the artifact would fail (its self-test, skipped for its devices, would not tell)."""
    mesh = program_mesh(exported, exported.nr_devices)
    try:
        with jax.set_mesh(mesh):
            refine_shapes(exported.call, (params, *xs))
    except Exception as e:  # MLIR raises plain exceptions; JAX its runtime errors
        raise SignatureError(
            _UNRESOLVED.format(name=name, n=exported.nr_devices, mesh=dict(mesh.shape),
                               inputs=", ".join(map(str, exported.in_avals[-len(xs) :])),
                               error=type(e).__name__)
        ) from e  # fmt: skip


def refusal(call: Any, params: Any, xs: Any) -> Exception | None:
    """What ``call`` (an exported program's) raises for ``xs`` as its signature checks them."""
    try:
        jax.jit(call)(params, *xs)
    except (ValueError, TypeError) as e:
        return e
    return None


_CLAIMS_MORE = (
    "export({name}): the exported program's signature, {signature}, admits {shapes} (each "
    "dimension variable {n}), and the program refuses them ({error}). The model fixes a size "
    "its signature leaves open: a reshape to the example's rows, a vmap of a fixed axis_size. "
    "Make it take any size (x.reshape(-1, ...)), or pass batch=None (or shapes= with a "
    "constraint) to export what it takes."
)


def claims_more(name: str, signature: Signature, xs: list[Any], refused: Exception) -> None:
    """Raises a ``SignatureError`` where ``signature`` admits the drawn ``xs`` that the
    program refused: the artifact would claim calls it cannot run."""
    try:
        signature.check(xs, caller=f"export({name})")
    except SignatureError:
        return  # a constraint refuses them: the signature says so itself
    shapes = ", ".join(f"{x.dtype}{list(x.shape)}" for x in xs)
    error = first_line(refused, 300)
    raise SignatureError(
        _CLAIMS_MORE.format(name=name, signature=signature, shapes=shapes, n=BATCH,
                            error=error)
    ) from None  # fmt: skip


def refine_shapes(fn: Any, args: Sequence[Any], custom_calls: Any = None) -> bytes:
    """The StableHLO bytecode of ``jax.jit(fn)(*args)``, its symbolic shapes refined to
    ``args``' (what calling an exported program does); raises what JAX and MLIR raise."""
    import io

    import jax.extend.mlir as jex

    lowered = fn if hasattr(fn, "lower") else jax.jit(fn)
    with skipping_lapack(custom_calls):
        ir_module = lowered.lower(*args).compiler_ir("stablehlo")
    buffer = io.BytesIO()
    ir_module.operation.write_bytecode(buffer)
    return jex.refine_polymorphic_shapes(
        buffer.getvalue(), enable_shape_assertions=True, validate_static_shapes=True,
        enable_shardy=jax.config.jax_use_shardy_partitioner,
    )  # fmt: skip


def vectors(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, bytes]
) -> tuple[Path, list[np.ndarray], list[np.ndarray], Any] | None:
    """The self-test's file, inputs, outputs and the narrowest float its program computes in
    (``None``: float32, or an artifact of before), each input a call the signature admits;
    ``None`` for an entry point without vectors (rng key inputs). Raises
    :class:`~symjax_mlp.ArtifactError` for a vector missing or of a shape or dtype refused."""
    name = program_file(manifest, SELFTEST)
    if name is None or name not in blobs:
        return None
    file, sig = path / name, manifest["signature"]
    signature = Signature.from_json(sig)
    found = decode_params(blobs[name], file=file)
    xs, want = [], []
    for vector, what, kept in (("args", "input", xs), ("out", "output", want)):
        for i, spec in enumerate(sig[f"{what}s"]):
            if (a := found.get(f"{vector}[{i}]")) is None:
                raise ArtifactError(
                    f"{file} lacks the vector '{vector}[{i}]'; the artifact is corrupted. "
                    "Export it again."
                )
            if vector == "out" and str(a.dtype) != spec["dtype"]:  # inputs: checked below
                raise ArtifactError(
                    f"{file}: its vector out[{i}] is {a.dtype}{list(a.shape)}, but the "
                    f"signature's output {i} is {signature.outputs[i].type}; the artifact is "
                    "corrupted or was edited. Export it again."
                )
            kept.append(a)
    xs = as_traced(signature, xs)
    try:  # each symbolic dim one size, within the constraints
        signature.check(xs, caller=str(file))
    except SignatureError:
        shapes = ", ".join(f"{np.asarray(x).dtype}{list(np.shape(x))}" for x in xs)
        raise ArtifactError(
            f"{file}: its input vectors, {shapes}, are no call its signature {signature} "
            "admits; the artifact is corrupted or was edited. Export it again."
        ) from None
    return file, xs, want, getattr(found.get(COMPUTE), "dtype", None)


@contextlib.contextmanager
def flags_off() -> Iterator[None]:
    """``jax.debug_nans`` and ``jax.debug_infs`` off: a self-test's NaN or inf is the model's
    recorded answer, not the caller's bug (under them, load said the artifact was corrupted);
    ``jax.transfer_guard`` allowing: its vectors' trip to the device is ours, not the caller's
    unintended transfer (under "disallow", load said the program failed on its vectors)."""
    with jax.debug_nans(False), jax.debug_infs(False), jax.transfer_guard("allow"):
        yield


def run(
    path: Path, manifest: Mapping[str, Any], blobs: Mapping[str, bytes],
    call: Callable[[list[Any]], list[Any]],
) -> None:  # fmt: skip
    """Runs the :func:`vectors` through ``call``; raises :class:`~symjax_mlp.ArtifactError`
    unless every output matches. An entry point without vectors (rng key inputs) passes."""
    if (found := vectors(path, manifest, blobs)) is None:
        return
    file, xs, want, compute = found
    caller = f'symjax_mlp.load("{printable(str(path))}")'
    try:  # block_until_ready first: np.asarray of a failed result aborts the process
        with flags_off():
            got = [np.asarray(y) for y in jax.block_until_ready(call(list(xs)))]
        given = manifest.get("self_test_tolerance")  # check_schema's: within MAX_TOLERANCE
        differs = [difference(g, w, compute, given) for g, w in zip(got, want, strict=True)]
    except (JaxRuntimeError, SymjaxError) as e:  # failed as it ran, or as it was called
        cause = e if isinstance(e, JaxRuntimeError) else e.__cause__
        # (XLA's out of memory as jaxlib's C++ dispatch raises it is a ValueError)
        oom = isinstance(cause, ValueError) and str(cause).startswith("RESOURCE_EXHAUSTED")
        if not (isinstance(cause, JaxRuntimeError) or oom):
            raise ArtifactError(f"{file}: its vectors do not run: {e}") from None
        program = printable(str(path / program_file(manifest, JAXEXPORT)))
        where = " on its self-test vectors, at load"
        raise run_failed(caller, program, cause, xs, where) from cause
    except MemoryError as e:  # NumPy's, reading or comparing the results
        raise ArtifactError(
            f"{caller}: this process ran out of memory reading or comparing the outputs of its "
            f"self-test ({e!r}). Load it where there is more memory, or with self_test=False "
            "to inspect it anyway."
        ) from e
    for i, d in enumerate(differs):
        if d is not None:
            loop = _ADAPTIVE * ("while" in manifest.get("needs", ()))
            raise ArtifactError(
                f"{caller}: the model no longer reproduces its self-test: out[{i}] {d}. The "
                "weights, the module or this platform's numerics changed; do not trust its "
                "answers. Export it again, or load with self_test=False to inspect it anyway."
                + loop.format(tol="the tolerance its exporter set" if given else "the default's")
            )


_ADAPTIVE = (
    " Its program has a while loop whose trip count depends on values (an adaptive ODE "
    "solver's steps): another CPU, jaxlib or XLA flags may round it into other steps, moving "
    "its answer within the model's own tolerance but past {tol}. If so, its exporter can "
    "export it with sm.export(..., self_test_tolerance=<the solver's rtol, e.g. 1e-3>)."
)


def difference(
    got: np.ndarray, want: np.ndarray, compute: Any = None, given: Any = None
) -> str | None:
    """How ``got`` differs from the vector ``want``, or ``None`` if it reproduces it: NaN equals
    NaN, an infinity the same infinity, every other value within :func:`tolerance` of it (of
    ``compute``'s epsilon too, a float its program computes in; ``given``: the export's)."""
    if got.shape != want.shape:
        return f"has shape {got.shape}, but gave {want.shape} at export"
    if got.dtype == want.dtype and np.array_equal(got, want):  # as a rerun here mostly is
        return None
    parts = np.iscomplexobj(got) or np.iscomplexobj(want)  # (re, im) on a last axis, each apart
    g64, w64 = (np.asarray(np.stack([a.real, a.imag], -1) if parts else a, np.float64)
                for a in (got, want))  # fmt: skip
    tol = tolerance(want.dtype, compute, given)
    if np.allclose(g64, w64, equal_nan=True, **tol):
        return None
    nan_g, nan_w = np.isnan(g64), np.isnan(w64)
    if (odd := nan_g != nan_w).any():
        odd = odd.any(-1) if parts else odd
        at = tuple(int(k) for k in np.argwhere(odd)[0])
        g, w = (got, want) if parts else (g64, w64)
        return (
            f"is {g[at]} at index {at}, where it gave {w[at]} at export "
            f"({int(odd.sum())} value(s) NaN in one and not the other)"
        )
    with np.errstate(invalid="ignore"):
        err = np.where(nan_w | (g64 == w64), 0.0, np.abs(g64 - w64))
        allowed = tol["atol"] + tol["rtol"] * np.abs(w64)  # np.allclose's, at each value
        over = np.where(np.isinf(err), np.inf, err / allowed)  # (inf where it allows inf too)
    at = tuple(int(k) for k in np.unravel_index(np.argmax(over), over.shape))  # the worst
    g, w = (got[at[:-1]], want[at[:-1]]) if parts else (got[at], want[at])
    return (
        f"differs from what it gave at export by up to {float(np.max(err)):.3g}; worst at index "
        f"{at[:-1] if parts else at}: it is {g}, where it gave {w} at export, off by "
        f"{float(err[at]):.3g} where rtol {tol['rtol']:g} and atol {tol['atol']:g} allow "
        f"{float(allowed[at]):.3g}"
    )


_OUT_OF_MEMORY = (
    "{caller}: its program ran out of memory{where} ({error}). The device could not allocate "
    "what it needs{shapes}: call it on fewer rows at a time, free memory (other models, other "
    "processes), or run it where more memory is available."
)
_RUN_FAILED = (
    "{caller}: running the program of {file}{where} failed ({error}). The artifact's files "
    "agree with each other but its program does not run here; it is corrupted, was edited, "
    "or was made for another JAX. Export it again."
)


def out_of_memory(caller: str, error: Exception, where: str) -> None:
    """Raises :func:`run_failed`'s out-of-memory ``ArtifactError`` where ``error``, raised as
    a program ran, is XLA's RESOURCE_EXHAUSTED (this machine's memory, not the program)."""
    if "RESOURCE_EXHAUSTED" in str(error):
        raise run_failed(caller, None, error, None, where) from error


def run_failed(
    caller: str, file: Any, error: Exception, inputs: Any = None, where: str = ""
) -> ArtifactError:
    """The :class:`~symjax_mlp.ArtifactError` for a program of ``file`` that failed as it ran
    (``where``: the self-test), out of memory (RESOURCE_EXHAUSTED) on ``inputs`` or else."""
    text = printable(str(error)[:600])
    fields = {"caller": caller, "where": where, "error": f"{type(error).__name__}: {text}"}
    if "RESOURCE_EXHAUSTED" not in text:
        return ArtifactError(_RUN_FAILED.format(file=file, **fields))
    shapes = ""
    if inputs is not None:
        listed = [f"{getattr(x, 'dtype', '?')}{list(getattr(x, 'shape', ()))}" for x in inputs]
        shapes = f" for inputs {', '.join(listed)}"
    return ArtifactError(_OUT_OF_MEMORY.format(shapes=shapes, **fields))
