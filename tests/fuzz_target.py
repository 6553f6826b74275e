"""The loader fuzz target: mutate an artifact, load it, call it, and classify what happened.

Every case is a pure function of ``(seed, case)``: it copies the original artifact, applies
one or a few mutations, runs ``sm.load(path)(x)`` and reports one JSON line. The outcomes:

- ``rejected``: a :class:`symjax_mlp.SymjaxError` subclass (the artifact is refused: fine);
- ``same``: it loaded and returned bit-for-bit the original output (a harmless change: fine);
- ``foreign``: any other exception (a bug: the loader must say what is wrong);
- ``wrong``: it loaded and returned something else (a bug: a silent wrong answer);
- ``escaped``: it loaded although the case reads a file outside the artifact directory;
- ``executed``: something in the artifact ran as code (a marker file appeared);
- ``crash`` / ``hang``: the worker process died on a signal / a case ran past its timeout
  (set by the driver, which restarts the worker at the next case).

Mutations (every artifact file): bit flips, truncations, appended/inserted/overwritten bytes,
swapped files, a file from another export, deleted files, a directory, a FIFO or a symlink
(to ``/dev/zero`` or out of the directory) in a file's place; ``manifest.json`` edited as
text (deep nesting, NaN, huge integers, other encodings) and as data (every field: types,
shapes up to 2**64, dtypes, versions, platforms, device counts, file names with ``../`` and
absolute paths, checksums, param names, code in strings). "Re-signed" cases change a file
*and* its checksum in the manifest, so the bytes reach the deserializers: then the files must
still agree with each other, and changed weights must be exactly what an independent
safetensors reader sees.

Usage (``tests/test_fuzz.py`` drives it; the release run is ``SYMJAX_FUZZ_CASES=20000``)::

    python tests/fuzz_target.py fuzz OUT --cases 500 --seed 0 --workers 2   # summary JSON
    python tests/fuzz_target.py show OUT --seed 0 --case 123    # one case, with traceback
    python tests/fuzz_target.py worker OUT SEED FIRST STOP      # JSON lines (the driver's)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import json
import os
import pickle
import queue
import random
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

MANIFEST, JAXEXPORT, MLIRBC, MLIR, PARAMS = (
    "manifest.json",
    "model.jaxexport",
    "model.mlirbc",
    "model.mlir",
    "params.safetensors",
)
FILES = (MANIFEST, JAXEXPORT, MLIRBC, MLIR, PARAMS)
DATA = FILES[1:]
TAG = "@fuzz "  # prefix of the worker's result lines (libraries may print to stdout too)
OK = ("rejected", "same")
MEMORY_LIMIT = 4 << 30  # address space per worker: an enormous allocation fails, visibly
NASTY = (
    None, True, False, 0, -1, 1, 2, 7, 2**31, 2**40, 2**63, -(2**63), 2**64, 1.5,
    float("nan"), float("inf"), "", "b", "float32", "../model.jaxexport", "/etc/passwd",
    "\x00", "x" * 300, [], {}, [2**40, 2**40], [None],
    {"path": "p", "shape": [1], "dtype": "float32"},
)  # fmt: skip
DTYPES = ("float16", "bfloat16", "float64", "int32", "bool", "object", "V8", "<f4", "O", "")
BIG = (2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -1, 0, 3.0, "b", "c", None, True, [3])


# -- the original artifact ---------------------------------------------------------------------
def make(out: Path) -> None:
    """Writes ``out/original`` (a tiny MLP), ``out/other`` (another export), ``out/x.npy``,
    the bait files an escape would read, and a pickle payload that would touch a marker."""
    import jax
    import numpy as np

    import symjax_mlp as sm

    out.mkdir(parents=True, exist_ok=True)
    x = np.asarray(jax.random.normal(jax.random.key(7), (3, 3)), np.float32)
    # (3, 3, 2) on 3 features: two (3, 3) kernels and two (3,) biases, so that a swap of
    # same-shaped params passes every shape check and only the names can tell them apart.
    for name, act, seed in (("original", "tanh", 0), ("other", "relu", 1)):
        net = sm.mlp((3, 3, 2), activation=act)
        h = sm.hybridize(net, net.init(jax.random.key(seed), x))
        sm.export(h, out / name, example=x, overwrite=True)
    np.save(out / "x.npy", x)
    bait = out / "bait"
    bait.mkdir(exist_ok=True)
    for f in FILES:
        shutil.copy(out / "original" / f, bait / f)
    marker = out / "PWNED"

    class Payload:  # unpickling it would create the marker: loading must never unpickle
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (out / "payload.pkl").write_bytes(pickle.dumps(Payload()))


# -- one case ----------------------------------------------------------------------------------
class Context:
    """What a worker knows: the original artifact, its output, and the scratch directory."""

    def __init__(self, out: Path, work: Path):
        import numpy as np

        import symjax_mlp as sm

        self.out, self.work = out.resolve(), work.resolve()
        self.original = self.out / "original"
        self.other = self.out / "other"
        self.case = self.work / "case"
        self.marker = self.out / "PWNED"
        self.x = np.load(self.out / "x.npy")
        self.blobs = {f: (self.original / f).read_bytes() for f in FILES}
        self.other_blobs = {f: (self.other / f).read_bytes() for f in FILES}
        self.manifest = json.loads(self.blobs[MANIFEST])
        self.reference = sm.load(self.original)
        self.expected = _host(self.reference(self.x))
        self.work.mkdir(parents=True, exist_ok=True)
        for f in FILES:  # bait for "../NAME" from the case directory
            (self.work / f).write_bytes(self.blobs[f])

    def reset(self) -> None:
        if self.case.is_symlink() or self.case.is_file():
            self.case.unlink()
        elif self.case.exists():
            shutil.rmtree(self.case)
        self.case.mkdir()
        for f in FILES:
            (self.case / f).write_bytes(self.blobs[f])

    def expected_for_params(self, data: bytes):
        """The output for re-signed weights, read by safetensors' own NumPy reader (None: that
        reader rejects them, or they do not fit the model, so loading must fail)."""
        import safetensors.numpy

        try:
            flat = safetensors.numpy.load(data)
        except Exception:
            return None
        want = {p["path"]: (tuple(p["shape"]), p["dtype"]) for p in self.manifest["params"]}
        got = {k: (tuple(v.shape), str(v.dtype)) for k, v in flat.items()}
        if got != want:
            return None
        tree: dict = {}
        for path, value in flat.items():
            node = tree
            *parents, leaf = path.split("/")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        import symjax_mlp as sm

        return _host(sm.load(self.original, params=tree)(self.x))


def _host(y):
    import numpy as np

    if isinstance(y, tuple):
        return ("tuple", tuple(np.asarray(a) for a in y))
    return (type(y).__name__, (np.asarray(y),))


def _same(a, b, *, nan_equal: bool = False) -> bool:
    import numpy as np

    if a[0] != b[0] or len(a[1]) != len(b[1]):
        return False
    for u, v in zip(a[1], b[1], strict=True):
        if u.shape != v.shape or u.dtype != v.dtype:
            return False
        if nan_equal:
            if not np.array_equal(u, v, equal_nan=True):
                return False
        elif u.tobytes() != v.tobytes():
            return False
    return True


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# byte-level mutations
def _bytes_op(rng: random.Random, data: bytes) -> tuple[str, bytes]:
    op = rng.choice(
        ["flip", "flip", "flip", "truncate", "append", "overwrite", "insert", "delete", "empty"]
    )
    b = bytearray(data)
    if op == "flip" and b:
        n = rng.choice([1, 1, 2, 3, 8])
        for _ in range(n):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return f"flip x{n}", bytes(b)
    if op == "truncate" and b:
        n = rng.randrange(len(b))
        return f"truncate to {n}", bytes(b[:n])
    if op == "append":
        extra = rng.choice(
            [
                rng.randbytes(rng.randint(1, 64)),
                b"\x00" * rng.randint(1, 4096),
                b"{}",
                bytes(b),
            ]
        )
        return f"append {len(extra)}", bytes(b) + extra
    if op == "overwrite" and b:
        i = rng.randrange(len(b))
        chunk = rng.choice([b"\x00", b"\xff", b"\x7f", b"\x80"]) * rng.randint(1, 16)
        b[i : i + len(chunk)] = chunk
        return f"overwrite {len(chunk)} at {i}", bytes(b[: len(data)])
    if op == "insert":
        i = rng.randrange(len(b) + 1)
        chunk = rng.randbytes(rng.randint(1, 16))
        return f"insert {len(chunk)} at {i}", bytes(b[:i]) + chunk + bytes(b[i:])
    if op == "delete" and b:
        i = rng.randrange(len(b))
        n = rng.randint(1, 16)
        return f"delete {n} at {i}", bytes(b[:i] + b[i + n :])
    return "empty", b""


def _raw(rng: random.Random, ctx: Context) -> tuple[list[str], bool]:
    """One file changed on disk, manifest untouched (or the manifest's bytes themselves)."""
    target = rng.choice([MANIFEST, MANIFEST, *DATA])
    file = ctx.case / target
    op = rng.choice(["bytes"] * 8 + ["swap", "other", "delete", "dir", "symlink", "fifo"])
    if op == "bytes":
        what, data = _bytes_op(rng, file.read_bytes())
        file.write_bytes(data)
        return [f"{target}: {what}"], False
    if op == "swap":
        second = rng.choice([f for f in FILES if f != target])
        a, b = file.read_bytes(), (ctx.case / second).read_bytes()
        file.write_bytes(b)
        (ctx.case / second).write_bytes(a)
        return [f"swap {target} <-> {second}"], False
    if op == "other":
        file.write_bytes(ctx.other_blobs[target])
        return [f"{target}: from another export"], False
    file.unlink()
    if op == "delete":
        return [f"delete {target}"], False
    if op == "dir":
        file.mkdir()
        (file / target).write_bytes(ctx.blobs[target])
        return [f"{target}: a directory"], False
    if op == "fifo":
        os.mkfifo(file)
        return [f"{target}: a FIFO"], False
    dest = rng.choice(["/dev/zero", "outside", "outside-abs", "inside"])
    if dest == "/dev/zero":
        os.symlink("/dev/zero", file)
        return [f"{target}: symlink to /dev/zero"], False
    if dest == "inside":
        os.symlink(rng.choice([f for f in FILES if f != target]), file)
        return [f"{target}: symlink to a sibling"], False
    # the same bytes, but outside the artifact: loading must refuse to follow it
    os.symlink(f"../{target}" if dest == "outside" else ctx.out / "bait" / target, file)
    return [f"{target}: symlink out of the artifact ({dest})"], True


def _resigned(rng: random.Random, ctx: Context) -> tuple[list[str], bool, bytes | None]:
    """A data file changed *and* its checksum updated in the manifest."""
    target = rng.choice(DATA)
    op = rng.choice(["bytes"] * 6 + ["other", "swap", "payload", "fields", "fields"])
    blob = ctx.blobs[target]
    if op == "fields" and target == JAXEXPORT:  # the flatbuffer around the embedded module
        start = blob.find(ctx.blobs[MLIRBC])
        outside = [i for i in range(len(blob)) if not start <= i < start + len(ctx.blobs[MLIRBC])]
        b = bytearray(blob)
        for i in rng.sample(outside, rng.choice([1, 1, 2, 4])):
            b[i] ^= 1 << rng.randrange(8)
        what, data = "flip outside the embedded module", bytes(b)
    elif op in ("bytes", "fields"):
        what, data = _bytes_op(rng, blob)
    elif op == "other":
        what, data = "from another export", ctx.other_blobs[target]
    elif op == "swap":
        src = rng.choice([f for f in DATA if f != target])
        what, data = f"holds {src}", ctx.blobs[src]
    else:
        what, data = "a pickle payload", (ctx.out / "payload.pkl").read_bytes()
    (ctx.case / target).write_bytes(data)
    manifest = json.loads(ctx.blobs[MANIFEST])
    manifest["files"][target] = {"sha256": _sha(data), "bytes": len(data)}
    (ctx.case / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return [f"re-signed {target}: {what}"], False, data if target == PARAMS else None


# manifest-level mutations (parsed, edited, written back)
def _nodes(obj, path=()):
    yield path
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _nodes(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _nodes(v, (*path, i))


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _generic(rng, m, ctx):
    path = rng.choice([p for p in _nodes(m) if p])
    parent, key = _get(m, path[:-1]), path[-1]
    value = parent[key]
    op = rng.choice(["nasty", "nasty", "delete", "wrap", "str", "tweak", "rename", "dup"])
    if op == "delete":
        del parent[key]
    elif op == "wrap":
        parent[key] = [value]
    elif op == "str":
        parent[key] = json.dumps(value) if not isinstance(value, str) else value + "x"
    elif op == "tweak" and isinstance(value, int) and not isinstance(value, bool):
        parent[key] = value + rng.choice([-1, 1, 2**32])
    elif op == "rename" and isinstance(parent, dict):
        parent[key + rng.choice(["_", " ", "\x00"])] = parent.pop(key)
    elif op == "dup" and isinstance(parent, list):
        parent.insert(key, value)
    else:
        op = "nasty"
        parent[key] = rng.choice(NASTY)
    return f"{'.'.join(map(str, path))}: {op}", False


def _shape(rng, m, ctx):
    specs = [("params", i) for i in range(len(m["params"]))]
    specs += [("signature", "inputs", 0), ("signature", "outputs", 0)]
    where = rng.choice(specs)
    spec = _get(m, where)
    shape = spec["shape"]
    op = rng.choice(["dim", "dim", "all", "append", "drop", "type"])
    if op == "dim" and shape:
        shape[rng.randrange(len(shape))] = rng.choice(BIG)
    elif op == "all":
        spec["shape"] = [rng.choice(BIG[:6])] * rng.randint(1, 4)
    elif op == "append":
        shape.append(rng.choice(BIG))
    elif op == "drop" and shape:
        shape.pop()
    else:
        op = "type"
        spec["shape"] = rng.choice(["b, 3", 3, None, {"0": 3}, [[3]]])
    return f"{'.'.join(map(str, where))}.shape: {op} -> {spec['shape']!r}"[:200], False


def _dtype(rng, m, ctx):
    specs = [m["params"][i] for i in range(len(m["params"]))]
    specs += [m["signature"]["inputs"][0], m["signature"]["outputs"][0]]
    spec = rng.choice(specs)
    spec["dtype"] = rng.choice((*DTYPES, None, 3, ["float32"]))
    return f"{spec['path']}.dtype -> {spec['dtype']!r}", False


def _version(rng, m, ctx):
    field = rng.choice(
        ["format_version", "calling_convention_version", "nr_devices", "ordered_effects", "format"]
    )
    m[field] = rng.choice(
        [0, 1, 2, -1, 9, 10, 11, 100, 2**40, 2**64, "1", 1.0, True, None, float("nan"), [1]]
    )
    if rng.random() < 0.2:
        m["versions"] = rng.choice([None, [], "0.4.1", {"jax": 1}, {"jax": "0.0.1"}])
    return f"{field} -> {m[field]!r}", False


def _platforms(rng, m, ctx):
    m["platforms"] = rng.choice(
        [["cuda"], ["cpu", "cpu"], "cpu", [], ["tpu", "cpu"], [1], None, ["CPU"], ["cpu", "x"]]
    )
    return f"platforms -> {m['platforms']!r}", False


def _escape(rng, m, ctx):
    """Renames a listed file to a path outside the artifact where the same bytes wait."""
    name = rng.choice(list(m["files"]))
    bait = ctx.out / "bait" / name
    new = rng.choice([
        f"../{name}", str(bait), f"../../{ctx.work.name}/{name}", f"./../{name}",
        f"{name}/../../{name}", "/" + name, "..", ".", "", f"sub/../{name}", f"{name}\x00",
        "a" * 300, MANIFEST, f"..\\{name}", f"~/{name}",
    ])  # fmt: skip
    entry = m["files"].pop(name)
    if rng.random() < 0.5:  # also keep the real name listed: only the extra entry escapes
        m["files"][name] = dict(entry)
    m["files"][new] = entry
    inside = (ctx.case / new).resolve() if "\x00" not in new else None
    escapes = inside is not None and ctx.case.resolve() not in inside.parents
    return f"files: {name!r} listed as {new!r}"[:200], escapes


def _extra_file(rng, m, ctx):
    """Lists one more file, outside the artifact, with its correct checksum."""
    target = rng.choice(["/etc/hostname", "/etc/passwd", str(ctx.out / "x.npy"), "../x.npy"])
    real = ctx.case / target if not target.startswith("/") else Path(target)
    if target == "../x.npy":
        shutil.copy(ctx.out / "x.npy", ctx.work / "x.npy")
    try:
        data = real.read_bytes()
    except OSError:
        data = b""
    m["files"][target] = {"sha256": _sha(data), "bytes": len(data)}
    return f"files: extra entry {target!r}", True


def _entry(rng, m, ctx):
    name = rng.choice(list(m["files"]))
    entry = m["files"][name]
    op = rng.choice(["sha", "sha", "bytes", "bytes", "type", "keys"])
    if op == "sha":
        entry["sha256"] = rng.choice(
            [
                entry["sha256"].upper(),
                _sha(b""),
                _sha(ctx.other_blobs.get(name, b"")),
                None,
                12,
                "",
                entry["sha256"][:16],
            ]
        )
    elif op == "bytes":
        entry["bytes"] = rng.choice([2**40, 2**64, -1, 0, "12", None, entry["bytes"] + 1])
    elif op == "type":
        m["files"][name] = rng.choice([None, "sha", [entry["sha256"]], 3])
    else:
        entry.pop(rng.choice(["sha256", "bytes"]))
    return f"files[{name!r}]: {op}", False


def _names(rng, m, ctx):
    params = m["params"]
    i, j = rng.sample(range(len(params)), 2)
    op = rng.choice(["swap-names", "swap-same-shape", "swap-entries", "rename", "drop", "dup"])
    if op == "swap-same-shape":  # the dangerous one: two (3, 3) kernels trade names
        same = [
            (a, b)
            for a in range(len(params))
            for b in range(a + 1, len(params))
            if params[a]["shape"] == params[b]["shape"]
        ]
        i, j = rng.choice(same)
        op = "swap-names"
    if op == "swap-names":
        params[i]["path"], params[j]["path"] = params[j]["path"], params[i]["path"]
    elif op == "swap-entries":
        params[i], params[j] = params[j], params[i]
    elif op == "rename":
        params[i]["path"] = rng.choice(["params/layers_9/kernel", params[j]["path"], "", "a/b"])
    elif op == "drop":
        params.pop(i)
    else:
        params.append(dict(params[i]))
    return f"params: {op} {i} {j}", False


def _signature(rng, m, ctx):
    sig = m["signature"]
    op = rng.choice(["kind", "kind", "batch", "dup-input", "drop-output", "dup-output", "path"])
    if op == "kind":
        sig["output_kind"] = rng.choice(["tuple", "dict", "", None, "array "])
    elif op == "batch":
        sig["batch"] = rng.choice([None, "c", 3, "", ["b"]])
    elif op == "dup-input":
        sig["inputs"].append(dict(sig["inputs"][0]))
    elif op == "drop-output":
        sig["outputs"].pop()
    elif op == "dup-output":
        sig["outputs"].append(dict(sig["outputs"][0]))
    else:
        sig["inputs"][0]["path"] = rng.choice(["x", "params/layers_0/bias", ""])
    return f"signature: {op}", False


def _code(rng, m, ctx):
    code = f"__import__('pathlib').Path({str(ctx.marker)!r}).touch()"
    where = rng.choice(
        [("name",), ("created",), ("versions", "jax"), ("mlir_arguments", 0), ("format",)]
    )
    parent = _get(m, where[:-1])
    parent[where[-1]] = rng.choice([code, f"{{{code}}}", f"!!python/object:{code}", f"$({code})"])
    return f"code in {'.'.join(map(str, where))}", False


MANIFEST_OPS = (
    [_generic] * 6
    + [_shape] * 4
    + [_dtype] * 2
    + [_version] * 2
    + [_platforms, _escape, _escape, _extra_file, _entry, _entry, _names, _names]
    + [_signature, _signature, _code]
)


def _manifest(rng: random.Random, ctx: Context) -> tuple[list[str], bool]:
    m = json.loads(ctx.blobs[MANIFEST])
    notes, escapes = [], False
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            note, esc = rng.choice(MANIFEST_OPS)(rng, m, ctx)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            note, esc = f"(skipped: an earlier edit removed what this one edits: {e!r})", False
        notes.append(note)
        escapes |= esc
    (ctx.case / MANIFEST).write_text(json.dumps(m, indent=rng.choice([None, 2])))
    return notes, escapes


def _manifest_text(rng: random.Random, ctx: Context) -> tuple[list[str], bool]:
    text = ctx.blobs[MANIFEST].decode()
    op = rng.choice(["deep", "deep-field", "nan", "bigint", "dupkey", "bom", "utf16", "tail"])
    if op == "deep":
        n = rng.choice([1000, 100_000])
        data = ("[" * n + "]" * n).encode()
    elif op == "deep-field":
        n = rng.choice([1000, 100_000])
        key = rng.choice(['"params": ', '"signature": ', '"files": ', '"versions": '])
        data = text.replace(key, key + "[" * n + "]" * n + ', "_": ', 1).encode()
    elif op == "nan":
        data = text.replace('"nr_devices": 1', '"nr_devices": NaN').encode()
    elif op == "bigint":
        data = text.replace('"nr_devices": 1', '"nr_devices": 1' + "0" * 5000).encode()
    elif op == "dupkey":
        data = text.replace('"format_version": 1', '"format_version": 1, "format_version": 2')
        data = data.encode()
    elif op == "bom":
        data = b"\xef\xbb\xbf" + text.encode()
    elif op == "utf16":
        data = text.encode("utf-16")
    else:
        data = text.encode() + rng.choice([b"x", b"\x00", b"{}", b"// comment"])
    (ctx.case / MANIFEST).write_bytes(data)
    return [f"manifest text: {op}"], False


def mutate(rng: random.Random, ctx: Context) -> dict:
    """Applies one case's mutations to ``ctx.case``; returns what the oracle needs."""
    ctx.reset()
    family = rng.choices(["raw", "resigned", "manifest", "text"], weights=[30, 25, 40, 5])[0]
    params = None
    if family == "raw":
        notes, escapes = _raw(rng, ctx)
    elif family == "resigned":
        notes, escapes, params = _resigned(rng, ctx)
    elif family == "manifest":
        notes, escapes = _manifest(rng, ctx)
    else:
        notes, escapes = _manifest_text(rng, ctx)
    return {"family": family, "notes": notes, "escapes": escapes, "params": params}


def run_case(ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False) -> dict:
    """Runs one case; returns its JSON-ready result (``started(info)`` runs before loading)."""
    import symjax_mlp as sm

    rng = random.Random(f"symjax-fuzz:{seed}:{case}")
    t0 = time.perf_counter()
    spec = mutate(rng, ctx)
    if started is not None:
        started({"case": case, "family": spec["family"], "notes": spec["notes"]})
    if spec["params"] is not None:
        expected, nan_equal = ctx.expected_for_params(spec["params"]), True
    else:
        expected, nan_equal = ctx.expected, False
    detail = ""
    sabotage = _sabotage().get(case)
    try:
        where = ctx.original if sabotage else ctx.case  # sabotage: the driver's self-test
        got = _host(sm.load(where)(ctx.x))
        if sabotage:
            got = _sabotaged(sabotage, got)
    except sm.SymjaxError as e:
        outcome, detail = "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:
        outcome = "foreign"
        detail = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])
    else:
        if spec["escapes"]:
            outcome = "escaped"
        elif expected is not None and _same(got, expected, nan_equal=nan_equal):
            outcome = "same"
        else:
            outcome = "wrong"
            detail = f"got {got!r}, expected {expected!r}"
    if ctx.marker.exists():
        outcome, detail = "executed", f"{ctx.marker} appeared"
    if verbose:
        print(detail)
    return {
        "case": case,
        "family": spec["family"],
        "notes": spec["notes"],
        "outcome": outcome,
        "detail": detail[:2000],
        "seconds": round(time.perf_counter() - t0, 4),
        "max_rss_mb": _peak_rss_mb(),
    }


def _sabotage() -> dict[int, str]:
    """``SYMJAX_FUZZ_SELFTEST="3=crash,5=hang,7=foreign,9=wrong"``: cases that misbehave on
    purpose, so a test can check that the driver sees every kind of failure."""
    spec = os.environ.get("SYMJAX_FUZZ_SELFTEST", "")
    return {int(k): v for k, v in (item.split("=") for item in spec.split(",") if item)}


def _sabotaged(kind: str, got):
    if kind == "crash":
        os.kill(os.getpid(), signal.SIGSEGV)
    if kind == "hang":
        time.sleep(3600)
    if kind == "foreign":
        raise RuntimeError("sabotaged")
    return (got[0], tuple(a + 1 for a in got[1]))  # "wrong"


def _peak_rss_mb() -> int:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from the
    process that forked it)."""
    with contextlib.suppress(OSError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024


# -- the worker and its driver -----------------------------------------------------------------
def worker(out: Path, seed: int, first: int, stop: int) -> None:
    """Runs cases ``first`` to ``stop - 1``, one JSON line each (after a ``start`` line)."""
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    work = out / f"work-{os.getpid()}"
    try:
        ctx = Context(out, work)

        def started(info: dict) -> None:
            print(TAG + json.dumps(dict(info, start=True)), flush=True)

        for case in range(first, stop):
            print(TAG + json.dumps(run_case(ctx, seed, case, started=started)), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _pump(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # end of output: the worker exited


def _drive(out: Path, seed: int, cases: list[int], timeout: float, results: dict, log) -> None:
    """Runs ``cases`` (contiguous) in worker processes; restarts after a crash or a hang."""
    todo = collections.deque(cases)
    while todo:
        first, stop = todo[0], todo[-1] + 1
        cmd = [sys.executable, "-W", "error", __file__, "worker", str(out), str(seed)]
        proc = subprocess.Popen(
            [*cmd, str(first), str(stop)],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
        current, started = None, {}
        deadline = time.monotonic() + timeout + 120  # + start-up
        while True:
            try:
                line = lines.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:  # a case (or the start-up) ran past its time: a hang
                proc.kill()
                proc.wait()
                if current is None:
                    raise RuntimeError(f"fuzz worker for {first}..{stop} never started") from None
                results[current] = dict(started, outcome="hang", seconds=timeout)
                results[current].pop("start")
                todo.popleft()
                current = None
                break
            if line is None:
                break
            if not line.startswith(TAG):
                continue
            msg = json.loads(line[len(TAG) :])
            if msg.get("start"):
                current, deadline = msg["case"], time.monotonic() + timeout
                started = msg
            else:
                results[msg["case"]] = msg
                todo.popleft()
                current = None
        rc = proc.wait()
        proc.stdout.close()
        if current is not None:  # died inside a case: that case crashed the interpreter
            results[current] = dict(started, outcome="crash", returncode=rc)
            results[current].pop("start")
            todo.popleft()
        elif rc not in (0, -9) and todo:
            raise RuntimeError(f"fuzz worker exited with {rc} outside a case; see workers.log")


def fuzz(out: Path, *, cases: int, seed: int = 0, workers: int = 2, timeout: float = 30) -> dict:
    """Runs ``cases`` fuzz cases over ``workers`` processes; returns the summary.

    The summary counts outcomes (``counts``), lists every failing case (``failures``, with how
    to reproduce it), and records per-family counts, the slowest case and the workers' peak
    memory.
    """
    out = Path(out).resolve()
    make(out)
    (out / "PWNED").unlink(missing_ok=True)
    ids = list(range(cases))
    size = -(-cases // workers)
    ranges = [ids[i : i + size] for i in range(0, cases, size)]  # contiguous: fewer starts
    results: dict[int, dict] = {}
    t0 = time.perf_counter()
    with open(out / "workers.log", "w") as log:
        threads = [
            threading.Thread(target=_drive, args=(out, seed, r, timeout, results, log))
            for r in ranges
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    missing = sorted(set(ids) - set(results))
    if missing:
        raise RuntimeError(f"fuzz cases {missing[:10]}... produced no result; see workers.log")
    counts = collections.Counter(r["outcome"] for r in results.values())
    families = collections.Counter(
        f"{r.get('family', '?')}:{r['outcome']}" for r in results.values()
    )
    failures = [
        dict(r, reproduce=f"python tests/fuzz_target.py show OUT --seed {seed} --case {r['case']}")
        for r in sorted(results.values(), key=lambda r: r["case"])
        if r["outcome"] not in OK
    ]
    timed = [r for r in results.values() if "seconds" in r]
    return {
        "cases": cases,
        "seed": seed,
        "workers": workers,
        "seconds": round(time.perf_counter() - t0, 1),
        "counts": dict(counts),
        "families": dict(sorted(families.items())),
        "failures": failures,
        "slowest_case_s": max((r["seconds"] for r in timed), default=0),
        "max_rss_mb": max((r.get("max_rss_mb", 0) for r in timed), default=0),
        "code_executed": (out / "PWNED").exists(),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fuzz")
    f.add_argument("out", type=Path)
    f.add_argument("--cases", type=int, default=500)
    f.add_argument("--seed", type=int, default=0)
    f.add_argument("--workers", type=int, default=2)
    f.add_argument("--timeout", type=float, default=30, help="seconds per case")
    s = sub.add_parser("show")
    s.add_argument("out", type=Path)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--case", type=int, required=True)
    w = sub.add_parser("worker")
    w.add_argument("out", type=Path)
    w.add_argument("seed", type=int)
    w.add_argument("first", type=int)
    w.add_argument("stop", type=int)
    args = parser.parse_args(argv)
    if args.cmd == "worker":
        worker(args.out, args.seed, args.first, args.stop)
    elif args.cmd == "show":
        if not (args.out / "original" / MANIFEST).exists():
            make(args.out)
        ctx = Context(args.out, args.out / "work-show")
        result = run_case(ctx, args.seed, args.case, verbose=True)
        print(json.dumps(result, indent=2))
        print(f"the mutated artifact is in {ctx.case}")
    else:
        print(
            json.dumps(
                fuzz(
                    args.out,
                    cases=args.cases,
                    seed=args.seed,
                    workers=args.workers,
                    timeout=args.timeout,
                ),
                indent=2,
            )
        )


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        main(sys.argv[1:])
