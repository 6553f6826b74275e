"""The symbolic graph: counts, layers, flops, DOT, and XLA's optimized program."""

import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

import symjax_mlp as sm
from symjax_mlp.chapter import fancy_func


def test_chapter_graph_counts_and_layers(chapter):
    _, _, h, x = chapter
    g = h.graph(x)
    assert isinstance(g, sm.Graph) and str(g) == str(g.jaxpr)
    counts = g.primitive_counts
    assert counts["dot_general"] == 3 and counts["add"] == 3 and counts["max"] == 2
    assert list(g.by_layer) == [f"HybridSequential/layers_{i}" for i in range(3)]
    for i, layer in enumerate(g.by_layer.values()):
        assert layer["dot_general"] == 1
        assert layer["max"] == (0 if i == 2 else 1)
    assert h.trace_count == 0  # staging for inspection is not a compiled-path trace


def test_flops_match_xla_cost_analysis(chapter):
    _, _, h, x = chapter
    xla = h.compile(x).cost_analysis()["flops"]
    assert abs(h.graph(x).flops - xla) <= 0.05 * xla
    xb = jnp.ones((64, 512))
    assert abs(h.graph(xb).flops - h.compile(xb).cost_analysis()["flops"]) <= 0.05 * 64 * xla


def test_concurrent_branches_are_separate_layers():
    net = sm.HybridConcurrent((sm.Dense(3), sm.mlp((4, 2))))
    x = jnp.ones((1, 5))
    g = sm.hybridize(net, net.init(jax.random.key(0), x)).graph(x)
    assert g.by_layer["HybridConcurrent/branches_0"]["dot_general"] == 1
    assert g.by_layer["HybridConcurrent/branches_1/layers_1"]["dot_general"] == 1
    assert g.by_layer["HybridConcurrent"]["concatenate"] == 1


def test_fancy_func_is_folded_to_one_constant():
    a, b, c, d = (jnp.float32(v) for v in (1, 2, 3, 4))
    g = sm.stage(lambda: fancy_func(a, b, c, d))()
    assert g.primitive_counts == {"add": 3}
    hlo = g.optimized()
    entry = hlo[hlo.index("ENTRY") :]
    assert re.search(r"constant\(10\)", entry)
    assert " add(" not in entry and "fusion" not in entry
    assert "stablehlo.add" in g.lower().as_text()


def test_fancy_func_with_inputs_keeps_its_adds():
    args = [jnp.float32(v) for v in (1, 2, 3, 4)]
    g = sm.stage(fancy_func)(*args)
    assert g.primitive_counts["add"] == 3 and g.name == "fancy_func"
    assert "constant(10)" not in g.optimized()


def test_stage_rejects_jitted_functions_and_hybrids(chapter):
    _, _, h, _ = chapter
    with pytest.raises(TypeError, match=r"already jax.jit-compiled.*stage\(fancy_func\)"):
        sm.stage(jax.jit(fancy_func))
    with pytest.raises(TypeError, match=r"h.graph\(x\)"):
        sm.stage(h)
    with pytest.raises(TypeError, match="expects a callable"):
        sm.stage(3)


def test_to_dot_is_valid_graphviz(chapter):
    _, _, h, x = chapter
    dot = h.graph(x).to_dot()
    assert dot.startswith('digraph "HybridSequential"') and dot.rstrip().endswith("}")
    assert dot.count("dot_general") == 3
    assert 'label="HybridSequential/layers_2"' in dot


def test_to_svg_renders_with_graphviz_or_says_how_to_get_it(chapter, monkeypatch):
    _, _, h, x = chapter
    g = h.graph(x)
    if shutil.which("dot"):  # .ci/run installs Graphviz, so CI takes this branch
        svg = g.to_svg()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg and "dot_general" in svg
        done = subprocess.run(["dot", "-Tcanon"], input=g.to_dot(), capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    monkeypatch.setenv("PATH", "")
    with pytest.raises(RuntimeError, match="apt-get install graphviz"):
        g.to_svg()
