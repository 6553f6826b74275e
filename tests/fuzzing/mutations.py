"""How one case's files are mutated: on disk, re-signed, the manifest as data and as text.

Mutations (every artifact file): bit flips, truncations, appended/inserted/overwritten bytes,
swapped files, a file from another export, deleted files, a directory, a FIFO or a symlink
(to ``/dev/zero`` or out of the directory) in a file's place; ``manifest.json`` edited as
text (deep nesting, NaN, huge integers, other encodings) and as data (every field: types,
shapes up to 2**64, dtypes, versions, platforms, device counts, file names with ``../`` and
absolute paths, checksums, param names, code in strings). "Re-signed" cases change a file
*and* its checksum in the manifest, so the bytes reach the deserializers: then the files must
still agree with each other, and changed weights must be exactly what an independent
safetensors reader sees. (:mod:`fuzzing.entries` runs these on an artifact of two entry
points, every file of both among the targets, with its own mutations of the entry points.)

Every function draws only from the ``rng`` it is given, in a fixed order: a case is a pure
function of its seed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from fuzzing.cases import MANIFEST, PARAMS, Context

NASTY = (
    None, True, False, 0, -1, 1, 2, 7, 2**31, 2**40, 2**63, -(2**63), 2**64, 1.5,
    float("nan"), float("inf"), "", "b", "float32", "../model.jaxexport", "/etc/passwd",
    "\x00", "x" * 300, [], {}, [2**40, 2**40], [None],
    {"path": "p", "shape": [1], "dtype": "float32"},
)  # fmt: skip
DTYPES = ("float16", "bfloat16", "float64", "int32", "bool", "object", "V8", "<f4", "O", "")
BIG = (2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -1, 0, 3.0, "b", "c", None, True, [3])


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
    target = rng.choice([MANIFEST, MANIFEST, *ctx.DATA])
    file = ctx.case / target
    op = rng.choice(["bytes"] * 8 + ["swap", "other", "delete", "dir", "symlink", "fifo"])
    if op == "bytes":
        what, data = _bytes_op(rng, file.read_bytes())
        file.write_bytes(data)
        return [f"{target}: {what}"], False
    if op == "swap":
        second = rng.choice([f for f in ctx.FILES if f != target])
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
        os.symlink(rng.choice([f for f in ctx.FILES if f != target]), file)
        return [f"{target}: symlink to a sibling"], False
    # the same bytes, but outside the artifact: loading must refuse to follow it
    os.symlink(f"../{target}" if dest == "outside" else ctx.bait / target, file)
    return [f"{target}: symlink out of the artifact ({dest})"], True


def _resigned(rng: random.Random, ctx: Context) -> tuple[list[str], bool, bytes | None]:
    """A data file changed *and* its checksum updated in the manifest."""
    target = rng.choice(ctx.DATA)
    op = rng.choice(["bytes"] * 6 + ["other", "swap", "payload", "fields", "fields"])
    blob = ctx.blobs[target]
    if op == "fields" and target in ctx.MODULES:  # the flatbuffer around the embedded module
        module = ctx.blobs[ctx.MODULES[target]]
        start = blob.find(module)
        outside = [i for i in range(len(blob)) if not start <= i < start + len(module)]
        b = bytearray(blob)
        for i in rng.sample(outside, rng.choice([1, 1, 2, 4])):
            b[i] ^= 1 << rng.randrange(8)
        what, data = "flip outside the embedded module", bytes(b)
    elif op in ("bytes", "fields"):
        what, data = _bytes_op(rng, blob)
    elif op == "other":
        what, data = "from another export", ctx.other_blobs[target]
    elif op == "swap":
        src = rng.choice([f for f in ctx.DATA if f != target])
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
    bait = ctx.bait / name
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
    target = rng.choice(["/etc/hostname", "/etc/passwd", str(ctx.inputs), "../x.npy"])
    real = ctx.case / target if not target.startswith("/") else Path(target)
    if target == "../x.npy":
        shutil.copy(ctx.inputs, ctx.work / "x.npy")
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


def _manifest(rng: random.Random, ctx: Context, ops=MANIFEST_OPS) -> tuple[list[str], bool]:
    """One to three of ``ops``, each ``(rng, manifest, ctx) -> (note, escapes)``, applied to
    the manifest as data."""
    m = json.loads(ctx.blobs[MANIFEST])
    notes, escapes = [], False
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        try:
            note, esc = rng.choice(ops)(rng, m, ctx)
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
        data = text.replace('"format_version": 2', '"format_version": 2, "format_version": 1')
        data = data.encode()
    elif op == "bom":
        data = b"\xef\xbb\xbf" + text.encode()
    elif op == "utf16":
        data = text.encode("utf-16")
    else:
        data = text.encode() + rng.choice([b"x", b"\x00", b"{}", b"// comment"])
    (ctx.case / MANIFEST).write_bytes(data)
    return [f"manifest text: {op}"], False


FAMILIES = {"raw": 30, "resigned": 25, "manifest": 40, "text": 5}  # how often each is drawn


def mutate(rng: random.Random, ctx: Context, families=FAMILIES, extra=None) -> dict:
    """Applies one case's mutations to ``ctx.case``; returns what the oracle needs.

    ``families`` weighs the families; ``extra`` maps those beyond these four to their function,
    ``(rng, ctx) -> (notes, escapes)``.
    """
    ctx.reset()
    family = rng.choices(list(families), weights=list(families.values()))[0]
    params = None
    if family == "raw":
        notes, escapes = _raw(rng, ctx)
    elif family == "resigned":
        notes, escapes, params = _resigned(rng, ctx)
    elif family == "manifest":
        notes, escapes = _manifest(rng, ctx)
    elif family == "text":
        notes, escapes = _manifest_text(rng, ctx)
    else:
        notes, escapes = extra[family](rng, ctx)
    return {"family": family, "notes": notes, "escapes": escapes, "params": params}
