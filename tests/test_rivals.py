"""The benchmark's rival rows (scripts/benchmarks/rivals.py): each one that can be made here
answers as the JAX model does, in this process and in a fresh one; one that cannot says why.

Speeds are the benchmark's business: nothing here asserts a timing.
"""

import dataclasses
import importlib.util
import os
import shutil
import sys

import jax
import numpy as np
import pytest
from benchmarks import rivals as rv  # scripts/, on sys.path from conftest.py

ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")


# One test makes every row, once: torch.compile and AOTInductor compile for seconds each, and a
# module-scoped fixture would be made again by each xdist worker that runs one of its tests.
@pytest.mark.torch
def test_every_row_answers_as_jax_here_and_from_its_artifact_in_a_fresh_process(tmp_path):
    pytest.importorskip("torch")
    net, variables, x = _chapter()
    want = np.asarray(net.apply(variables, x))
    rivals = rv.build_rivals(
        variables["params"], np.asarray(x), threads=_threads(), workdir=tmp_path
    )
    assert [r.key for r in rivals] == list(rv.KEYS)
    made = {r.key for r in rivals if r.skipped is None}
    assert _makeable() <= made, [(r.key, r.skipped) for r in rivals if r.skipped]
    for r in rivals:
        assert r.label == rv.LABELS[r.key]
        if r.skipped is not None:  # one line for the table, "<ExceptionType>: <message>"
            assert r.call is None and r.stage_s is None and r.script is None
            assert "\n" not in r.skipped and r.skipped.split(":")[0].isidentifier()
            continue
        assert r.stage_s > 0
        for _ in range(3):  # TorchScript re-optimizes on its second and third calls
            got = np.asarray(r.call())
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=r.key)
        if r.key == "torch_compile":  # eager's script plus torch.compile(net): ~15 s to compile
            continue
        seconds = rv.cold_start(r)  # raises unless the fresh process answers as JAX
        assert isinstance(seconds, float) and seconds > 0, r.key


@pytest.mark.torch
def test_cold_start_checks_the_fresh_answer(tmp_path):
    pytest.importorskip("torch")
    _, variables, x = _chapter()
    (row,) = rv.build_rivals(
        variables["params"], np.asarray(x), threads=1, workdir=tmp_path, keys=["torch_script"]
    )
    assert row.skipped is None, row.skipped
    wrong = dataclasses.replace(row, expected=row.expected + 1)
    with pytest.raises(RuntimeError, match="torch_script answered max \\|difference\\| 1"):
        rv.cold_start(wrong)


def test_a_missing_package_skips_its_row_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` now fails
    _, variables, x = _chapter()
    (row,) = rv.build_rivals(
        variables["params"], np.asarray(x), threads=1, workdir=tmp_path, keys=["onnxruntime"]
    )
    assert row.call is None and row.stage_s is None and row.script is None
    assert row.skipped.startswith("ModuleNotFoundError: import of onnxruntime halted")
    with pytest.raises(ValueError, match="onnxruntime was skipped"):
        rv.cold_start(row)


def test_without_torch_every_row_says_why(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch", None)
    _, variables, x = _chapter()
    rivals = rv.build_rivals(variables["params"], np.asarray(x), threads=1, workdir=tmp_path)
    assert [r.key for r in rivals] == list(rv.KEYS)
    # ONNX Runtime's row may first miss its own packages (a machine with neither extra)
    missing = ["torch", *(m for m in ONNX_PACKAGES if importlib.util.find_spec(m) is None)]
    for r in rivals:
        assert r.call is None and any(m in r.skipped for m in missing), r


def test_an_unknown_row_is_refused(tmp_path):
    _, variables, x = _chapter()
    with pytest.raises(ValueError, match="unknown rows \\['tf'\\]"):
        rv.build_rivals(
            variables["params"], np.asarray(x), threads=1, workdir=tmp_path, keys=["tf"]
        )


def _chapter():
    """(net, variables, x): the chapter MLP and input, as the ``chapter`` fixture makes them."""
    import symjax_mlp as sm

    net = sm.mlp((256, 128, 2))
    x = jax.random.normal(jax.random.key(0), (1, 512), np.float32)
    return net, net.init(jax.random.key(1), x), x


def _makeable():
    """The rows that must be made here: torch's own, inductor's with a C++ compiler, ONNX
    Runtime's with its packages (all of them where CI installs the torch extra)."""
    rows = {"torch_eager", "torch_script", "torch_freeze"}
    if shutil.which("g++") or shutil.which("c++"):
        rows |= {"torch_compile", "torch_aoti"}
    if all(importlib.util.find_spec(m) for m in ("onnx", "onnxscript", "onnxruntime")):
        rows.add("onnxruntime")
    return rows


def _threads():
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
