"""The hostile-artifact fuzz target: consistent artifacts a stranger made, mutated cheaply.

:func:`make` builds, once, whole hostile artifacts with ``sm.export`` itself and
:mod:`fuzzing.forge` (every file consistent, every checksum right): forged programs (host
callbacks, LAPACK calls with result buffers smaller than their input, unknown custom calls,
recursion, loops of 2**31 steps or of a data-dependent count, 10**10-element tensors, call
explosions, outfeeds, shapes only the call resolves), the loops and LAPACK calls ``sm.export``
writes unchecked, benign programs (the exported MLP itself, and one that adds its output to
itself), and an export of two entry points, a benign default and a second that calls LAPACK
(:func:`two_entries`). Each case copies one and applies a few cheap mutations, each re-signed:

- flipped, deleted or inserted bytes of the *module*, re-serialized into ``model.jaxexport``
  and ``model.mlirbc`` alike (or into another entry point's two files), so the StableHLO
  bytecode reader and the op check see bytes no exporter wrote;
- fields of the ``jax.export`` flatbuffer (``uses_global_constants``, platforms, disabled
  checks, effects, kept arguments), of any entry point's;
- crafted ``params.safetensors`` with a manifest that agrees (duplicate names, zero-size
  tensors of huge dims, overlapping or gapped offsets, unknown fields or dtypes, renamed and
  extra tensors);
- unlisted files planted in the directory (``sitecustomize.py``, ``model.vmfb``, a shared
  library, a FIFO, a symlink out) and *listed* ones (a large sparse file, its checksum right).

The worker loads each case with the defaults and calls it directly and under its own
``jax.jit`` with its own ``pure_callback`` (a forged callback once ran that function and
replaced the answer). Outcomes as in :mod:`fuzzing`; a case is ``same`` only if it returns
bit-for-bit what its benign program gives, ``executed`` if planted code ran or the caller's
callback was called by anything but the caller; every other entry point (``m[name](x)``) must
be refused (the case is then ``rejected``), or it is ``wrong``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from fuzzing import forge
from fuzzing.cases import case_rng, host, same

ENTRIES = "made_entries_linalg"  # a benign default, a hostile second entry point
BENIGN = ("benign_base", "benign_symbolic", ENTRIES)  # their default's output is the oracle
SPARSE_MB = (1, 16, 64)  # sizes of the large listed file (sparse: no disk)


def make(out: Path) -> None:
    """Writes every hostile artifact under ``out/hostile`` (once per run directory)."""
    import numpy as np

    root = out / "hostile"
    if (root / "done").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    static, x = forge.base(root / "benign_base")
    symbolic, _ = forge.base(root / "benign_symbolic", batch="b")
    np.save(root / "x.npy", x)
    for name, edit in forge.PROGRAMS.items():
        forge.forge(static, root / f"forged_{name}", edit)
    forge.forge(static, root / "forged_harmless", forge.harmless)
    forge.forge(symbolic, root / "forged_dynamic_huge", forge.dynamic_huge)
    for name, path in forge.hostile_exports(root).items():
        path.rename(root / f"made_{name}")
    two_entries(root / ENTRIES)
    (root / "done").touch()


def two_entries(path: Path) -> Path:
    """A whole, consistent export of two entry points over one weight: a benign default
    (``scale``) and ``solve``, which calls LAPACK (``jnp.linalg``, which ``jax.export``
    allows). Loading opens the default only; ``m["solve"]`` is checked as the default is, and
    refused."""
    import jax.numpy as jnp

    import symjax_mlp as sm

    x, w = jnp.ones((2, 3), jnp.float32), {"w": jnp.float32(1.5)}
    points = {
        "scale": sm.hybridize(lambda p, x: x * p["w"], w),
        "solve": sm.hybridize(lambda p, x: jnp.linalg.inv(x.T @ x + p["w"] * jnp.eye(3)), w),
    }
    return sm.export(points, path, example=x, batch=None, overwrite=True).path


def _programs(art: Path) -> list[tuple[str, str]]:
    """The ``(.jaxexport, .mlirbc)`` files of each entry point of an artifact, the default's
    first."""
    m = json.loads((art / forge.MANIFEST).read_text())
    own = [e["program_files"] for e in m.get("entries", {}).values()]
    return [(forge.JAXEXPORT, forge.MLIRBC)] + [(f[forge.JAXEXPORT], f[forge.MLIRBC]) for f in own]


class Context:
    """A worker's view: the hostile artifacts, their input, the benign outputs."""

    def __init__(self, out: Path, work: Path):
        import jax
        import numpy as np
        import safetensors.numpy

        import symjax_mlp as sm

        self.out, self.work = out.resolve(), work.resolve()
        self.root = self.out / "hostile"
        self.case = self.work / "case"
        self.marker = self.out / "PWNED"
        self.x = np.load(self.root / "x.npy")
        self.bases = sorted(p.name for p in self.root.iterdir() if p.is_dir())
        self.expected = {b: host(sm.load(self.root / b)(self.x)) for b in BENIGN}
        self.programs = {b: _programs(self.root / b) for b in self.bases}
        self.exported = {
            (b, f): jax.export.deserialize(bytearray((self.root / b / f).read_bytes()))
            for b, files in self.programs.items()
            for f, _ in files
        }
        self.weights = {}  # each base's params, read by safetensors' own reader
        for b in self.bases:
            with contextlib.suppress(Exception):
                self.weights[b] = safetensors.numpy.load_file(self.root / b / "params.safetensors")
        self.zeros = {}  # sha256 of n MiB of zeros: a sparse file's checksum
        for mb in SPARSE_MB:
            digest, chunk = hashlib.sha256(), bytes(1 << 20)
            for _ in range(mb):
                digest.update(chunk)
            self.zeros[mb] = digest.hexdigest()
        self.work.mkdir(parents=True, exist_ok=True)
        self.calls: list = []  # what the caller's own callback saw

    def reset(self, base: str) -> None:
        if self.case.is_symlink() or self.case.is_file():
            self.case.unlink()
        elif self.case.exists():
            shutil.rmtree(self.case)
        shutil.copytree(self.root / base, self.case)


# -- cheap mutations, each re-signed ---------------------------------------------------------------
def _resign(ctx: Context, files: dict[str, bytes] | None = None, edit=None) -> None:
    m = json.loads((ctx.case / forge.MANIFEST).read_text())
    for name, data in (files or {}).items():
        (ctx.case / name).write_bytes(data)
        m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    if edit is not None:
        edit(m)
    (ctx.case / forge.MANIFEST).write_text(json.dumps(m))


def _program(rng: random.Random, ctx: Context, base: str) -> tuple[str, str]:
    """The ``(.jaxexport, .mlirbc)`` of one of ``base``'s entry points (drawn if several)."""
    programs = ctx.programs[base]
    return programs[0] if len(programs) == 1 else rng.choice(programs)


def _module_bytes(rng: random.Random, ctx: Context, base: str) -> str:
    """Corrupts the module bytecode itself, in model.jaxexport and model.mlirbc alike (or in
    another entry point's two files)."""
    jaxexport, mlirbc = _program(rng, ctx, base)
    exported = ctx.exported[base, jaxexport]
    b = bytearray(exported.mlir_module_serialized)
    op = rng.choice(["flip", "flip", "flip", "delete", "insert", "truncate", "overwrite"])
    i = rng.randrange(len(b))
    if op == "flip":
        n = rng.choice([1, 1, 2, 4, 16])
        for _ in range(n):
            j = rng.randrange(len(b))
            b[j] ^= 1 << rng.randrange(8)
        what = f"flip x{n}"
    elif op == "delete":
        n = rng.randint(1, 8)
        del b[i : i + n]
        what = f"delete {n} at {i}"
    elif op == "insert":
        chunk = rng.randbytes(rng.randint(1, 8))
        b[i:i] = chunk
        what = f"insert {len(chunk)} at {i}"
    elif op == "truncate":
        del b[i:]
        what = f"truncate to {i}"
    else:
        chunk = rng.choice([b"\x00", b"\xff", b"\x7f"]) * rng.randint(1, 8)
        b[i : i + len(chunk)] = chunk
        what = f"overwrite {len(chunk)} at {i}"
    module = bytes(b)
    forged = dataclasses.replace(exported, mlir_module_serialized=module)
    _resign(ctx, {mlirbc: module, jaxexport: bytes(forged.serialize())})
    return f"module bytes, in {jaxexport} and {mlirbc}: {what}"


def _fields(rng: random.Random, ctx: Context, base: str) -> str:
    """Edits a field of the jax.export flatbuffer (and the manifest where it records it)."""
    import jax

    jaxexport, _ = _program(rng, ctx, base)
    exported = ctx.exported[base, jaxexport]
    field = rng.choice(
        ["uses_global_constants", "platforms", "disabled_safety_checks", "module_kept_var_idx",
         "nr_devices", "calling_convention_version", "in_shardings_hlo"]
    )  # fmt: skip
    if field == "uses_global_constants":
        value = not exported.uses_global_constants
    elif field == "platforms":
        value = rng.choice([("cuda",), ("cpu", "cpu"), ("cpu", "cuda"), ("tpu", "cpu")])
    elif field == "disabled_safety_checks":
        value = rng.choice([
            (jax.export.DisabledSafetyCheck.platform(),),
            (jax.export.DisabledSafetyCheck.custom_call("xla_ffi_python_cpu_callback"),),
        ])  # fmt: skip
    elif field == "module_kept_var_idx":
        kept = list(exported.module_kept_var_idx)
        value = tuple(kept[:-1] if kept and rng.random() < 0.5 else [*kept, len(kept) + 3])
    elif field == "nr_devices":
        value = rng.choice([2, 8])
    elif field == "calling_convention_version":
        value = rng.choice([9, 10])
    else:
        value = (None,) * (len(exported.in_avals) + rng.choice([-1, 1]))
    try:
        forged = dataclasses.replace(exported, **{field: value})
        data = bytes(forged.serialize())
    except Exception as e:  # jax refuses to serialize some of these: nothing to test
        return f"field {field} -> {value!r}: not serializable ({type(e).__name__})"

    def also(m):
        if (
            field in ("platforms", "nr_devices", "calling_convention_version")
            and rng.random() < 0.7
        ):
            m[field] = list(value) if field == "platforms" else value

    _resign(ctx, {jaxexport: data}, also)
    return f"{jaxexport}: field {field} -> {value!r}"[:200]


def _header(tensors: dict, metadata: dict | None = None) -> bytes:
    head = dict(tensors)
    if metadata is not None:
        head["__metadata__"] = metadata
    return json.dumps(head).encode()


def _safetensors(rng: random.Random, ctx: Context, base: str) -> str:
    """A crafted params.safetensors, with a manifest param list that agrees with it."""
    shapes = {p["path"]: p["shape"] for p in json.loads(
        (ctx.case / forge.MANIFEST).read_text())["params"]}  # fmt: skip
    names = list(shapes)
    op = rng.choice(["dup", "huge-zero", "overlap", "gap", "unknown-field", "dtype", "rename",
                     "extra", "tail", "deep", "bigint", "many"])  # fmt: skip
    weights = ctx.weights[base]  # the artifact's own values, so that only the framing differs
    entries, offset, data = {}, 0, b""
    for n in names:
        raw = weights[n].tobytes() if n in weights else b""
        entries[n] = {
            "dtype": "F32",
            "shape": shapes[n],
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
        data += raw
    params = None
    if op == "dup":
        raw = _header(entries)[:-1] + b", " + json.dumps({names[0]: entries[names[0]]}).encode()[1:]
        header = raw
    else:
        if op == "huge-zero":
            huge = rng.choice([2**40, 2**62, 2**63])
            entries["params/extra"] = {
                "dtype": "F32",
                "shape": [0, huge],
                "data_offsets": [offset, offset],
            }
            params = [*names, "params/extra"]
        elif op == "overlap":
            e = entries[rng.choice(names)]
            e["data_offsets"] = [max(0, e["data_offsets"][0] - 4), e["data_offsets"][1] - 4]
        elif op == "gap":
            data += b"\0" * 4
        elif op == "unknown-field":
            entries[rng.choice(names)]["extra"] = 1
        elif op == "dtype":
            entries[rng.choice(names)]["dtype"] = rng.choice(["F8_E4M3", "C64", "f32", "", "I4"])
        elif op == "rename":
            old = rng.choice(names)
            entries[old + "x"] = entries.pop(old)
            params = [n + "x" if n == old else n for n in names]
        elif op == "extra":
            entries["params/zz"] = {
                "dtype": "F32",
                "shape": [1],
                "data_offsets": [offset, offset + 4],
            }
            data += b"\0" * 4
            params = [*names, "params/zz"] if rng.random() < 0.5 else None
        elif op == "tail":
            data += rng.randbytes(rng.randint(1, 16))
        elif op == "bigint":
            entries[rng.choice(names)]["shape"] = [10**30]
        elif op == "many":
            for i in range(rng.choice([1000, 70_000])):
                entries[f"t{i}"] = {"dtype": "F32", "shape": [0], "data_offsets": [offset, offset]}
        header = _header(entries, rng.choice([None, {"format": "symjax_mlp.params"}, {"a": 1}]))
        if op == "deep":
            header = b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    blob = len(header).to_bytes(8, "little") + header + data

    def agree(m):
        if params is not None:
            want = {p["path"]: p for p in m["params"]}
            m["params"] = [want.get(n, {"path": n, "shape": [0, 1], "dtype": "float32"})
                           for n in params]  # fmt: skip

    _resign(ctx, {"params.safetensors": blob}, agree)
    return f"crafted params.safetensors: {op}"


def _planted(rng: random.Random, ctx: Context, base: str) -> tuple[str, int]:
    """Files in the directory: unlisted (never read) or listed (checked, never used)."""
    code = f"open({str(ctx.marker)!r}, 'w').close()\n"
    op = rng.choice(["python", "vmfb", "so", "fifo", "symlink", "sparse", "sparse"])
    if op == "python":
        for name in ("sitecustomize.py", "usercustomize.py", "__init__.py", "jax.py", "model.py"):
            (ctx.case / name).write_text(code)
        return "planted python files", 0
    if op == "vmfb":
        (ctx.case / "model.vmfb").write_bytes(b"\x7fELF" + rng.randbytes(256))
        return "planted model.vmfb", 0
    if op == "so":
        (ctx.case / "libmodel.so").write_bytes(b"\x7fELF" + rng.randbytes(256))
        return "planted a shared library", 0
    tag = rng.randrange(10**6)  # a second planting plants another file
    if op == "fifo":
        os.mkfifo(ctx.case / f"extra{tag}.fifo")
        return "planted an unlisted FIFO", 0
    if op == "symlink":
        os.symlink("/etc/passwd", ctx.case / f"passwd{tag}")
        return "planted an unlisted symlink out", 0
    mb = rng.choice(SPARSE_MB)
    with open(ctx.case / f"blob{tag}.bin", "wb") as f:
        f.truncate(mb << 20)

    def listed(m):
        m["files"][f"blob{tag}.bin"] = {"sha256": ctx.zeros[mb], "bytes": mb << 20}

    _resign(ctx, None, listed)
    return f"a listed sparse file of {mb} MiB", mb << 20


def mutate(rng: random.Random, ctx: Context) -> dict:
    base = rng.choice(ctx.bases)
    ctx.reset(base)
    notes, largest = [f"base {base}"], 0
    ops = rng.choice([0, 1, 1, 1, 2])
    for _ in range(ops):
        kind = rng.choices(["module", "fields", "safetensors", "planted"], [35, 20, 25, 20])[0]
        if kind == "module":
            note = _module_bytes(rng, ctx, base)
        elif kind == "fields":
            note = _fields(rng, ctx, base)
        elif kind == "safetensors":
            note = _safetensors(rng, ctx, base)
        elif kind == "planted":
            note, size = _planted(rng, ctx, base)
            largest = max(largest, size)
        notes.append(note)
    return {"family": "hostile", "notes": notes, "base": base, "largest": largest}


# -- one case ---------------------------------------------------------------------------------
def run_case(ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False) -> dict:
    import time
    import traceback

    import jax
    import numpy as np

    import symjax_mlp as sm

    rng = case_rng(seed, case)
    t0 = time.perf_counter()
    spec = mutate(rng, ctx)
    if started is not None:
        started({"case": case, "family": spec["family"], "notes": spec["notes"]})
    ctx.calls.clear()

    def mine(v):  # the caller's own callback, in the caller's own jit
        ctx.calls.append(np.asarray(v).shape)
        return np.asarray(v)

    detail, got = "", None
    try:
        m = sm.load(ctx.case)
        got = host(m(ctx.x))

        def caller(x):
            y = jax.pure_callback(mine, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
            return m(y)

        inside = host(jax.jit(caller)(ctx.x))
        ran, refused = [], {}  # the other entry points (ENTRIES'): hostile, so to be refused
        for name in m.entries[1:]:
            try:
                m[name](ctx.x)
                ran.append(name)
            except sm.SymjaxError as e:
                refused[name] = f"{type(e).__name__}: {e}"
    except sm.SymjaxError as e:
        outcome, detail = "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:
        outcome = "foreign"
        detail = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])
    else:
        expected = ctx.expected.get(spec["base"])  # None: a hostile program, which must fail
        if len(ctx.calls) != 1:
            outcome, detail = "executed", f"the caller's callback ran {len(ctx.calls)} times"
        elif ran:
            outcome, detail = "wrong", f"loaded {spec['base']} and its entry points {ran} ran"
        elif expected is not None and same(got, expected) and same(inside, expected):
            outcome = "rejected" if refused else "same"  # the default ran its benign program
            detail = "; ".join(f"m[{n!r}] refused: {why}" for n, why in refused.items())
        else:
            outcome, detail = "wrong", f"loaded {spec['base']} and got {got!r}"
    if ctx.marker.exists():
        outcome, detail = "executed", f"{ctx.marker} appeared"
    if verbose:
        print(detail)
    from fuzzing.worker import peak_rss_mb

    return {
        "case": case,
        "family": spec["family"],
        "notes": spec["notes"],
        "outcome": outcome,
        "detail": detail[:2000],
        "seconds": round(time.perf_counter() - t0, 4),
        "max_rss_mb": peak_rss_mb(),
        "largest_file_mb": round(spec["largest"] / 2**20, 1),
    }
