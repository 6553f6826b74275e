"""An artifact records the process-wide JAX settings that shaped its program (session 64).

dynamax's ``import`` sets ``jax_default_matmul_precision`` to ``"float32"`` for the whole
process: every later export writes its ``dot_general`` ops with ``precision = [HIGHEST,
HIGHEST]``, other bytes than a fresh process's, with no reason given (CI's slow run:
test_day_six's byte-for-byte exports failed in the worker that had imported dynamax). Each
setting of ``jaxconfig.SETTINGS`` changes the program of one model for one input; the manifest's
``jax_config`` names those not at JAX's defaults, ``inspect`` and ``verify`` show them, a
stranger's is checked at load, and a fresh process with them writes the same bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm
from symjax_mlp._artifact.jaxconfig import SETTINGS

_EPOCH = str(int(time.time()) // 86_400 * 86_400)  # today, 00:00 UTC: manifests dated alike


@contextlib.contextmanager
def _setting(name, value):
    """``jax.config.update(name, value)`` for the block, put back even on failure."""
    before = jax.config.values[name]
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, before)


def _everything(p, x):
    """One model whose program each setting of SETTINGS changes: matmuls, jax.random drawn
    inside (threefry, its impl and seed), gumbel, softmax, a scan (its counter), remat."""
    key = jax.random.key(3)
    y = jax.checkpoint(lambda x: jax.nn.softmax(x @ p["w"]))(x)
    y = y + jax.random.normal(key, y.shape) + jax.random.gumbel(key, y.shape)
    return jax.lax.scan(lambda c, r: (c + r, c * r), jnp.zeros_like(y[0]), y)[1]


def _export(path, vjp_order):
    h = sm.hybridize(_everything, {"w": jnp.linspace(-1.0, 1.0, 8).reshape(4, 2)})
    return sm.export(h, path, example=jnp.ones((3, 4)), batch=None, vjp_order=vjp_order)


def _files(path):
    return {f.name: f.read_bytes() for f in sorted(path.iterdir())}


_OTHER = {  # a value of each setting that writes another program than its default
    "jax_default_matmul_precision": "float32",
    "jax_default_prng_impl": "rbg",
    "jax_enable_x64": True,
    "jax_threefry_partitionable": False,
    "jax_random_seed_offset": 1,
    "jax_high_dynamic_range_gumbel": True,
    "jax_softmax_custom_jvp": True,
    "jax_scan3": True,
    "jax_remat3": True,
    "jax_use_simplified_jaxpr_constants": True,
    "eager_constant_folding": True,
}


def test_every_recorded_setting_has_a_value_to_show_it():
    assert set(_OTHER) == set(SETTINGS)
    assert all(SETTINGS[k][2](v) and v != SETTINGS[k][0] for k, v in _OTHER.items())


@pytest.mark.slow  # a fresh process: a second or two
def test_a_fresh_process_records_nothing():
    """SETTINGS' defaults are this JAX's: a fresh process (no JAX_* variable set) records no
    setting (a JAX whose default moved would have every export record one)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    code = "from symjax_mlp._artifact.jaxconfig import recorded; print(recorded())"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=300)  # fmt: skip
    assert run.stdout.strip() == "{}"


@pytest.mark.slow  # two exports per setting, of a program and its VJP: about a minute in all
@pytest.mark.parametrize("name", list(_OTHER))
def test_each_recorded_setting_writes_another_program_and_says_so(name, tmp_path, monkeypatch):
    """Exported twice, with and without the setting: other program bytes, and the manifest
    names the setting (only there); without it, no ``jax_config`` at all."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", _EPOCH)
    order = 0 if name == "jax_scan3" else 1  # (JAX's experimental scan has no VJP yet)
    plain = _export(tmp_path / "plain", order)
    with _setting(name, _OTHER[name]):
        changed = _export(tmp_path / "changed", order)
    assert "jax_config" not in plain.manifest and plain.jax_config == {}
    assert changed.jax_config == {name: _OTHER[name]}
    assert _files(plain.path)["model.jaxexport"] != _files(changed.path)["model.jaxexport"]


@pytest.mark.slow  # two exports, a load: seconds
def test_the_dynamax_precision_is_recorded_shown_and_refused_by_no_load(tmp_path, monkeypatch):
    """The setting dynamax's import makes: the export records it, ``inspect`` prints it, and a
    process at JAX's default loads and runs the program as written (HIGHEST inside)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", _EPOCH)
    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((4, 2)))
    x = jnp.ones((3, 4))
    plain = sm.export(h, tmp_path / "plain", example=x)
    with _setting("jax_default_matmul_precision", "float32"):
        art = sm.export(h, tmp_path / "a", example=x)
    assert art.jax_config == {"jax_default_matmul_precision": "float32"}
    assert json.loads((art.path / "manifest.json").read_text())["jax_config"] == art.jax_config
    assert "HIGHEST" in art.mlir_module() and "HIGHEST" not in plain.mlir_module()
    assert "jax config jax_default_matmul_precision=float32" in str(sm.inspect(art.path))
    assert "jax config JAX's defaults" in str(sm.inspect(plain.path))
    m = sm.load(art.path)  # this process: JAX's default precision; no refusal, no warning
    assert "HIGHEST" in jax.jit(m).lower(x).as_text()
    assert m(x).tolist() == h(x).tolist()


@pytest.mark.slow  # three exports: a second
def test_a_value_that_writes_the_default_program_is_not_recorded(tmp_path, monkeypatch):
    """``"bfloat16"`` is JAX's default precision by another name: the same bytes, so the same
    manifest (a ``with`` block's setting, this thread's, is the one read)."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", _EPOCH)
    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((4, 2)))
    x = jnp.ones((3, 4))
    plain = sm.export(h, tmp_path / "plain", example=x)
    with jax.default_matmul_precision("bfloat16"):
        same = sm.export(h, tmp_path / "same", example=x)
    with jax.default_matmul_precision("tensorfloat32"):
        other = sm.export(h, tmp_path / "other", example=x)
    assert _files(plain.path) == _files(same.path)
    assert other.jax_config == {"jax_default_matmul_precision": "tensorfloat32"}


_HOSTILE = {
    "unknown setting": {"jax_not_a_setting": True},
    "wrong type": {"jax_enable_x64": 1},
    "unknown precision": {"jax_default_matmul_precision": "ultra"},
    "huge string": {"jax_default_matmul_precision": "x" * 1_000_000},
    "huge int": {"jax_random_seed_offset": 10**40},
    "not an object": ["jax_enable_x64"],
    "a null": None,
}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("jaxconfig") / "m"
    h = sm.hybridize(lambda p, x: x @ p, jnp.ones((4, 2)))
    return sm.export(h, path, example=jnp.ones((3, 4))).path


@pytest.mark.parametrize("case", list(_HOSTILE))
def test_a_strangers_jax_config_is_refused_naming_the_folder(case, exported, tmp_path):
    """A manifest's ``jax_config`` of unknown settings, wrong types or huge values is refused
    at load (before a byte of the program is read), naming the folder and the field; the
    same artifact without the field (an earlier export's) loads as before."""
    path = tmp_path / "m"
    path.mkdir()
    for f in exported.iterdir():
        (path / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((exported / "manifest.json").read_text())
    assert "jax_config" not in manifest
    sm.load(path)  # without the field: as every earlier artifact
    (path / "manifest.json").write_text(json.dumps({**manifest, "jax_config": _HOSTILE[case]}))
    for read in (sm.load, sm.inspect):
        with pytest.raises(sm.ArtifactError, match="jax_config is") as e:
            read(path)
        assert str(path) in str(e.value) and "jax_default_matmul_precision" in str(e.value)
        assert len(str(e.value)) < 1_000


_REEXPORT = """
import json, sys
import jax, jax.numpy as jnp, symjax_mlp as sm
for name, value in json.loads(sys.argv[2]).items():
    jax.config.update(name, value)
h = sm.hybridize(lambda p, x: jax.nn.relu(x @ p), jnp.linspace(-1.0, 1.0, 8).reshape(4, 2))
sm.export(h, sys.argv[1], example=jnp.ones((3, 4)), vjp_order=1)
"""


@pytest.mark.slow  # three exports, two in fresh processes, and a verify: seconds
def test_a_fresh_process_with_the_recorded_settings_writes_the_same_bytes(tmp_path, monkeypatch):
    """What keeps test_day_six's byte-for-byte checks honest in a process where dynamax was
    imported: the export here records the precision, and a teammate's re-export in a fresh
    process with the recorded settings writes every file byte for byte; without them only
    the program (and the manifest saying so) differ. ``verify`` reports the settings."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", _EPOCH)
    h = sm.hybridize(lambda p, x: jax.nn.relu(x @ p), jnp.linspace(-1.0, 1.0, 8).reshape(4, 2))
    with _setting("jax_default_matmul_precision", "float32"):  # as after `import dynamax`
        here = sm.export(h, tmp_path / "here", example=jnp.ones((3, 4)), vjp_order=1)
    env = {**os.environ, "PYTHONHASHSEED": "99"}
    for name, settings in (("there", here.jax_config), ("fresh", {})):
        argv = [sys.executable, "-c", _REEXPORT, str(tmp_path / name), json.dumps(settings)]
        subprocess.run(argv, env=env, check=True, timeout=300)
    assert _files(here.path) == _files(tmp_path / "there")
    fresh = _files(tmp_path / "fresh")
    assert {k for k, v in fresh.items() if v != _files(here.path)[k]} == {
        "manifest.json", "model.jaxexport", "model.mlirbc"}  # fmt: skip
    report = sm.verify(here.path, reference=h, batches=(2,))
    assert report.ok and report.jax_config == {"jax_default_matmul_precision": "float32"}
    assert "exported under jax_default_matmul_precision=float32" in str(report)
    assert report.to_dict()["jax_config"] == report.jax_config


@pytest.mark.slow  # four exports of a program and its VJP: seconds
def test_a_vjp_program_carries_no_path_or_line_of_this_machine(tmp_path, monkeypatch):
    """``vjp_order=1`` wrote the VJP programs with Python source locations: this checkout's
    path (``.../symjax_mlp/_export.py``) and the caller's line, so one model exported from two
    lines of a script (or two checkouts) differed byte for byte. And with
    ``jax_include_full_tracebacks_in_locations`` off, JAX wrote the user's frame in the
    forward program too, whatever the limit export set."""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", _EPOCH)
    h = sm.hybridize(lambda p, x: jax.nn.softmax(x @ p), jnp.ones((4, 2)))
    x = jnp.ones((3, 4))
    one = sm.export(h, tmp_path / "one", example=x, vjp_order=1)
    two = sm.export(h, tmp_path / "two", example=x, vjp_order=1)  # another line
    with _setting("jax_include_full_tracebacks_in_locations", False):
        short = sm.export(h, tmp_path / "short", example=x, vjp_order=1)
    assert _files(one.path) == _files(two.path) == _files(short.path)
    program = jax.export.deserialize(bytearray((one.path / "model.jaxexport").read_bytes()))
    text = program.mlir_module() + program.vjp().mlir_module()
    assert os.path.basename(__file__) not in text and "symjax_mlp/" not in text
