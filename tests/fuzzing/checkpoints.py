"""The checkpoint fuzz target: mutate a training checkpoint, restore it, classify what happened.

:func:`make` saves one checkpoint of a small training state (params, adam's state, an rng key,
and a history and config in its metadata, as ``train`` writes them). Each case copies it and
applies one or a few mutations: bytes of either file (flips, truncation, appended, inserted,
emptied), either file replaced by a directory, a FIFO or a symlink (to ``/dev/zero`` or out),
``state.safetensors`` re-signed (changed bytes, crafted headers: duplicate names, huge
zero-size dims, bad offsets, extra or missing tensors, another dtype) and the manifest edited as
data (every field, nasty values, the history and config ``train`` reads when resuming) or as
text. The worker runs ``restore_checkpoint(path, like)`` and checks what resuming reads of
the metadata. Outcomes as in :mod:`fuzzing`; ``same`` means the restored state is bit-for-bit
what safetensors' own reader finds in the file (the original values, unless re-signed).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import time
import traceback
from pathlib import Path

from fuzzing.cases import case_rng
from fuzzing.mutations import NASTY, _bytes_op, _generic

MANIFEST, STATE = "manifest.json", "state.safetensors"
FILES = (MANIFEST, STATE)
RECORD = {"epoch": 1, "step": 3, "loss": 0.5, "train_accuracy": 0.75, "test_accuracy": 0.5,
          "seconds": 0.1}  # fmt: skip


def _state():
    import jax
    import jax.numpy as jnp
    import optax

    import symjax_mlp as sm

    params = {"dense": {"kernel": jnp.arange(6.0).reshape(2, 3), "bias": jnp.zeros(3)}}
    opt = optax.adam(1e-3)
    return sm.training.TrainState(params, opt.init(params), jax.random.key(1), step=3, epoch=1)


def make(out: Path) -> None:
    import symjax_mlp as sm

    root = out / "checkpoints"
    if (root / "done").exists():
        return
    root.mkdir(parents=True, exist_ok=True)
    meta = {"config": {"batch_size": 32, "model_sha256": "0" * 64}, "history": [RECORD]}
    path = sm.training.save_checkpoint(root / "ckpt", _state(), metadata=meta)
    path.rename(root / "original")
    (root / "done").touch()


class Context:
    def __init__(self, out: Path, work: Path):
        self.out, self.work = out.resolve(), work.resolve()
        self.root = self.out / "checkpoints"
        self.original = self.root / "original"
        self.case = self.work / "step_00000003"
        self.marker = self.out / "PWNED"
        self.like = _state()
        self.blobs = {f: (self.original / f).read_bytes() for f in FILES}
        self.work.mkdir(parents=True, exist_ok=True)
        for f in FILES:  # bait for "../NAME"
            (self.work / f).write_bytes(self.blobs[f])

    def reset(self) -> None:
        if self.case.is_symlink() or self.case.is_file():
            self.case.unlink()
        elif self.case.exists():
            shutil.rmtree(self.case)
        self.case.mkdir()
        for f in FILES:
            (self.case / f).write_bytes(self.blobs[f])


def _resign_state(ctx: Context, data: bytes) -> None:
    (ctx.case / STATE).write_bytes(data)
    m = json.loads(ctx.blobs[MANIFEST])
    m["files"][STATE] = hashlib.sha256(data).hexdigest()
    (ctx.case / MANIFEST).write_text(json.dumps(m))


def _crafted(rng: random.Random, ctx: Context) -> tuple[str, bytes]:
    data = ctx.blobs[STATE]
    n = int.from_bytes(data[:8], "little")
    header, body = json.loads(data[8 : 8 + n]), data[8 + n :]
    names = [k for k in header if k != "__metadata__"]
    op = rng.choice(["dup", "huge-zero", "overlap", "dtype", "drop", "extra", "shape", "meta"])
    if op == "dup":
        raw = json.dumps(header).encode()
        first = json.dumps({names[0]: header[names[0]]}).encode()[1:-1]
        raw = raw[:-1] + b", " + first + b"}"
    else:
        if op == "huge-zero":
            header["extra"] = {"dtype": "F32", "shape": [0, 2**62], "data_offsets": [len(body)] * 2}
        elif op == "overlap":
            e = header[rng.choice(names)]
            e["data_offsets"] = [max(0, e["data_offsets"][0] - 4), e["data_offsets"][1]]
        elif op == "dtype":
            e = header[rng.choice(names)]
            e["dtype"] = rng.choice(["F16", "I32", "BF16", "U8", "X"])
        elif op == "drop":
            header.pop(rng.choice(names))
        elif op == "extra":
            header["opt_state/x"] = {"dtype": "F32", "shape": [0], "data_offsets": [len(body)] * 2}
        elif op == "shape":
            e = header[rng.choice(names)]
            e["shape"] = list(reversed(e["shape"])) + ([1] if rng.random() < 0.5 else [])
        else:
            header["__metadata__"] = rng.choice([{"a": 1}, [], {"k": "v"}])
        raw = json.dumps(header).encode()
    return f"crafted state: {op}", len(raw).to_bytes(8, "little") + raw + body


def _manifest(rng: random.Random, ctx: Context) -> str:
    m = json.loads(ctx.blobs[MANIFEST])
    notes = []
    for _ in range(rng.choice([1, 1, 2])):
        op = rng.choice(["generic", "generic", "history", "config", "step"])
        try:
            if op == "generic":
                note, _ = _generic(rng, m, ctx)
            elif op == "history":
                h = m["metadata"]["history"]
                what = rng.choice(["value", "drop-field", "extra-field", "entry", "list"])
                if what == "value":
                    h[0][rng.choice(list(RECORD))] = rng.choice(NASTY)
                elif what == "drop-field":
                    h[0].pop(rng.choice(list(RECORD)))
                elif what == "extra-field":
                    h[0]["x"] = 1
                elif what == "entry":
                    h.append(rng.choice(NASTY))
                else:
                    m["metadata"]["history"] = rng.choice(NASTY)
                note = f"history: {what}"
            elif op == "config":
                m["metadata"]["config"] = rng.choice(NASTY)
                note = "config"
            else:
                m[rng.choice(["step", "epoch"])] = rng.choice(NASTY)
                note = "step/epoch"
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            note = f"(skipped: {e!r})"
        notes.append(note)
    (ctx.case / MANIFEST).write_text(json.dumps(m))
    return "manifest: " + "; ".join(notes)


def mutate(rng: random.Random, ctx: Context) -> dict:
    ctx.reset()
    kind = rng.choices(["raw", "resigned", "crafted", "manifest", "text"], [30, 15, 20, 30, 5])[0]
    state = None
    if kind == "raw":
        target = rng.choice(FILES)
        file = ctx.case / target
        op = rng.choice(["bytes"] * 6 + ["dir", "fifo", "symlink", "delete"])
        if op == "bytes":
            what, data = _bytes_op(rng, file.read_bytes())
            file.write_bytes(data)
            note = f"{target}: {what}"
        else:
            file.unlink()
            if op == "dir":
                file.mkdir()
            elif op == "fifo":
                os.mkfifo(file)
            elif op == "symlink":
                os.symlink(rng.choice(["/dev/zero", f"../{target}"]), file)
            note = f"{target}: {op}"
    elif kind == "resigned":
        what, state = _bytes_op(rng, ctx.blobs[STATE])
        _resign_state(ctx, state)
        note = f"re-signed state: {what}"
    elif kind == "crafted":
        note, state = _crafted(rng, ctx)
        _resign_state(ctx, state)
    elif kind == "manifest":
        note = _manifest(rng, ctx)
    else:
        text = ctx.blobs[MANIFEST].decode()
        op = rng.choice(["deep", "nan", "bigint", "bom", "tail"])
        data = {
            "deep": ("[" * 100_000 + "]" * 100_000).encode(),
            "nan": text.replace('"step": 3', '"step": NaN').encode(),
            "bigint": text.replace('"step": 3', '"step": 3' + "0" * 5000).encode(),
            "bom": b"\xef\xbb\xbf" + text.encode(),
            "tail": text.encode() + b"\x00",
        }[op]
        (ctx.case / MANIFEST).write_bytes(data)
        note = f"manifest text: {op}"
    return {"family": f"checkpoint-{kind}", "notes": [note], "state": state}


def _expected(ctx: Context, state: bytes | None):
    """What a correct restore returns: the tensors safetensors' own reader finds, by name
    (None: that reader rejects them, or they do not fit the state, so restoring must fail)."""
    import numpy as np
    import safetensors.numpy

    data = ctx.blobs[STATE] if state is None else state
    try:
        flat = safetensors.numpy.load(data)
    except Exception:
        return None
    n = int.from_bytes(data[:8], "little")
    if data[8 : 8 + n].count(b'"dtype"') != len(flat):  # a name given twice
        return None
    return {k: np.asarray(v) for k, v in flat.items()}


def _leaves(state) -> dict:
    import jax
    import numpy as np

    out = {}
    for prefix in ("params", "opt_state"):
        for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(state, prefix)):
            out[prefix + "/" + jax.tree_util.keystr(path, simple=True, separator="/")] = np.asarray(
                leaf
            )
    out["rng"] = np.asarray(jax.random.key_data(state.rng))
    return out


def run_case(ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False) -> dict:
    import symjax_mlp as sm

    rng = case_rng(seed, case)
    t0 = time.perf_counter()
    spec = mutate(rng, ctx)
    if started is not None:
        started({"case": case, "family": spec["family"], "notes": spec["notes"]})
    detail = ""
    try:
        restored, meta = sm.training.restore_checkpoint(ctx.case, ctx.like)
        # what train(resume=True) reads of the metadata: the config and the epoch records
        config = meta.get("config", {})
        _ = {k: config.get(k) for k in ("batch_size", "model_sha256")}
        history = [sm.training.EpochRecord(**r) for r in meta.get("history", [])]
        _ = [float(r.loss) + r.step + r.epoch for r in history]
    except sm.SymjaxError as e:
        outcome, detail = "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:
        outcome = "foreign"
        detail = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])
    else:
        want, got = _expected(ctx, spec["state"]), _leaves(restored)
        ok = (
            want is not None
            and set(want) == set(got)
            and all(
                want[k].dtype == got[k].dtype
                and want[k].shape == got[k].shape
                and want[k].tobytes() == got[k].tobytes()
                for k in got
            )
        )
        outcome = "same" if ok else "wrong"
        if not ok:
            detail = f"restored {sorted(got)}, expected {None if want is None else sorted(want)}"
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
    }
