"""``export(self_test_tolerance=)``: how far load lets a self-test's outputs move.

A model with an adaptive solver (round 21's neural CDE, a ``while`` loop whose steps depend
on values) exported under one set of XLA flags and loaded under another answers within its
own tolerance (rtol 1e-3) but past the self-test's default (rtol 1e-4): load refused it, and
``self_test=False`` was the only way out. Here the moved answer is a self-test vector forged
off by about 5e-4 in a well-formed artifact (hashes updated), as another machine's rounding
would move it; the exporter's tolerance, recorded in the manifest, lets it load, and a
stranger's manifest cannot widen the check past ``MAX_TOLERANCE``.
"""

from __future__ import annotations

import hashlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import symjax_mlp as sm
from symjax_mlp.cli import main

pytestmark = pytest.mark.slow  # exports of a while loop (about 1 s each)

X = np.linspace(0.5, 4.0, 8, dtype=np.float32).reshape(2, 4)


def _sqrt(p, x):
    """Newton's square root of ``x * x * p + 1`` until it converges: a trip count set by
    values (the self-test's vectors are standard normal: the square keeps a root)."""
    a = x * x * p + 1.0

    def step(carry):
        y, _ = carry
        new = 0.5 * (y + a / y)
        return new, jnp.max(jnp.abs(new - y))

    return jax.lax.while_loop(lambda c: c[1] > 1e-5, step, (a, jnp.float32(1.0)))[0]


def _export(path, **options):
    h = sm.hybridize(_sqrt, jnp.float32(2.0))
    return sm.export(h, path, example=X, **options).path


def _moved(path):
    """Moves the self-test's recorded output by 5e-4 * (1 + |out|), the hashes rewritten: as
    another CPU's rounding would move an adaptive solve (past 1e-4, within 1e-3)."""
    file = path / "selftest.safetensors"
    with safe_open(file, "np") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out = tensors["out[0]"]
    tensors["out[0]"] = (out + 5e-4 * (1 + np.abs(out))).astype(out.dtype)
    save_file(tensors, file, metadata=meta)
    data = file.read_bytes()
    entry = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    _edit(path, lambda m: m["files"].update({file.name: entry}))


def _edit(path, edit):
    m = json.loads((path / "manifest.json").read_text())
    edit(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_an_answer_moved_within_the_exporters_tolerance_loads_and_past_the_default_is_refused(
    tmp_path,
):
    """Without the option the moved answer is refused, and the refusal of a program with a
    while loop names the option; with ``self_test_tolerance=1e-3`` it loads and answers."""
    plain = _export(tmp_path / "plain")
    _moved(plain)
    with pytest.raises(sm.ArtifactError, match="no longer reproduces") as info:
        sm.load(plain, allow={"while"})
    said = str(info.value)
    assert "rtol 0.0001" in said and "self_test_tolerance=" in said and "while loop" in said
    wide = _export(tmp_path / "wide", self_test_tolerance=1e-3)
    manifest = json.loads((wide / "manifest.json").read_text())
    assert manifest["self_test_tolerance"] == {"rtol": 1e-3, "atol": 1e-3}
    _moved(wide)
    m = sm.load(wide, allow={"while"})
    np.testing.assert_allclose(m(X), np.sqrt(X * X * 2.0 + 1), rtol=1e-6)
    # rtol and atol apart; narrower than the move, it refuses it again (atol at least 4
    # epsilons of float32, as the default's floor)
    apart = _export(tmp_path / "apart", self_test_tolerance={"rtol": 1e-3, "atol": 0.0})
    assert sm.load(apart, allow={"while"}).manifest["self_test_tolerance"]["atol"] == 0.0
    _moved(apart)
    _edit(apart, lambda m: m["self_test_tolerance"].update(rtol=1e-5))
    floor = r"where rtol 1e-05 and atol 4\.76837e-07 allow"  # 4 float32 epsilons
    with pytest.raises(sm.ArtifactError, match=floor) as info:
        sm.load(apart, allow={"while"})
    assert "past the tolerance its exporter set" in str(info.value)


def _both(rtol):
    return {"rtol": rtol, "atol": 1e-5}


@pytest.mark.parametrize(
    "value",
    [
        *map(_both, (1.0, math.inf, math.nan, 1e308, -1e-3, "1e-3", True, None)),
        {"rtol": 1e-3},
        {"rtol": 1e-3, "atol": 1e-5, "off": 1},
        [1e-3, 1e-3],
        1e-3,
        None,
    ],
)
def test_a_strangers_tolerance_past_the_cap_or_not_two_numbers_is_refused(tmp_path, value):
    """A manifest's ``self_test_tolerance`` is a stranger's: past 0.1 (inf, 1e308) it would
    switch the check off, NaN would refuse every answer; load and inspect refuse it, naming
    the field and the bound, whether or not the self-test runs."""
    path = _export(tmp_path / "m")
    _edit(path, lambda m: m.update(self_test_tolerance=value))
    for read in (lambda: sm.load(path, allow={"while"}), lambda: sm.load(path, self_test=False),
                 lambda: sm.inspect(path)):  # fmt: skip
        with pytest.raises(sm.ArtifactError, match=r"self_test_tolerance is .* from 0 to 0\.1"):
            read()


def test_the_cap_itself_loads_and_inspect_shows_the_tolerance(tmp_path, capsys):
    path = _export(tmp_path / "m", self_test_tolerance={"rtol": 0.1, "atol": np.float32(0.05)})
    assert sm.load(path, allow={"while"})(X).shape == (2, 4)
    assert "self-test  load checks its outputs to rtol 0.1, atol 0.05" in str(sm.inspect(path))
    assert main(["inspect", str(path)]) == 0
    assert "rtol 0.1, atol 0.05 (export's self_test_tolerance)" in capsys.readouterr().out
    plain = _export(tmp_path / "plain")
    assert "self_test_tolerance" not in str(sm.inspect(plain))


@pytest.mark.parametrize(
    "value", [0.5, -1e-3, math.nan, math.inf, "1e-3", True, {"rtl": 1e-3}, np.ones(2)]
)
def test_export_refuses_a_tolerance_past_the_cap_before_any_work(tmp_path, value):
    h = sm.hybridize(_sqrt, jnp.float32(2.0))
    with pytest.raises(sm.ConfigError, match=r"self_test_tolerance=.*from 0 to 0\.1"):
        sm.export(h, tmp_path / "m", example=X, self_test_tolerance=value)
    assert not (tmp_path / "m").exists()
