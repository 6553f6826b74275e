"""Arrays as .npy files for a model: one reader for ``symjax-mlp run``, verify and the server.

NumPy stores bfloat16 as raw bytes (``|V2``); reading for a model gives them their dtype back,
bit for bit, and casts nothing else. Writing puts one array in a .npy file or stream, several
in a .npz path, and refuses several for one .npy before writing anything.
"""

from __future__ import annotations

import errno
import io
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import symjax_mlp as sm
from symjax_mlp._npy import raw_dtype_notes, read_inputs, read_npy, write_outputs


def _npy(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, x)
    return buf.getvalue()


def test_read_npy_from_a_file_and_bytes_in_native_byte_order(tmp_path):
    x = np.arange(6, dtype=">f4").reshape(2, 3)
    np.save(tmp_path / "x.npy", x)
    for source in (tmp_path / "x.npy", str(tmp_path / "x.npy"), _npy(x)):
        got = read_npy(source, what="x")
        assert got.dtype == np.float32 and got.dtype.isnative
        np.testing.assert_array_equal(got, x)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (  # it said no more: which array, saved how?
            lambda p: np.savez(p / "f", x=np.ones(2)) or p / "f.npz",
            "is an .npz archive of ['x']; a .npy file holds one array. Save the one to pass "
            "alone: np.save(file, np.load(archive)['x']).",
        ),
        (lambda p: p.joinpath("f").write_text("1 2 3") and p / "f", "is not a readable .npy"),
        (  # was NumPy's 'Object arrays cannot be loaded when allow_pickle=False': save how?
            lambda p: np.save(p / "f", np.array([{}], object)) or p / "f.npy",
            "is not a readable .npy array of numbers: it holds Python objects (dtype object), "
            "read only by unpickling, which can run code. Save numbers: np.save(file, "
            "np.asarray(x, np.float32))",
        ),
        (lambda p: p / "missing.npy", "is not a readable .npy"),
        (
            lambda p: p.joinpath("f.npy").write_bytes(_npy(np.ones(2)) * 2) and p / "f.npy",
            "has more bytes after its array (float64[2]): a second array",
        ),
    ],
    ids=["npz", "text", "pickle", "missing", "two arrays"],
)
def test_read_npy_refuses_anything_but_one_array_with_the_given_error(tmp_path, make, says):
    source = make(tmp_path)

    class Refused(Exception):
        pass

    with pytest.raises(sm.SignatureError, match=f"^{re.escape(str(source))} {re.escape(says)}"):
        read_npy(source, what=str(source))
    with pytest.raises(Refused, match=re.escape(says)):
        read_npy(source, what=str(source), error=Refused)


def test_read_npy_refuses_a_header_declaring_more_than_the_file_holds(tmp_path):
    # NumPy allocated the declared array before its read failed (here 4 TB: a MemoryError)
    header = {"descr": "<f4", "fortran_order": False, "shape": (10**6, 10**6)}
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    data = buf.getvalue().ljust(200, b"\0")
    (tmp_path / "big.npy").write_bytes(data)
    says = (
        r"^big declares an array of shape \(1000000, 1000000\) and dtype float32, which needs "
        r"4,000,000,000,000 bytes, but it holds 72 after its header: .*np\.save\(file, x\)\.$"
    )
    for source in (tmp_path / "big.npy", data):
        with pytest.raises(sm.SignatureError, match=says):
            read_npy(source, what="big")


def test_read_inputs_gives_bfloat16_its_dtype_and_casts_nothing(tmp_path):
    x = np.asarray(jax.random.normal(jax.random.key(0), (2, 3)), ml_dtypes.bfloat16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "f.npy", x.astype(np.float32))
    assert np.load(tmp_path / "x.npy").dtype == np.dtype("V2")
    spec = sm.TensorSpec("args[0]", ("b", 3), "bfloat16")
    [got] = read_inputs([tmp_path / "x.npy"], [spec])
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got.view(np.uint16), x.view(np.uint16))  # bit for bit
    with pytest.raises(sm.SignatureError) as e:
        read_inputs([tmp_path / "f.npy"], [spec])
    assert str(e.value) == (
        f"{tmp_path / 'f.npy'} (args[0]) holds float32[2, 3] but the artifact expects "
        f'bfloat16[b, 3]; nothing is cast. Save it as bfloat16: np.save("{tmp_path / "f.npy"}", '
        "x.astype(jnp.bfloat16))."
    )
    # a file past the last input is read as it is: the model refuses the count
    assert len(read_inputs([tmp_path / "x.npy"] * 2, [spec])) == 2


def test_write_outputs_npy_npz_stream_and_refusal(tmp_path):
    y, z = np.arange(3, dtype=np.float32), np.ones((2, 2), ml_dtypes.bfloat16)
    out = tmp_path / "y.out"  # exactly this name: no .npy appended
    assert [a.shape for a in write_outputs(y, out)] == [(3,)]
    np.testing.assert_array_equal(np.load(out), y)
    write_outputs((y, z), tmp_path / "yz.NPZ")  # an .npz path in any case
    got = np.load(tmp_path / "yz.NPZ")
    np.testing.assert_array_equal(got["out0"], y)
    np.testing.assert_array_equal(got["out1"].view(ml_dtypes.bfloat16), z)
    stream = io.BytesIO()
    write_outputs(jnp.asarray(y), stream)
    np.testing.assert_array_equal(np.load(io.BytesIO(stream.getvalue())), y)
    with pytest.raises(sm.SignatureError, match=r"returns 2 arrays, but .*one\.npy is one \.npy"):
        write_outputs((y, z), tmp_path / "one.npy")
    assert not (tmp_path / "one.npy").exists()
    assert raw_dtype_notes([y, z]) == [
        ".npy has no bfloat16 type, so it is stored as |V2 (the same bytes); read it back "
        "with np.load(...).view(ml_dtypes.bfloat16)"
    ]
    assert raw_dtype_notes([y]) == []


def test_a_served_npy_body_is_read_as_run_reads_a_file(tmp_path):
    """The server's .npy body goes through the same reader: bfloat16 from its |V2 bytes, a
    big-endian body as the same numbers, an .npz refused with 400."""
    from symjax_mlp.serving._bodies import BadRequest, decode

    x = jax.random.normal(jax.random.key(1), (2, 8)).astype(jnp.bfloat16)
    net = sm.mlp((8,))
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), net.init(jax.random.key(0), x))
    h = sm.hybridize(net, variables)
    art = sm.export(h, tmp_path / "m", example=x)
    with sm.serving.Batcher(sm.load(art.path), max_batch=4) as b:
        [got], as_npy = decode(b, _npy(np.asarray(x)), "application/x-npy")
        assert as_npy and got.dtype == ml_dtypes.bfloat16
        np.testing.assert_array_equal(np.asarray(b(got)), np.asarray(h(x)))
        buf = io.BytesIO()
        np.savez(buf, x=np.asarray(x))
        with pytest.raises(BadRequest, match=r"the body is an \.npz archive") as e:
            decode(b, buf.getvalue(), "application/x-npy")
        assert e.value.status == 400


def test_run_reads_an_rng_key_input_as_the_key_data_it_writes(tmp_path, capsys):
    """run writes a key output as its key data, but refused that data as a key input, telling
    the user to save it with x.astype(jnp.key<fry>), which is no Python. It reads uint32 key
    data as keys now, and says how to write them for a file of another type."""
    import jax
    import jax.numpy as jnp

    import symjax_mlp as sm
    from symjax_mlp.cli import main

    h = sm.hybridize(lambda p, k, x: x * p + jax.random.key_data(k)[:, :1] % 7, 2.0)
    keys = jax.random.split(jax.random.key(3), 2)
    art = sm.export(h, tmp_path / "a", example=(keys, jnp.ones((2, 3))))
    np.save(tmp_path / "k.npy", np.asarray(jax.random.key_data(keys)))
    np.save(tmp_path / "x.npy", np.ones((2, 3), np.float32))
    run = ["run", str(art.path), "--trust"]  # its key_data op is no MLP's: trusted
    inputs = ["--input", str(tmp_path / "k.npy"), "--input", str(tmp_path / "x.npy")]
    assert main([*run, *inputs, "--output", str(tmp_path / "y.npy")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), h(keys, jnp.ones((2, 3))))
    wrong = ["--input", str(tmp_path / "x.npy"), "--input", str(tmp_path / "x.npy")]
    assert main([*run, *wrong, "--output", str(tmp_path / "z.npy")]) == 2
    err = capsys.readouterr().err
    assert "holds float32[2, 3] but the artifact expects key<fry>[b]" in err
    assert "uint32 with a last axis of 2" in err and "jax.random.key_data(keys)" in err
    assert "astype" not in err


def test_write_outputs_failing_at_a_later_rename_says_what_was_written(tmp_path, monkeypatch):
    """A failure at the second of the final renames said 'what each path held is unchanged'
    while the first path held the new output: it names what was written, and what was not."""
    import symjax_mlp._files as files

    y = np.arange(3, dtype=np.float32)
    first, second = tmp_path / "a.npy", tmp_path / "b.npy"
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(errno.EIO, "Input/output error")
        real(src, dst)

    monkeypatch.setattr(files.os, "replace", replace)
    with pytest.raises(sm.SymjaxError) as e:
        write_outputs(y, first, (y * 2, second))
    assert str(e.value) == (
        f"cannot write {second} (Input/output error); written already: {first}; what each "
        "other path held is unchanged. Pass another path."
    )
    np.testing.assert_array_equal(np.load(first), y)
    assert not second.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a.npy"]


def test_write_outputs_onto_a_directory_says_to_pass_another_path_not_to_free_space(tmp_path):
    """'cannot write DIR (Is a directory). Free space there, or pass another path.': the fix
    offered was a full disk's, for every error; only a full disk's message says it now."""
    with pytest.raises(sm.SymjaxError) as e:
        write_outputs(np.zeros(3, np.float32), tmp_path)
    assert str(e.value) == f"cannot write {tmp_path} (Is a directory). Pass another path."


def test_verify_and_timeit_draw_the_inputs_of_an_int4_artifact(tmp_path):
    """ml_dtypes' int4 is no NumPy integer: verify said the manifest was corrupted."""
    h = sm.hybridize(lambda p, x: x.astype(jnp.float32) * p["w"], {"w": jnp.ones(3)}, name="i4")
    sm.export(h, tmp_path / "m", example=np.ones((2, 3), ml_dtypes.int4))
    report = sm.verify(tmp_path / "m")
    assert report.ok, report
    assert sm.timeit(sm.load(tmp_path / "m"), calls=2, repeats=1).calls == 2
