"""Verify an artifact end to end: reload it in a fresh process and compare with a reference.

The fresh process proves the artifact runs without the caller's state; a crash there is
reported instead of taking the caller down. Arrays cross as .npy files, dtype names beside.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from symjax_mlp._artifact.format import printable
from symjax_mlp._artifact.jaxconfig import shown
from symjax_mlp._artifact.reading import inspect
from symjax_mlp._artifact.signature import sizes_at
from symjax_mlp._errors import (
    ArtifactError,
    ConfigError,
    SymjaxError,
    artifact_path,
    as_bool,
    as_int,
)
from symjax_mlp._load import RUNTIMES, check_admits, load
from symjax_mlp._loaded import LoadedModel
from symjax_mlp._npy import KEY_IMPLS, arrays, draw, host, npy_array
from symjax_mlp._selftest import as_traced
from symjax_mlp._signing import check as check_signature
from symjax_mlp._specs import TensorSpec


@dataclasses.dataclass(frozen=True)
class VerifyCheck:
    """One runtime at one batch size against the reference."""

    runtime: str
    batch: int
    ok: bool
    max_abs_err: float
    detail: str = ""

    def __str__(self) -> str:
        err = "-" if math.isnan(self.max_abs_err) else f"{self.max_abs_err:.3g}"
        mark = "ok  " if self.ok else "FAIL"
        where = f"{self.runtime:<5} batch {self.batch:>5}"
        return f"  {mark} {where}  max |err| {err:>9}  {self.detail}".rstrip()


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify` found; ``ok`` is true when every check passed.

    Attributes:
      path: the artifact directory.
      reference: what the outputs were compared with.
      checks: one :class:`VerifyCheck` per (runtime, batch size).
      load_seconds: per runtime, the time ``load`` took in the fresh process.
      errors: failures of a whole runtime or of the fresh process itself.
      skipped: the batch sizes asked for that the artifact's constraints refuse, each why.
      jax_config: the JAX settings the artifact was exported under (``Artifact.jax_config``).
    """

    path: Path
    reference: str
    rtol: float
    atol: float
    checks: tuple[VerifyCheck, ...]
    load_seconds: Mapping[str, float]
    errors: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    jax_config: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether every check passed (``False`` with none run, or with any error)."""
        return bool(self.checks) and not self.errors and all(c.ok for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON data (``symjax-mlp verify --json``)."""
        checks = [dataclasses.asdict(c) for c in self.checks]
        for c in checks:  # JSON has no NaN
            c["max_abs_err"] = None if math.isnan(c["max_abs_err"]) else c["max_abs_err"]
        return {"path": str(self.path), "ok": self.ok, "reference": self.reference,
                "rtol": self.rtol, "atol": self.atol, "checks": checks,
                "load_seconds": dict(self.load_seconds), "errors": list(self.errors),
                "skipped": list(self.skipped), "jax_config": dict(self.jax_config)}  # fmt: skip

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # a notebook shows the table, as print
        p.text(str(self))

    def __str__(self) -> str:
        loads = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in self.load_seconds.items())
        lines = [
            f"verify {printable(str(self.path))}: {'OK' if self.ok else 'FAILED'}",
            f"  reference: {self.reference}; rtol {self.rtol:g}, atol {self.atol:g}",
            f"  exported under {shown(self.jax_config)} (the reference runs under this process's)",
            f"  load in a fresh process: {loads or '-'}",
        ]
        lines += [str(c) for c in self.checks]
        lines += ["  skipped: " + printable(line) for line in self.skipped]
        for e in self.errors:  # messages quote the artifact: print no terminal escapes
            lines += ["  error: " + printable(line) for line in str(e).splitlines()[:1]]
            lines += ["    " + printable(line) for line in str(e).splitlines()[1:]]
        return "\n".join(lines)


_NO_NUMBER = (bool, np.timedelta64)  # numbers.Integral, but a flag and a duration (of a unit)


def verify(
    path: str | os.PathLike[str],
    reference: Callable[..., Any] | None = None,
    *,
    runtimes: Sequence[str] = ("jax",),
    batches: Sequence[int] = (1, 7, 128),
    rtol: float = 1e-5,
    atol: float = 1e-5,
    seed: int = 0,
    timeout: float = 300.0,
    trust: bool = False,
    allow: Sequence[str] | None = None,
    verify_signature: str | os.PathLike[str] | None = None,
) -> VerifyReport:
    """Reloads an artifact in a fresh Python process, runs random inputs, compares outputs.

    Args:
      path: the artifact directory.
      reference: what to compare with, usually the exported :class:`~symjax_mlp.Hybrid`.
        ``None``: the artifact's own JAX run in this process (to compare runtimes).
      runtimes: the runtimes to load in the fresh process.
      batches: batch sizes to try (ignored for a static-shape artifact: its own batch).
      rtol, atol: tolerances, as in ``numpy.allclose``.
      seed: seeds the random inputs.
      timeout: seconds the fresh process may take.
      trust, allow, verify_signature: passed to every :func:`~symjax_mlp.load`.

    Returns:
      A :class:`VerifyReport`; ``report.ok`` says whether every check passed.

    Raises:
      ArtifactError: the artifact is missing or corrupted (checked here first).
      ConfigError: an option is invalid (``batches`` not sizes >= 1, a negative or NaN
        tolerance, a ``reference`` that is not callable, a LoadedModel for ``path``).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import symjax_mlp as sm
      >>> net, x = sm.mlp((4, 2)), jnp.ones((1, 3))
      >>> h = sm.hybridize(net, net.init(jax.random.key(0), x))
      >>> art = sm.export(h, getfixture("tmp_path") / "my_mlp", example=x)
      >>> report = sm.verify(art.path, reference=h, runtimes=("jax", "iree"))
      >>> report.ok
      True
    """
    if isinstance(runtimes, str) or not runtimes or not set(runtimes) <= set(RUNTIMES):
        shown = runtimes if isinstance(runtimes, str) else tuple(runtimes)
        raise ConfigError(
            f"verify(runtimes={shown!r}): choose from {RUNTIMES}, as a tuple: runtimes=('jax',)."
        )
    runtimes = tuple(dict.fromkeys(runtimes))  # each loaded, checked and timed once
    if isinstance(path, LoadedModel):
        raise ConfigError(
            f"verify({path!r}): pass the artifact's directory, verify(m.path), not the loaded "
            "model: verify loads it afresh in another process."
        )
    path = artifact_path("verify", path)  # named as verify's, not the inspect it calls
    if reference is not None and not callable(reference):
        where = os.fspath(reference) if isinstance(reference, str | os.PathLike) else "its_path"
        raise ConfigError(
            f"verify(reference={reference!r}): pass what to compare with, a callable such as "
            "the exported Hybrid or another artifact loaded (a teammate's: reference=sm.load("
            f"{where!r})), or None (the artifact's own JAX run in this process)."
        )
    if (
        isinstance(batches, str)
        or not isinstance(batches, Iterable)
        or not (batches := tuple(batches))
        or any(
            not isinstance(b, numbers.Integral) or isinstance(b, _NO_NUMBER) or b < 1
            for b in batches
        )
    ):
        raise ConfigError(f"verify(batches={batches!r}): pass a tuple of batch sizes >= 1.")
    batches = tuple(dict.fromkeys(int(b) for b in batches))  # each drawn and checked once
    for option, value in (("rtol", rtol), ("atol", atol)):
        real = isinstance(value, numbers.Real) and not isinstance(value, _NO_NUMBER)
        if not (real and 0 <= value < math.inf):  # NaN is not >= 0
            raise ConfigError(  # inf would pass every output
                f"verify({option}={value!r}): pass a number >= 0, finite, as numpy.allclose takes."
            )
    rtol, atol = float(rtol), float(atol)  # a Fraction, a np.float16: as numpy.allclose takes
    if not isinstance(trust := as_bool(trust), bool):  # 1 == True, as export refuses it
        raise ConfigError(f"verify(trust={trust!r}): expected True or False.")
    seed = as_int(seed)  # each refused here, not as NumPy's or subprocess's raw error
    real = isinstance(timeout, numbers.Real) and not isinstance(timeout, _NO_NUMBER)
    allow = (allow,) if isinstance(allow, str) else allow  # one name, as load(allow=) takes it
    names = allow is None or (isinstance(allow, Iterable) and not isinstance(allow, bytes))
    signed = verify_signature is None or isinstance(verify_signature, str | os.PathLike)
    checks = {
        "seed": (seed, type(seed) is int and seed >= 0, "an int >= 0, e.g. seed=0"),
        "timeout": (timeout, real and 0 < timeout < math.inf, "the seconds, a number > 0"),
        "allow": (allow, names, "a tuple of names, e.g. allow=('name',)"),
        "verify_signature": (verify_signature, signed, "the path of a signature file"),
    }
    for option, (value, ok, fix) in checks.items():
        if not ok:
            raise ConfigError(f"verify({option}={value!r:.80}): pass {fix}.")
    options = {"trust": bool(trust), "allow": sorted(allow or ())}  # load's, as JSON
    if verify_signature is not None:
        options["verify_signature"] = str(Path(verify_signature).resolve())
        key = options["verify_signature"]  # checked before a byte is read
        check_signature(path, key, call=("symjax_mlp.verify", "verify_signature"))
    art = inspect(path)
    sig, rng = art.signature, np.random.default_rng(seed)
    if not any(isinstance(d, str) for s in sig.inputs for d in s.shape):  # static: one size
        batches = ((sig.inputs[0].shape or (1,))[0] if sig.inputs else 1,)
    sizes = {b: sizes_at(sig, b) for b in batches}  # each symbolic dim's, within constraints
    skipped = tuple(_REFUSED.format(b=b, sig=sig) for b, at in sizes.items() if at is None)
    if len(skipped) == len(batches):
        check_admits(art.path, sig)  # no batch passes them: a stranger's manifest?
        raise ConfigError(f"verify(batches={batches!r}): " + "; ".join(skipped))
    sizes = {b: at for b, at in sizes.items() if at is not None}
    _check_size(art.path, sig, [_itemsize(art.path, s) for s in sig.inputs], sizes)
    inputs = {
        b: [draw(rng, tuple(at.get(d, d) for d in s.shape), s.dtype, high=10) for s in sig.inputs]
        for b, at in sizes.items()
    }
    with tempfile.TemporaryDirectory(prefix="symjax_mlp_verify_") as tmp:
        work = Path(tmp)
        job = {"path": str(art.path.resolve()), "runtimes": list(runtimes), "options": options}
        job["dtypes"] = dtypes = {}
        job["batches"] = {str(b): _write(work, f"x{b}", xs, dtypes) for b, xs in inputs.items()}
        (work / "job.json").write_text(json.dumps(job))
        code = "import sys; from symjax_mlp._verify import _worker; sys.exit(_worker(sys.argv[1]))"
        try:
            env = {**os.environ, "JAX_ENABLE_X64": str(int(jax.config.jax_enable_x64))}
            argv = [sys.executable, "-c", code, str(work / "job.json")]
            proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                                  timeout=timeout)  # fmt: skip
        except subprocess.TimeoutExpired:
            return _failed(art.path, rtol, atol, f"the fresh process ran past {timeout:g} s")
        if proc.returncode != 0 or not (work / "result.json").exists():
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
            return _failed(
                art.path, rtol, atol, f"the fresh process exited {proc.returncode}:\n{tail}"
            )
        result = json.loads((work / "result.json").read_text())
        ref_name = "the artifact's JAX run in this process"
        if reference is None:
            reference = load(art.path, **options)
        else:
            ref_name = getattr(reference, "name", None) or type(reference).__name__
        checks, errors = [], []
        for rt in runtimes:
            got = result[rt]
            if "error" in got:
                errors.append(f"{rt}: {got['error']}")
                continue
            for b, xs in inputs.items():  # its inputs and outputs cross as verify's own
                with jax.transfer_guard("allow"):  # under the caller's "disallow" too
                    want = [host(w) for w in _as_list(reference(*as_traced(sig, xs)))]
                outs = [_read(work, n, got["dtypes"]) for n in got["outputs"][str(b)]]
                checks.append(_compare(rt, b, outs, want, rtol, atol))
    loads = {rt: result[rt]["load_seconds"] for rt in runtimes if "load_seconds" in result[rt]}
    return VerifyReport(
        art.path, ref_name, rtol, atol, tuple(checks), loads, tuple(errors), skipped, art.jax_config
    )


MAX_INPUT_BYTES = 64 * 2**20  # of random inputs verify draws, over every batch size
_REFUSED = (
    "batch {b} is not checked: the artifact takes {sig}, whose constraints refuse inputs drawn "
    "at batch {b}. Pass batch sizes within them (verify(batches=...))."
)


def _read(work: Path, name: str, dtypes: Mapping[str, str]) -> Any:
    x = np.load(work / name, allow_pickle=False)
    dtype = dtypes.get(name, "")
    if dtype in KEY_IMPLS:  # an rng key crosses as its key data
        return jax.random.wrap_key_data(x, impl=KEY_IMPLS[dtype])
    return npy_array(x, dtype)


def _itemsize(path: Path, spec: TensorSpec) -> int:
    """The bytes of an element of an input verify can draw (an rng key's data: 16 at most),
    else ArtifactError."""
    if spec.dtype in KEY_IMPLS:
        return 16
    try:
        return draw(np.random.default_rng(0), (0,), spec.dtype).dtype.itemsize
    except TypeError:
        raise ArtifactError(
            f"{path}: the signature's input {spec.path} has dtype {spec.dtype!r}, which names "
            "no array type (float32, bfloat16, int32, key<fry>, ...); the manifest is "
            "corrupted or was edited. Export it again."
        ) from None


def _check_size(
    path: Path, sig: Any, itemsizes: list[int], sizes: Mapping[int, Mapping[str, int]]
) -> None:
    """Refuses random inputs past ``MAX_INPUT_BYTES``: a stranger's manifest chooses them."""

    def nbytes(at: Mapping[str, int]) -> int:
        return sum(
            n * math.prod(at.get(d, 1) if isinstance(d, str) else d for d in spec.shape)
            for spec, n in zip(sig.inputs, itemsizes, strict=True)
        )

    total, batches = sum(nbytes(at) for at in sizes.values()), tuple(sizes)
    if total <= MAX_INPUT_BYTES:
        return
    if nbytes({}) * len(batches) > MAX_INPUT_BYTES:
        raise ArtifactError(
            f"{path}: its signature {sig} asks for {nbytes({}):,} bytes of inputs even at "
            f"batch 1, more than verify draws ({MAX_INPUT_BYTES:,} in all). That is no MLP's "
            "row: check the manifest (symjax-mlp inspect), or call the loaded model on "
            "inputs of your own."
        )
    raise ConfigError(
        f"verify(batches={tuple(batches)!r}): the inputs of {sig} at these batch sizes take "
        f"{total:,} bytes, more than verify draws ({MAX_INPUT_BYTES:,}); pass smaller "
        "batches, e.g. batches=(1, 7)."
    )


def _write(work: Path, prefix: str, arrays: Sequence[Any], dtypes: dict[str, str]) -> list[str]:
    """Saves ``arrays`` as ``prefix_<i>.npy`` (an rng key as its key data), their dtype names
    in ``dtypes``; returns the file names."""
    names = [f"{prefix}_{i}.npy" for i in range(len(arrays))]
    for name, x in zip(names, arrays, strict=True):
        is_key = str(getattr(x, "dtype", "")) in KEY_IMPLS
        np.save(work / name, np.asarray(jax.random.key_data(x)) if is_key else x)
        dtypes[name] = str(x.dtype)
    return names


def _as_list(out: Any) -> list[Any]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _compare(
    rt: str, b: int, outs: list[np.ndarray], want: list[np.ndarray], rtol: float, atol: float
) -> VerifyCheck:
    if len(outs) != len(want):
        return VerifyCheck(rt, b, False, math.nan, f"{len(outs)} outputs, expected {len(want)}")
    err, detail = 0.0, ""
    for i, (o, w) in enumerate(zip(outs, want, strict=True)):
        if o.shape != w.shape or o.dtype != w.dtype:
            shapes = f"{o.dtype}{list(o.shape)} vs {w.dtype}{list(w.shape)}"
            return VerifyCheck(rt, b, False, math.nan, f"output {i} is {shapes}")
        o64, w64 = o.astype(np.float64), w.astype(np.float64)
        same = (o64 == w64) | (np.isnan(o64) & np.isnan(w64))  # a NaN the reference has too
        with np.errstate(invalid="ignore"):  # inf - inf, where ``same`` says 0
            most = float(np.max(np.where(same, 0.0, np.abs(o64 - w64)), initial=0.0))
        err = most if math.isnan(most) else max(err, most)  # a lone NaN: nan, not max()'s 0
        if not np.allclose(o64, w64, rtol=rtol, atol=atol, equal_nan=True):
            detail = f"output {i} differs beyond tolerance"
    return VerifyCheck(rt, b, not detail, err, detail)


def _failed(path: Path, rtol: float, atol: float, why: str) -> VerifyReport:
    return VerifyReport(path, "-", rtol, atol, (), {}, (why,))  # the tolerances asked for


def _worker(job_file: str) -> int:
    """The fresh process: loads the artifact per runtime, runs the inputs, saves outputs."""
    work = Path(job_file).parent
    job = json.loads(Path(job_file).read_text())
    result: dict[str, Any] = {}
    for rt in job["runtimes"]:
        try:
            t0 = time.perf_counter()
            model = load(job["path"], runtime=rt, **job.get("options", {}))
            entry = {"load_seconds": time.perf_counter() - t0, "outputs": {}, "dtypes": {}}
            for b, names in job["batches"].items():
                with jax.transfer_guard("allow"):  # JAX_TRANSFER_GUARD: verify's own inputs
                    xs = as_traced(model.signature, [_read(work, n, job["dtypes"]) for n in names])
                    outs = arrays(model(*xs))  # an rng key: its key data
                entry["outputs"][b] = _write(work, f"y_{rt}_{b}", outs, entry["dtypes"])
        except SymjaxError as e:
            entry = {"error": f"{type(e).__name__}: {e}"}
        result[rt] = entry
    (work / "result.json").write_text(json.dumps(result))
    return 0
