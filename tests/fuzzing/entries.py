"""The entry-point fuzz target: a two-entry artifact, mutated every way, each entry point judged.

:func:`make` exports, with ``sm.export({"predict": h, "embed": e}, ...)``, the loader target's
tiny MLP as ``predict`` (the default) and its hidden layer, over ``layers_0``'s params only, as
``embed``: one ``params.safetensors``, and ``embed.jaxexport``, ``embed.mlirbc`` and
``embed.selftest.safetensors`` beside the default's files; and another such
export to mix files from. A case applies :mod:`fuzzing.mutations`' families to every file, the
second entry point's among them, or one of two of its own:

- ``entry``: the manifest's ``entries`` and ``entry`` edited as data: program files swapped
  between the entry points (in part: a module that is not its signature, another's
  self-test; whole: the default under a second name), shared, unlisted, copied, dropped, or
  outside the directory; an entry's params not in the weight file, another layer's of the
  same shapes (bound in ``mlir_arguments`` too), dropped, all; entry points renamed (reserved
  and non-identifier names too), deleted, copied 64 times; a default ``entry`` that names
  nothing, the other entry point, or trades names with it; an entry point's signature edited
  as the default's is; any field under ``entries``;
- ``entry-text``: the manifest's text with ``entry``, ``entries`` or an entry point written
  twice, the second time otherwise (JSON readers differ on which one counts).

The oracle loads the case and calls ``m[name](x)`` for every entry point the original has or
the case lists: each must be refused with a library error, or return bit-for-bit the original
output of the entry point whose program it runs (known by the sha256 of its module, the
``.mlirbc`` its ``.jaxexport`` must embed: renamed, an entry point is still itself; a module no
original has must not run). The case's outcome is the worst of its entry points' (a refusal
counts over a harmless change); it ``escaped`` if it ran although its manifest, as finally
edited, names a file outside the directory.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import ClassVar

from fuzzing import cases, mutations, worker
from fuzzing.cases import JAXEXPORT, MANIFEST, MLIRBC, PARAMS, SELFTEST, host

SECOND = "embed"  # the second entry point; the default is "predict"
ROLES = (JAXEXPORT, MLIRBC, SELFTEST)  # an entry point's own files, by role
SECOND_FILES = {
    JAXEXPORT: "embed.jaxexport",
    MLIRBC: "embed.mlirbc",
    SELFTEST: "embed.selftest.safetensors",
}
ABSENT = "params/layers_9/kernel"  # a param the weight file does not hold
WORST = ("foreign", "wrong", "escaped", "rejected", "same")  # a case's outcome: its worst entry's


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def make(out: Path) -> None:
    """Writes ``out/entries/original`` and ``out/entries/other`` (two-entry exports of the
    loader target's two MLPs), the input, the bait files and the pickle payload."""
    import symjax_mlp as sm

    base = out / "entries"
    base.mkdir(parents=True, exist_ok=True)
    x = cases.example()
    for name, net, variables in cases.mlps(x):
        first = net.layers[0]  # Dense, activation included: the hidden layer

        def embed(p, x, first=first):
            return first.apply({"params": p["params"]["layers_0"]}, x)

        hidden = {"params": {"layers_0": variables["params"]["layers_0"]}}
        points = {"predict": sm.hybridize(net, variables), SECOND: sm.hybridize(embed, hidden)}
        sm.export(points, base / name, example=x, overwrite=True)
    cases.finish(out, base, x, Context.FILES)


class Context(cases.Context):
    """The loader target's context over the two-entry originals; the oracle has each entry
    point's output, and which original entry point each module (by sha256) is."""

    ROOT = "entries"
    FILES = (*cases.FILES, *SECOND_FILES.values())
    DATA = FILES[1:]
    MODULES: ClassVar[dict[str, str]] = {
        JAXEXPORT: MLIRBC,
        SECOND_FILES[JAXEXPORT]: SECOND_FILES[MLIRBC],
    }

    def __init__(self, out: Path, work: Path):
        super().__init__(out, work)
        self.names = tuple(self.reference.entries)
        self.programs = {  # each entry point's module, by sha256
            _sha(self.blobs[MLIRBC]): self.manifest["entry"],
            _sha(self.blobs[SECOND_FILES[MLIRBC]]): SECOND,
        }

    def outputs(self, model):
        return {name: host(model[name](self.x)) for name in model.entries}


# -- mutations of the entry points' fields --------------------------------------------------------
def _an_entry(rng, m) -> tuple[str, dict]:
    name = rng.choice(list(m["entries"]))
    return name, m["entries"][name]


def _programs(rng, m, ctx):
    """An entry point's program files swapped with the default's, or among themselves."""
    name, e = _an_entry(rng, m)
    files = e["program_files"]
    op = rng.choice(["default's", "default's", "whole", "within", "top-level"])
    if op == "default's":  # a module that is not its signature, or another's self-test
        roles = rng.sample(ROLES, rng.randint(1, len(ROLES)))
        files.update({role: role for role in roles})
        op += " " + ", ".join(roles)
    elif op == "whole":  # the default's program and signature under another name: a copy
        e.update({k: copy.deepcopy(m[k]) for k in ("name", "signature", "mlir_arguments")})
        e.update(params=[p["path"] for p in m["params"]], program_files={r: r for r in ROLES})
    elif op == "within":
        a, b = rng.sample(ROLES, 2)
        files[a], files[b] = files[b], files[a]
        op += f" {a} <-> {b}"
    else:  # an entry point's own fields on the default: ignored or refused
        field = rng.choice(["program_files", "entry_point"])
        m[field] = rng.choice([dict(files), name, SECOND_FILES[JAXEXPORT]])
        op += f" {field}"
    return f"entries.{name}.program_files: {op}", False


def _params(rng, m, ctx):
    """An entry point's params: not in the weight file, another layer's, fewer, more."""
    name, e = _an_entry(rng, m)
    paths = e["params"]
    op = rng.choice(["absent", "absent-listed", "other-layer", "other-layer-args", "drop",
                     "reverse", "dup", "all", "type"])  # fmt: skip
    if op.startswith("absent"):
        paths.append(ABSENT)
        if op == "absent-listed":  # listed in params too: only the weight file lacks it
            m["params"].append({"path": ABSENT, "shape": [3, 3], "dtype": "float32"})
    elif op.startswith("other-layer"):  # layers_1's bias and kernel have layers_0's shapes
        e["params"] = [p.replace("layers_0", "layers_1") for p in paths]
        if op == "other-layer-args":  # bound by name to the module's arguments too
            e["mlir_arguments"] = [a.replace("layers_0", "layers_1") for a in e["mlir_arguments"]]
    elif op == "drop":
        paths.pop(rng.randrange(len(paths)))
    elif op == "reverse":
        paths.reverse()
    elif op == "dup":
        paths.append(rng.choice(paths))
    elif op == "all":
        e["params"] = [p["path"] for p in m["params"]]
    else:
        e["params"] = rng.choice([[], None, paths[0], [3], {"0": paths[0]}])
    return f"entries.{name}.params: {op}", False


NAMES = ("embed2", "Embed", "main", "predict", "model", "selftest", "", "a b", "1st", "_e",
         "émbed", "e" * 65, "embed\x00", "__class__", "entries")  # fmt: skip


def _names(rng, m, ctx):
    """Entry points renamed, deleted, copied (sharing files), replaced, or many."""
    name, e = _an_entry(rng, m)
    op = rng.choice(["rename", "rename", "delete", "copy", "many", "replace", "name"])
    if op == "rename":
        new = rng.choice(NAMES)
        m["entries"][new] = m["entries"].pop(name)
        op += f" to {new!r}"
    elif op == "delete":
        del m["entries"][name]
    elif op == "copy":
        new = rng.choice(NAMES)
        m["entries"][new] = copy.deepcopy(e)
        op += f" as {new!r}"
    elif op == "many":  # at the limit of entry points and past it
        n = rng.choice([62, 63, 64])
        m["entries"].update({f"e{i}": copy.deepcopy(e) for i in range(n)})
        op += f" x{n}"
    elif op == "replace":
        m["entries"] = rng.choice([{}, None, [], name, {name: None}, {name: []}, [e]])
    else:
        e["name"] = rng.choice(mutations.NASTY)
    return f"entries.{name}: {op}", False


def _default(rng, m, ctx):
    """The default's name: naming nothing, the other entry point, nothing valid, or traded."""
    op = rng.choice(["value", "value", "delete", "trade"])
    if op == "delete":
        m.pop("entry")
    elif op == "trade":  # the default and an entry point trade names: each runs its own
        name, _ = _an_entry(rng, m)
        m["entries"][m.get("entry", "main")] = m["entries"].pop(name)
        m["entry"] = name
    else:
        m["entry"] = rng.choice([*NAMES[:7], "nope", SECOND, None, 3, ["predict"], "predict "])
    return f"entry: {op} -> {m.get('entry')!r}", False


def _files(rng, m, ctx):
    """An entry point's program files: outside the directory, unlisted, copied, shared."""
    name, e = _an_entry(rng, m)
    files = e["program_files"]
    role = rng.choice(ROLES)
    op = rng.choice(["escape", "escape", "unlisted", "copy", "shared", "drop", "extra", "unlist",
                     "type"])  # fmt: skip
    if op == "escape":  # where the very bytes wait (the bait), listed with their checksum or not
        own = files[role]
        new = rng.choice([f"../{own}", str(ctx.bait / own), f"sub/../{own}", f"./{own}",
                          f"/{own}", "..", f"../../{ctx.work.name}/{own}"])  # fmt: skip
        files[role] = new
        if rng.random() < 0.5:
            m["files"][new] = dict(m["files"][own])
        op += f" {new!r}"
    elif op == "unlisted":
        files[role] = rng.choice(["extra.jaxexport", "model.vmfb", SECOND_FILES[role] + "x"])
    elif op == "copy":  # the same bytes under another name, listed: harmless
        data = ctx.blobs[SECOND_FILES[role]]
        new = "copy." + role.removeprefix("model.")
        (ctx.case / new).write_bytes(data)
        m["files"][new] = {"sha256": _sha(data), "bytes": len(data)}
        files[role] = new
    elif op == "shared":  # two roles, one file
        files[role] = files[rng.choice([r for r in ROLES if r != role])]
    elif op == "drop":
        files.pop(role)
    elif op == "extra":
        files[rng.choice([PARAMS, MANIFEST, "model.vmfb", "x"])] = rng.choice(
            [PARAMS, MANIFEST, files[role]]
        )
    elif op == "unlist":
        m["files"].pop(files[role])
    else:
        e["program_files"] = rng.choice([None, [], list(files.values()), files[role], {}])
    return f"entries.{name}.program_files[{role!r}]: {op}"[:200], False  # see _outside


def _signature(rng, m, ctx):
    """The default's shape, dtype and signature edits, on an entry point's signature."""
    name, e = _an_entry(rng, m)
    view = {"params": [], "signature": e["signature"]}
    edit = rng.choice([mutations._shape, mutations._dtype, mutations._signature])
    note, escapes = edit(rng, view, ctx)
    return f"entries.{name}: {note}", escapes


def _any_field(rng, m, ctx):
    """Any field under ``entries`` (:func:`fuzzing.mutations._generic`)."""
    note, escapes = mutations._generic(rng, m["entries"], ctx)
    return f"entries.{note}", escapes


ENTRY_OPS = (
    [_programs] * 3 + [_params] * 3 + [_names] * 2 + [_default] * 2 + [_files] * 3
    + [_signature] * 2 + [_any_field] * 3
)  # fmt: skip


def _entry(rng, ctx) -> tuple[list[str], bool]:
    notes, _ = mutations._manifest(rng, ctx, ENTRY_OPS)
    return notes, _outside(ctx, json.loads((ctx.case / MANIFEST).read_text()))


def _outside(ctx: Context, m: dict) -> bool:
    """Whether the manifest lists, or names as an entry point's file, a path out of the case
    (seen once every edit is made: a later edit may undo an earlier one's escape)."""
    named = list(m["files"]) if isinstance(m.get("files"), dict) else []
    for e in m["entries"].values() if isinstance(m.get("entries"), dict) else ():
        files = e.get("program_files") if isinstance(e, dict) else None
        named += list(files.values()) if isinstance(files, dict) else []
    here = ctx.case.resolve()
    paths = [(ctx.case / n).resolve() for n in named if isinstance(n, str) and "\x00" not in n]
    return any(p != here and here not in p.parents for p in paths)


def _duplicate(obj: dict, key: str, value: str) -> str:
    """``obj`` as JSON text with ``key`` written once more at its end, as the text ``value``."""
    return json.dumps(obj)[:-1] + f", {json.dumps(key)}: {value}}}"


def _entry_text(rng, ctx) -> tuple[list[str], bool]:
    """A key written twice: ``entry``, ``entries`` or an entry point, the second otherwise."""
    m = json.loads(ctx.blobs[MANIFEST])
    name, e = _an_entry(rng, m)
    other = copy.deepcopy(e)
    if rng.random() < 0.5:
        other["program_files"] = {r: r for r in ROLES}
    else:
        other["params"].append(ABSENT)
    op = rng.choice(["entry", "entries", "entry point"])
    if op == "entry":
        text = _duplicate(m, "entry", json.dumps(rng.choice([SECOND, "nope", "main", "predict"])))
    elif op == "entries":
        text = _duplicate(m, "entries", json.dumps(rng.choice([{}, {name: other}, {"e": e}])))
    else:
        entries = m.pop("entries")
        text = _duplicate(m, "entries", _duplicate(entries, name, json.dumps(other)))
    (ctx.case / MANIFEST).write_text(text)
    return [f"manifest text: {op} twice"], False


FAMILIES = {"raw": 20, "resigned": 20, "manifest": 15, "text": 5, "entry": 35, "entry-text": 5}


def mutate(rng, ctx: Context) -> dict:
    extra = {"entry": _entry, "entry-text": _entry_text}
    return mutations.mutate(rng, ctx, FAMILIES, extra)


# -- one case ---------------------------------------------------------------------------------
def check(ctx: Context, spec: dict, case: int) -> tuple[str, str]:
    """Loads the case and calls every entry point the original has or the case lists."""
    import symjax_mlp as sm

    if spec["params"] is not None:
        expected, nan_equal = ctx.expected_for_params(spec["params"]), True
    else:
        expected, nan_equal = ctx.expected, False
    loaded, outcome, detail = worker.attempt(lambda: sm.load(ctx.case))
    if outcome:
        return outcome, detail
    results = {}
    for name in dict.fromkeys((*ctx.names, *loaded.entries)):
        got, outcome, detail = worker.attempt(lambda name=name: _call(ctx, loaded, name))
        if not outcome:
            entry, program, got = got
            want = None if expected is None or program is None else expected[program]
            outcome, detail = worker.judge(got, want, spec, nan_equal=nan_equal)
            if entry != name:
                outcome, detail = "wrong", f"it is the entry point {entry!r}"
            runs = f"runs {program or 'no original'}'s program"
            detail = f"{runs}; {detail}" if detail else runs
        results[name] = outcome, detail
    ranked = sorted(results.items(), key=lambda r: WORST.index(r[1][0]))
    return ranked[0][1][0], "; ".join(f"m[{n!r}]: {o}: {d}" for n, (o, d) in ranked)


def _call(ctx: Context, loaded, name: str):
    """``loaded[name]``'s name, the original entry point whose program it runs (None: none
    does), and its output on the input."""
    model = loaded[name]
    m = loaded.manifest  # the default's view: the manifest, every entry point in it
    default = m.get("entry", "main")
    own = MLIRBC if name == default else m["entries"][name]["program_files"][MLIRBC]
    program = ctx.programs.get(m["files"][own]["sha256"])
    return model.entry, program, host(model(ctx.x))


def run_case(ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False) -> dict:
    """One case (:func:`fuzzing.worker.run_case`), mutated by :func:`mutate`, judged by
    :func:`check`."""
    return worker.run_case(
        ctx, seed, case, started=started, verbose=verbose, mutate=mutate, check=check
    )
