"""Round sixteen of a stranger's attacks (session 63): whole, self-consistent artifacts against
what session 62 added (format 3, whose ``signature.strong`` and ``weak_type`` decide dtypes, and
the golden files older releases wrote) and the artifact commands that size their own inputs
(``symjax-mlp bench DIR``, ``sm.timeit``, ``verify``). A downgrade: a format-3 artifact
re-declared format 1 or 2, signed or not, or re-exported through ``m.apply``. Then a manifest's
constraints, which load checks for some sizes they admit; ``serve`` of an artifact whose one row
no request body could carry (and the bytes its warm-up draws); ``weak_type`` on a bool input,
which no export writes. Each way in that got through has a test failing without its fix; each
surface that held keeps one test showing it. The rounds
before: test_stranger15.py, ..., test_stranger14.py (a ``strong`` list naming no input, twice,
10^5 names; ``weak_type`` on a param, an array or not a bool: not repeated here),
test_security.py, test_signing_stranger.py."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from helpers import manifest_edited

import symjax_mlp as sm
from symjax_mlp.cli import main

S = np.ones((2, 3), np.float32)
PEM = serialization.Encoding.PEM


def _scalar(p, x, s):
    return p["w"] * s, x * s  # a bfloat16 weight times a float32 scalar: its weak type decides


@pytest.fixture(scope="module")
def strong(tmp_path_factory):
    """A format-3 artifact whose args[1] takes only strongly typed scalars (``strong``), signed
    by a key made here; its Hybrid and the key's public half."""
    d = tmp_path_factory.mktemp("strong")
    h = sm.hybridize(_scalar, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    path = sm.export(h, d / "m", example=(S, np.float32(1.5)), batch=None).path
    key = ec.generate_private_key(ec.SECP256R1())
    (d / "k.pem").write_bytes(key.private_bytes(
        PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))  # fmt: skip
    public = key.public_key().public_bytes(PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    (d / "k.pub").write_bytes(public)
    return path, h, d / "k.pem", d / "k.pub"


def _declared(version):
    return lambda m: m.__setitem__("format_version", version)


@pytest.mark.slow  # an export, three loads: ~2 s
def test_a_format_3_artifact_declared_format_1_or_2_still_refuses_the_other_weak_kind(
    strong, tmp_path
):
    """Held. ``format_version`` decides nothing but what a release may read: today's reader
    reads ``strong`` and ``weak_type`` whatever version a manifest declares, so a downgrade
    (format 1 or 2, which no format-3 field may be in) answers the strongly typed scalar as h
    does and still refuses 1.5, which h answers in other dtypes, and ``typed_check`` picks the
    same class; a downgrade to 0 or 4 is refused as a version this release does not read."""
    path, h = strong[:2]
    assert json.loads((path / "manifest.json").read_text())["format_version"] == 3
    for version in (1, 2):
        m = sm.load(manifest_edited(path, tmp_path / f"v{version}", _declared(version)))
        assert m.signature.strong == ("args[1]",) and type(m) is not sm.LoadedModel  # _Typed
        got, want = m(S, np.float32(1.5)), h(S, np.float32(1.5))
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))
        assert h(S, 1.5)[0].dtype != want[0].dtype  # what m(S, 1.5) would have got wrong
        with pytest.raises(sm.SignatureError, match=r"input args\[1\] takes only a strongly"):
            m(S, 1.5)
        with pytest.raises(sm.SignatureError, match=r"input args\[1\] takes only a strongly"):
            m.apply(m.params, S, 1.5)
    for version in (0, 4):
        with pytest.raises(sm.ArtifactError, match=f"format version {version}; this symjax_mlp"):
            sm.load(manifest_edited(path, tmp_path / f"v{version}", _declared(version)))


@pytest.mark.slow  # signing, two verifications: ~1 s
def test_a_signed_format_3_artifact_declared_older_or_stripped_of_strong_is_refused(
    strong, tmp_path
):
    """Held. The signature covers manifest.json: a signed artifact re-declared format 2, or
    stripped of ``strong`` (so that 1.5 would be answered in float32 where the model answers
    bfloat16), is refused by ``verify_signature`` in one line, before any parser reads it."""
    path, _, private, public = strong
    signed = shutil.copytree(path, tmp_path / "signed")
    sm.sign(signed, private)
    assert sm.load(signed, verify_signature=public).signature.strong == ("args[1]",)

    def stripped(m):
        del m["signature"]["strong"]
        m["format_version"] = 2

    for name, edit in (("older", _declared(2)), ("stripped", stripped)):
        art = manifest_edited(signed, tmp_path / name, edit)
        with pytest.raises(sm.ArtifactError) as e:
            sm.load(art, verify_signature=public)
        assert "manifest.json" in str(e.value) and "\n" not in str(e.value), name


@pytest.mark.slow  # an export, then seven manifests read: ~1 s
def test_a_strong_list_of_a_bool_a_negative_index_or_a_null_picks_no_class_silently(
    strong, tmp_path
):
    """Held. ``signature.strong`` decides the class load picks (``_Typed``, whose calls check a
    weak type): a bool, a bare string, a negative or out-of-range index, a null in the list or
    an entry point's list naming the default's inputs are refused at load, naming the field;
    ``strong: []`` (what no export writes, but means none) loads as a plain model."""
    path = strong[0]

    def strong_as(value):
        return lambda m: m["signature"].__setitem__("strong", value)

    hostile = {
        "a bool": strong_as(True),
        "a string": strong_as("args[1]"),
        "a negative index": strong_as(["args[-1]"]),
        "an index past the inputs": strong_as(["args[2]"]),
        "a null": strong_as([None]),
        "an int": strong_as([1]),
        "the array input's 0": strong_as(["args[1]", 0]),
    }
    for name, edit in hostile.items():  # each copy's folder named for what it holds
        with pytest.raises(sm.ArtifactError, match=r"signature\.strong is .*corrupted or was"):
            sm.load(manifest_edited(path, tmp_path / name, edit))
    plain = sm.load(manifest_edited(path, tmp_path / "none", strong_as([])))
    assert plain.signature.strong == () and type(plain) is sm.LoadedModel  # no _Typed


@pytest.fixture(scope="module")
def gigabytes(tmp_path_factory):
    """Artifacts of x * w whose signatures size their inputs for bench: ``t >= 2**26`` (float32
    [b, t], 256 MiB at batch 1, what the manifest's constraint asks) and a fixed uint8[2**29],
    each whole (its program takes those shapes)."""
    d = tmp_path_factory.mktemp("big")
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones((), jnp.float32)})
    bounded = sm.export(h, d / "t", example=S, shapes=("b, t",), constraints=("t >= 67108864",))
    g = sm.hybridize(lambda p, x: x + p["w"], {"w": jnp.ones((), jnp.uint8)})
    fixed = sm.export(g, d / "u", example=jax.ShapeDtypeStruct((2**29,), jnp.uint8), batch=None)
    return bounded.path, fixed.path


@pytest.mark.slow  # two exports, loads, the command line: ~3 s
@pytest.mark.parametrize("which", [0, 1])
def test_bench_refuses_inputs_a_manifest_sizes_in_gigabytes_before_drawing_them(
    gigabytes, which, capsys
):
    """``symjax-mlp bench DIR`` and ``sm.timeit(m)`` drew the inputs the artifact's signature
    sizes, whatever it said: a constraint ``t >= 2**26`` had bench draw 256 MiB (2**28: 1 GiB,
    4.4 GB of peak memory) at batch 1 and time 28,000 calls of it by default (hours), where
    ``verify`` refuses past 64 MiB. Inputs of more than 2**24 values per row of the batch
    (64 MiB of float32) are now refused before any is drawn, naming the input and its shape."""
    path = gigabytes[which]
    m = sm.load(path)
    for batch in (1, 2) if which == 0 else (1,):
        with pytest.raises(sm.ConfigError) as e:
            sm.timeit(m, batch=batch, calls=1, repeats=1, warmup=1)
        said = str(e.value)
        assert said.startswith(f'timeit(symjax_mlp.load("{path}")): the inputs it would draw')
        assert "input args[0] the most: " in said and "pass inputs of your own" in said, said
        shape = f"float32[{batch}, 67108864]" if which == 0 else "uint8[536870912]"
        assert shape in said and "smaller batch" not in said, said
    assert main(["bench", str(path), "--calls", "1", "--repeats", "1", "--warmup", "1"]) == 2
    err = capsys.readouterr().err
    assert "the inputs it would draw" in err and "Traceback" not in err, err


@pytest.mark.slow  # an export, a load, a short timing: ~2 s
def test_timeit_draws_an_artifacts_inputs_within_the_bound_as_before(tmp_path):
    """The bound is per row of the batch: a model of 4096 inputs per row is timed at batch 64
    (a million values drawn), as before."""
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones((), jnp.float32)})
    m = sm.load(sm.export(h, tmp_path / "m", example=np.ones((1, 4096), np.float32)).path)
    t = sm.timeit(m, batch=64, calls=2, repeats=1, warmup=1)
    assert t.calls == 2 and t.min() > 0


def _hostile_constraints(names):
    """64 constraints of at most 256 characters: a cycle no sizes settle (``d1 >= d2 + 1``,
    ``d2 >= d1 + 1``), then bounds written as sums of thousands of distinct numbers, each of
    which ``admits_any`` tried a batch at (and beside). ``names[0]`` is the batch."""
    numbers, out = iter(range(1000, 10**6, 7)), [f"{names[1]} >= {names[2]} + 1"]
    out.append(f"{names[2]} >= {names[1]} + 1")
    while len(out) < 64:
        c = f"{names[len(out) % len(names)]} <= "
        while len(c) < 245:
            c += f"{next(numbers)} + "
        out.append(c.removesuffix(" + "))
    return out


class _Budget:
    """``signature._evaluate`` counted, refused past ``most`` calls (a test, not hours)."""

    def __init__(self, monkeypatch, most):
        from symjax_mlp._artifact import signature

        self.calls, self.most, evaluate = 0, most, signature._evaluate

        def counted(*args):
            self.calls += 1
            assert self.calls <= most, f"more than {most:,} evaluations: it would take hours"
            return evaluate(*args)

        monkeypatch.setattr(signature, "_evaluate", counted)


@pytest.mark.slow  # an export of eight inputs, a load: ~3 s
def test_a_manifests_constraints_of_thousands_of_numbers_load_in_bounded_work(
    tmp_path, monkeypatch
):
    """An artifact without self-test vectors has its constraints checked at load for some
    sizes they admit (``admits_any``): a batch tried at each number in them and beside it, each
    running ``sizes_at``'s passes. A stranger's 64 constraints of sums of 2,800 distinct numbers
    and a cycle had load try 8,448 batches, 10^7 evaluations of 256-character terms for eight
    inputs (hours; 100 inputs: 10^8). It now tries at most MAX_TRIES batches, then leaves each
    call to refuse the bound it breaks; the load answers as the program does."""
    names = [f"d{i}" for i in range(8)]
    h = sm.hybridize(lambda p, *xs: xs[0] * p["w"], {"w": jnp.ones((), jnp.float32)})
    ex = tuple(np.ones((2,), np.float32) for _ in names)
    path = sm.export(h, tmp_path / "m", example=ex, shapes=tuple(names)).path

    def hostile(m):
        m["signature"]["constraints"] = _hostile_constraints(names)
        del m["files"]["selftest.safetensors"]

    art = manifest_edited(path, tmp_path / "hostile", hostile)
    (art / "selftest.safetensors").unlink()
    budget = _Budget(monkeypatch, 200_000)
    m = sm.load(art)
    assert budget.calls > 0  # the check ran, within its bound
    with pytest.raises(sm.SignatureError, match="d1 >= d2 \\+ 1"):
        m(*ex)


def test_sizes_at_settles_a_stranger_cycle_in_as_many_passes_as_constraints(monkeypatch):
    """``sizes_at`` made a pass per dimension name while a cycle moved sizes: 200 inputs of
    their own dimension and two constraints, 201 passes over every constraint per batch
    tried. Each pass settles one constraint's bound at least, so it makes one per constraint
    and one more, at most."""
    from symjax_mlp._artifact.signature import Signature, sizes_at
    from symjax_mlp._specs import TensorSpec

    ins = tuple(TensorSpec(f"args[{i}]", (f"d{i}",), "float32") for i in range(200))
    sig = Signature(ins, ins[:1], "array", None, ("d1 >= d2 + 1", "d2 >= d1 + 1"))  # d0: batch
    budget = _Budget(monkeypatch, 3 * 4 + 200 + 4)  # 3 passes of 4 sides; each dim; a check
    assert sizes_at(sig, 1) is None and budget.calls > 0


@pytest.mark.slow  # two exports, two re-exports, loads: ~4 s
@pytest.mark.parametrize("kind", ["strong", "weak"])
def test_a_format_3_model_re_exported_through_m_apply_stays_format_3(kind, tmp_path):
    """README's re-export of a loaded model (``sm.export(sm.hybridize(m.apply, params), ...)``)
    of an artifact whose scalar's weak type decides its dtypes wrote format 2, neither
    ``strong`` nor ``weak_type``: export saw m.apply refuse the other kind and took it for a
    model that takes no other ("nothing to refuse"), so the re-export answered m2(x, 1.5) in
    float32 where m refuses it and h answers bfloat16, in silence (a downgrade). Such an input
    is now recorded as the original records it: format 3, the other kind refused."""
    example, other = (np.float32(1.5), 1.5) if kind == "strong" else (jnp.asarray(1.5), 1.5)
    other = other if kind == "strong" else np.float32(1.5)
    h = sm.hybridize(_scalar, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    m = sm.load(sm.export(h, tmp_path / "m", example=(S, example), batch=None).path)
    again = sm.hybridize(m.apply, m.params)
    path = sm.export(again, tmp_path / "again", example=(S, example), batch=None).path
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format_version"] == 3, manifest["signature"]
    m2 = sm.load(path)
    assert m2.signature.strong == m.signature.strong
    assert [s.weak_type for s in m2.signature.inputs] == [s.weak_type for s in m.signature.inputs]
    assert h(S, other)[0].dtype != h(S, example)[0].dtype  # what m2(S, other) got wrong
    with pytest.raises(sm.SignatureError, match=r"input args\[1\] takes only"):
        m2(S, other)
    for g, w in zip(m2(S, example), h(S, example), strict=True):
        assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.slow  # an export, verify's fresh process: ~8 s
def test_verify_of_an_artifact_exported_at_a_weak_scalar_passes_it_as_a_python_number(tmp_path):
    """``sm.verify(path)`` and ``symjax-mlp verify DIR`` of a sound artifact exported at a weakly
    typed scalar (``jnp.asarray(1.5)``) reported it FAILED: they drew a NumPy float32 scalar,
    which such an input refuses (it takes Python numbers, as its model answers them). They now
    pass it as the self-test does, a Python number, in the fresh process and the reference."""
    h = sm.hybridize(_scalar, {"w": jnp.arange(1, 4, dtype=jnp.bfloat16)})
    path = sm.export(h, tmp_path / "weak", example=(S, jnp.asarray(1.5)), batch=None).path
    assert sm.load(path).signature.inputs[1].weak_type
    report = sm.verify(path, reference=h)
    assert report.ok and report.checks and not report.errors, str(report)  # (the CLI's call)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """An artifact of x * w whose one row is float32[4096] (16 KiB), rows merging: a stranger's
    256 MiB row scaled down, served under a ``max_body_bytes`` scaled down with it."""
    h = sm.hybridize(lambda p, x: x * p["w"], {"w": jnp.ones((), jnp.float32)})
    d = tmp_path_factory.mktemp("wide")
    return sm.export(h, d / "m", example=np.ones((2, 4096), np.float32)).path


class _Served(Exception):
    """Raised by ``ready``: serve got as far as listening."""


def _stop(url):
    raise _Served(url)


@pytest.mark.slow  # an export, loads, the command line: ~2 s
def test_serve_refuses_an_artifact_whose_one_row_no_request_body_could_carry(
    wide, monkeypatch, capsys
):
    """``serve`` (and ``symjax-mlp serve``) of an artifact whose one row is larger than
    ``max_body_bytes`` (a stranger's 256 MiB row under the 64 MiB default) warmed every bucket
    up to 64 rows first (16 GiB drawn and compiled for 256 MiB rows), then refused every
    request with 413. It is now refused before the batcher draws a row, in one line naming the
    row's bytes, the limit and what to do; ``create_app`` of such a batcher is refused too."""
    from symjax_mlp.serving import _lane

    drawn = []
    warm_up = _lane.Lane.warm_up
    monkeypatch.setattr(_lane.Lane, "warm_up", lambda lane: drawn.append(lane) or warm_up(lane))
    said = r"one row of the model's inputs \(args\[0\] float32\[4096\]\) is 16,384 bytes, more "
    with pytest.raises(sm.ConfigError, match=said + r"than max_body_bytes=16,383.*serve another"):
        sm.serving.serve(wide, port=0, max_body_bytes=16383, ready=_stop)
    assert not drawn  # refused before the warm-up
    cli = ["serve", str(wide), "--port", "0", "--max-body-bytes", "16383", "--dispatch", "async"]
    assert main(cli) == 2  # (sync dispatch is set before JAX starts: not in this process)
    err = capsys.readouterr().err
    said = "16,384 bytes, more than max_body_bytes=16,383"
    assert said in err.splitlines()[0] and "Traceback" not in err, err
    assert "--max-body-bytes BYTES" in err.splitlines()[1] and not drawn, err  # the option
    refused = pytest.raises(sm.ConfigError, match="create_app: one row of the model's inputs")
    with sm.serving.Batcher(sm.load(wide), max_batch=1) as b, refused:
        sm.serving.create_app(b, max_body_bytes=16383)


@pytest.mark.slow  # an export, three warm-ups: ~2 s
def test_serve_bounds_the_default_batch_by_the_bytes_a_server_holds(wide, monkeypatch):
    """Where ``max_batch`` is not given, serve warmed buckets up to 64 rows whatever a row
    held: 64 rows of 64 MiB (4 GiB) under the default limits. Its default is now the largest
    power of two up to 64 whose rows fit in ``max_inflight_bytes`` (4 bodies by default): a
    row of 16 KiB under a 16 KiB body limit (64 KiB held: the row fits a body) is served at
    buckets 1, 2, 4; a ``max_batch`` given, or rows that fit 64 times, as before."""
    from symjax_mlp.serving import _server

    made = []

    class Kept(sm.serving.Batcher):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self.buckets)

    monkeypatch.setattr(_server, "Batcher", Kept)
    for options, buckets in (
        ({"max_body_bytes": 16384}, (1, 2, 4)),
        ({"max_body_bytes": 16384, "max_batch": 8}, (1, 2, 4, 8)),
        ({"max_body_bytes": 16384, "max_inflight_bytes": 64 * 16384}, (1, 2, 4, 8, 16, 32, 64)),
    ):
        with pytest.raises(_Served):
            sm.serving.serve(wide, port=0, ready=_stop, **options)
        assert made.pop() == buckets, options


@pytest.mark.slow  # an export of two entry points, three loads: ~3 s
def test_a_manifest_marking_a_bool_input_weakly_typed_is_refused_at_load(tmp_path):
    """A manifest without self-test vectors, with ``weak_type: true`` on a bool scalar input
    (which JAX never types weakly: only Python ints, floats and complex numbers are, and no
    export writes it) loaded, then refused every call, ``True`` and ``np.bool_(True)`` alike,
    asking for "a Python number such as 2.0". It is now refused at load, naming the artifact's
    manifest (it said "manifest.json: ...", which folder's not said), the input, its dtype and
    that no export writes it (a weak float input, which export writes, loads: the verify test
    above); an entry point's input alike, at load, not at its first use."""
    h = sm.hybridize(lambda p, x, flag: jnp.where(flag, x * p["w"], x), {"w": jnp.float32(2)})
    ex = (S, np.bool_(True))
    path = sm.export({"main": h, "other": h}, tmp_path / "m", example=ex, batch=None).path
    m = sm.load(path)
    assert m(*ex)[0, 0] == m["other"](*ex)[0, 0] == 2  # sound as exported

    def weak(entry, files):
        def edit(m):
            sig = m["entries"][entry]["signature"] if entry else m["signature"]
            sig["inputs"][1]["weak_type"], m["format_version"] = True, 3
            for name in files:  # (its vectors, a NumPy bool, were refused)
                del m["files"][name]
            if entry:
                del m["entries"][entry]["program_files"]["selftest.safetensors"]

        return edit

    cases = [(None, "", ["selftest.safetensors"])]
    cases.append(("other", "entries.other.", ["other.selftest.safetensors"]))
    for entry, at, files in cases:
        art = manifest_edited(path, tmp_path / f"weak_{entry}", weak(entry, files))
        for name in files:
            (art / name).unlink()
        with pytest.raises(sm.ArtifactError) as e:
            sm.load(art)
        said = str(e.value)
        head = f"{art / 'manifest.json'}: {at}signature's input args[1] is bool[] marked "
        assert said.startswith(head + "weak_type: true, which no export writes"), said
        assert "corrupted or was edited" in said and "\n" not in said, said
