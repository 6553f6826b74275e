"""The HTTP body fuzz target: request bodies a stranger sends, read as the server reads them.

Each case makes a valid body (JSON ``{"inputs": ...}`` or a ``.npy``) for one of three small
served models (inputs float32, int32 and bool) and breaks it: one number replaced by a value a
cast cannot hold or would change (10**400, 2**31, 1e39, 1.5, booleans, null, strings,
NaN), its structure changed (ragged, nested, renamed, deep), its bytes flipped, cut or
inserted, or its content type swapped. The worker reads it as ``POST /predict`` does: the
server's decoder (``serving._bodies.decode``), then the batcher (which checks the shapes).
Outcomes as in :mod:`fuzzing`:
``rejected`` is a ``BadRequest`` or ``SignatureError`` (a 4xx with the JSON error body);
``same`` a body read as arrays of the model's dtype and row shape that, where the case knows
them, hold the values sent; ``wrong`` a value a cast changed or a boolean read as a number;
``foreign`` anything else (once a plain-text 500).
"""

from __future__ import annotations

import io
import json
import random
import time
import traceback
from pathlib import Path

from fuzzing.cases import case_rng

DTYPES = ("float32", "int32", "bool")
FEATURES = {"float32": 4, "int32": 3, "bool": 2}
#: values swapped in for one element: what a faithful cast gives per dtype, or None (refuse)
NASTY = [10**400, -(10**400), 10**20, 2**31, -(2**31) - 1, 2**63, 2**64, 1e39, -1e39, 1e308,
         1.5, 2.0, 0, 1, -0.0, True, False, None, "1", [], {}, float("nan"), float("inf"),
         3e38, 2**31 - 1]  # fmt: skip


def make(out: Path) -> None:
    """Nothing to write but the directory: the models are made in each worker."""
    out.mkdir(parents=True, exist_ok=True)


class Context:
    def __init__(self, out: Path, work: Path):
        import jax.numpy as jnp
        import numpy as np

        import symjax_mlp as sm

        self.out, self.work = out.resolve(), work.resolve()
        self.marker = self.out / "PWNED"
        self.batchers = {}
        for dtype in DTYPES:
            example = np.zeros((1, FEATURES[dtype]), dtype)
            h = sm.hybridize(lambda p, x: x, jnp.float32(0))
            self.batchers[dtype] = sm.serving.Batcher(h, example=example, max_batch=4)


def expected(value, dtype: str):
    """What a faithful cast of one JSON value to ``dtype`` gives, or ``None``: refuse it."""
    import numpy as np

    if isinstance(value, bool):
        return value if dtype == "bool" else None
    if not isinstance(value, int | float):
        return None
    if dtype == "bool":
        return bool(value) if value in (0, 1) else None
    if dtype == "int32":
        if isinstance(value, float) and (value != value or value % 1):
            return None
        return int(value) if -(2**31) <= value <= 2**31 - 1 else None
    try:
        f = float(value)
    except OverflowError:
        return None
    with np.errstate(over="ignore"):
        x = np.float32(f)
    return None if np.isinf(x) and not np.isinf(f) else x


def mutate(rng: random.Random, ctx: Context) -> dict:
    import numpy as np

    dtype = rng.choice(DTYPES)
    rows = rng.randint(1, 4)
    shape = (rows, FEATURES[dtype])
    nr = np.random.default_rng(rng.getrandbits(32))
    if dtype == "float32":
        x = nr.standard_normal(shape).astype(np.float32)
    elif dtype == "int32":
        x = nr.integers(-(2**31), 2**31, shape, dtype=np.int64).astype(np.int32)
    else:
        x = nr.integers(0, 2, shape).astype(bool)
    family = rng.choice(["valid", "value", "structure", "bytes", "type"])
    kind, want, notes = "application/json", x, ""
    values = x.tolist()
    if dtype == "float32" and rng.random() < 0.3:  # whole numbers, sent as JSON integers
        x = (np.round(x * 100) + 0.0).astype(np.float32)  # no -0.0: JSON 0 is +0.0
        values, want = x.astype(np.int64).tolist(), x
    if family == "valid" and rng.random() < 0.5:
        buf = io.BytesIO()
        np.save(buf, x.astype(rng.choice([x.dtype.str, x.dtype.newbyteorder(">").str])))
        return _spec(family, dtype, buf.getvalue(), "application/x-npy", x, "npy")
    if family == "value":
        v = rng.choice(NASTY)
        i, j = rng.randrange(rows), rng.randrange(FEATURES[dtype])
        values[i][j] = v
        e = expected(v, dtype)
        want = None if e is None else (x, (i, j), e)
        notes = f"[{i}][{j}] = {str(v)[:20]}"
    elif family == "structure":
        op = rng.choice(["ragged", "nest", "flat", "rename", "deep", "top", "empty", "scalar"])
        notes, want = op, "shape"
        if op == "ragged":
            values[0] = values[0][:-1]
        elif op == "nest":
            values = [values]
        elif op == "flat":
            values = values[0]
        elif op == "empty":
            values = []
        elif op == "scalar":
            values = values[0][0]
        elif op == "deep":
            text = '{"inputs": ' + "[" * rng.choice([100, 5000, 100000]) + "}"
            return _spec(family, dtype, text.encode(), kind, "shape", op)
        body = {"inputs": {"args[1]": values} if op == "rename" else values}
        if op == "top":
            body = rng.choice([values, "inputs", 1, None, {"input": values}])
        return _spec(family, dtype, json.dumps(body).encode(), kind, "shape", notes)
    body = json.dumps({"inputs": values}).encode()
    if family == "bytes":
        b = bytearray(body)
        for _ in range(rng.randint(1, 4)):
            op = rng.choice(["flip", "cut", "insert"])
            k = rng.randrange(len(b))
            if op == "flip":
                b[k] ^= 1 << rng.randrange(8)
            elif op == "cut":
                del b[k : k + rng.randint(1, 8)]
            else:
                b[k:k] = rng.choice([b"9" * 400, b"true", b"NaN", b"-", b"e999", b"\xff", b"]"])
        body, want, notes = bytes(b), "shape", "bytes"
    elif family == "type":
        kind = rng.choice(["text/plain", "", "application/json; charset=utf-8",
                           "application/x-npy", "application/octet-stream"])  # fmt: skip
        want, notes = "shape", kind
    return _spec(family, dtype, body, kind, want, notes)


def _spec(family, dtype, body, kind, want, notes):
    return {"family": family, "dtype": dtype, "body": body, "kind": kind, "want": want,
            "notes": notes}  # fmt: skip


def _judge(spec, got) -> str:
    """'' if ``got`` is what the body may be read as, else why not."""
    import numpy as np

    dtype, want = spec["dtype"], spec["want"]
    if len(got) != 1:
        return f"{len(got)} arrays"
    a = got[0]
    if a.dtype != np.dtype(dtype) or a.ndim != 2 or a.shape[1] != FEATURES[dtype]:
        return f"read as {a.dtype}{list(a.shape)}"
    if want is None:
        return "a value no cast holds was read"
    if isinstance(want, np.ndarray):
        return "" if a.shape == want.shape and a.tobytes() == want.tobytes() else "other values"
    if isinstance(want, tuple):
        x, (i, j), e = want
        if a.shape != x.shape:
            return "other shape"
        ok = a[i, j] == e or (a[i, j] != a[i, j] and e != e)
        others = np.delete(a.ravel(), i * a.shape[1] + j)
        same = others.tobytes() == np.delete(x.ravel(), i * a.shape[1] + j).tobytes()
        return "" if ok and same else f"[{i}][{j}] read as {a[i, j]!r}, sent {e!r}"
    return ""


def run_case(ctx: Context, seed: int, case: int, *, started=None, verbose: bool = False) -> dict:
    from symjax_mlp import SignatureError
    from symjax_mlp.serving._bodies import BadRequest, decode

    rng = case_rng(seed, case)
    t0 = time.perf_counter()
    spec = mutate(rng, ctx)
    if started is not None:
        started({"case": case, "family": spec["family"], "notes": spec["notes"]})
    detail = ""
    try:
        batcher = ctx.batchers[spec["dtype"]]
        got, _ = decode(batcher, spec["body"], spec["kind"])
        batcher.submit(*got).result(timeout=20)  # what the server does next: shapes checked
    except (BadRequest, SignatureError) as e:
        outcome, detail = "rejected", f"{type(e).__name__}: {e}"
    except Exception as e:
        outcome = "foreign"
        detail = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_tb(e.__traceback__)[-4:])
    else:
        detail = _judge(spec, got)
        outcome = "wrong" if detail else "same"
    if verbose:
        print(spec["notes"], spec["body"][:200], detail)
    from fuzzing.worker import peak_rss_mb

    return {
        "case": case,
        "family": f"body-{spec['family']}",
        "notes": f"{spec['dtype']} {spec['notes']}"[:200],
        "outcome": outcome,
        "detail": detail[:2000],
        "seconds": round(time.perf_counter() - t0, 4),
        "max_rss_mb": peak_rss_mb(),
    }
