"""The symbolic graph: counts, layers, flops, DOT, and XLA's optimized program."""

import concurrent.futures
import functools
import re
import shutil
import subprocess

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import ZOO, NnxDepth, _rnn_cell

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


def test_stage_rejects_hybrids_and_non_callables(chapter):
    _, _, h, _ = chapter
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


# -- DOT: literals, nested jaxprs as clusters, every model of the zoo renders --------------------
def _clusters(dot: str) -> list[tuple[tuple[str, ...], str]]:
    """``(enclosing cluster labels, outermost first; node label)`` for each node of the DOT."""
    nodes, open_ = [], []
    for line in dot.splitlines():
        head = re.match(r'\s*subgraph cluster_\w+ \{ label="((?:[^"\\]|\\.)*)";', line)
        if head:
            open_.append(head.group(1))
        elif line.strip() == "}":
            if open_:
                open_.pop()
        else:
            node = re.match(r'\s*\w+ \[.*label="((?:[^"\\]|\\.)*)"\];$', line)
            if node:
                nodes.append((tuple(open_), node.group(1)))
    assert not open_, "unbalanced clusters"
    return nodes


def _assert_renders(dot: str) -> None:
    assert dot.startswith("digraph ") and dot.rstrip().endswith("}")
    assert dot.count("{") == dot.count("}")
    if shutil.which("dot"):  # .ci/run installs Graphviz, so CI takes this branch
        done = subprocess.run(["dot", "-Tsvg"], input=dot, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert "<svg" in done.stdout and not done.stderr, done.stderr


@pytest.mark.parametrize(
    "fn",
    [
        lambda x: jnp.maximum(x, 0),
        jax.nn.softmax,
        lambda x: (x * 2, jnp.float32(3)),  # a constant output
        lambda x: jnp.float32(7),  # nothing but a constant
    ],
    ids=["maximum", "softmax", "constant_output", "only_constant"],
)
def test_to_dot_draws_literals_as_constant_nodes(fn):
    dot = sm.stage(fn)(jnp.ones((2, 3))).to_dot()
    literals = re.findall(r'(lit\d+) \[shape=plaintext, label="([^"]*)"\];', dot)
    assert literals
    for node, _ in literals:  # every constant feeds an equation or an output
        assert re.search(rf"^  {node} -> (op|out)\d+;$", dot, re.M), node
    _assert_renders(dot)


def test_to_dot_draws_the_maximum_literal_next_to_its_max():
    dot = sm.stage(lambda x: jnp.maximum(x, 0))(jnp.ones(3)).to_dot()
    (node,) = re.findall(r'(lit\d+) \[shape=plaintext, label="0(?:\.0)?"\];', dot)
    (op,) = re.findall(r'(op\d+) \[shape=box, label="max', dot)
    assert f"  {node} -> {op};" in dot


def test_to_dot_shows_the_relu_inside_its_call_clusters(chapter):
    _, _, h, x = chapter
    dot = h.graph(x).to_dot()
    nodes = _clusters(dot)
    maxes = [where for where, label in nodes if label.startswith("max\\n")]
    assert maxes == [
        (f"HybridSequential/layers_{i}", "custom_jvp_call: relu", "jit: relu") for i in (0, 1)
    ]
    assert [label for where, label in nodes if where and where[-1] == "jit: relu"].count(
        "0.0"
    ) == 2  # the relu's literal 0, drawn inside the call
    assert dot.count("dot_general") == 3
    _assert_renders(dot)
    if shutil.which("dot"):
        assert "jit: relu" in h.graph(x).to_svg()


def test_to_dot_draws_scan_while_and_cond_bodies():
    w = jnp.eye(4)

    def f(x):
        with jax.named_scope("loops"):
            x = jax.lax.scan(lambda c, _: (jnp.sin(c @ w), None), x, None, length=3)[0]
            x = jax.lax.while_loop(lambda c: c.sum() < 100, lambda c: c * 2 + 1, x)
        return jax.lax.cond(x.sum() > 0, lambda y: jnp.exp(y), lambda y: -y, x)

    dot = sm.stage(f)(jnp.ones((2, 4))).to_dot()
    nodes = {(where, label.split("\\n")[0]) for where, label in _clusters(dot)}
    assert (("loops", "scan (length=3)", "body"), "dot_general") in nodes
    assert (("loops", "scan (length=3)", "body"), "sin") in nodes
    assert (("loops", "while_loop (trip count unknown)", "cond"), "reduce_sum") in nodes
    assert (("loops", "while_loop (trip count unknown)", "body"), "mul") in nodes
    assert (("loops", "while_loop (trip count unknown)", "body"), "1.0") in nodes  # literal
    assert (("cond", "branch 1"), "exp") in nodes and (("cond", "branch 0"), "neg") in nodes
    assert (("cond",), "index") in nodes  # the branch index flows into the cond
    _assert_renders(dot)


@pytest.mark.parametrize("case", ZOO, ids=[c.name for c in ZOO])
@pytest.mark.parametrize("mode", ["eval", "train"])
def test_every_zoo_model_draws_and_renders(case, mode):
    g = case.hybridize().graph(*case.inputs(0), **getattr(case, mode))
    dot = g.to_dot()
    assert dot.startswith(f'digraph "{g.name}"')
    _assert_renders(dot)
    for layer in g.by_layer:
        if layer:
            assert f'label="{layer}"' in dot


# -- flops: convolutions, scan trip counts, while loops, cond ------------------------------------
class _ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3))(x))  # SAME padding: the border positions cost less
        x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2), feature_group_count=4)(x))
        x = nn.Conv(6, (2, 2), padding="VALID", kernel_dilation=(2, 2))(x)
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _xla_flops(fn, *args):
    return jax.jit(fn).lower(*args).compile().cost_analysis()["flops"]


def test_conv_flops_match_xla_cost_analysis():
    net, x = _ConvNet(), jax.random.normal(jax.random.key(0), (2, 12, 12, 4))
    h = sm.hybridize(net, net.init(jax.random.key(1), x))
    g, xla = h.graph(x), h.compile(x).cost_analysis()["flops"]
    assert g.primitive_counts["conv_general_dilated"] == 3 and g.flops_exact
    assert abs(g.flops - xla) <= 0.05 * xla, (g.flops, xla)


def test_a_valid_convolution_costs_two_flops_per_output_kernel_and_channel():
    x, k = jnp.ones((2, 9, 9, 6)), jnp.ones((3, 3, 2, 9))  # HWIO, feature groups of 2 channels

    def conv(x, k):
        return jax.lax.conv_general_dilated(
            x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=3,
        )  # fmt: skip

    g = sm.stage(conv)(x, k)
    assert g.flops == 2 * (2 * 7 * 7 * 9) * (3 * 3) * (6 // 3)
    assert g.flops == _xla_flops(conv, x, k)


def _matmul_scan(unroll):
    w = jax.random.normal(jax.random.key(0), (64, 64)) / 8

    def f(x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=10, unroll=unroll)

    return f


def test_scan_flops_are_the_body_times_its_length():
    x = jnp.ones((8, 64))
    body = sm.stage(lambda c: jnp.tanh(c @ jnp.ones((64, 64))))(x).flops
    g = sm.stage(_matmul_scan(1))(x)
    assert g.flops == 10 * body == 10 * 2 * 8 * 64 * 64 and g.flops_exact
    # XLA's cost analysis counts a rolled loop's body once; unrolled, it sees every trip
    xla = _xla_flops(_matmul_scan(True), x)
    assert sm.stage(_matmul_scan(True))(x).flops == g.flops
    assert abs(g.flops - xla) <= 0.05 * xla, (g.flops, xla)
    fori = sm.stage(lambda x: jax.lax.fori_loop(0, 10, lambda i, c: jnp.tanh(c @ x), x))(
        jnp.ones((64, 64))
    )  # static bounds: a scan, whose body also adds 1 to the counter
    assert fori.primitive_counts["scan"] == 1 and fori.flops == 10 * (2 * 64**3 + 1)


def test_while_loop_flops_are_a_lower_bound_and_say_so(monkeypatch):
    w, x = jnp.eye(16) * 2, jnp.ones((4, 16))

    def loop(params, x):
        return jax.lax.while_loop(lambda c: c.sum() < 1e4, lambda c: c @ w, x)

    h = sm.hybridize(loop, {}, name="loop")
    g = h.graph(x)
    assert g.flops_exact is False and g.flops_unknown == ("while",)
    assert g.flops == 4 * 16 + 1  # the condition, which runs at least once; not the body
    assert g.flops < h.compile(x).cost_analysis()["flops"]
    monkeypatch.setattr(sm.chapter, "_mlp", lambda *a, **k: (h, x))  # describe_mlp's model
    summary = sm.chapter.describe_mlp()
    assert f"flops: at least {g.flops:,} (a while_loop's trip count is unknown)" in summary


def test_a_loaded_models_program_is_named_as_what_the_flops_do_not_count(tmp_path, monkeypatch):
    """Its flops were a lower bound blamed on custom_vmap_call's "trip count" (which runs its
    call once): it is call_exported, whose ops the jaxpr does not show."""
    net, x = sm.mlp((4, 2)), jnp.ones((3, 5))
    inner = sm.hybridize(net, net.init(jax.random.key(0), x))
    m = sm.load(sm.export(inner, tmp_path / "m", example=x).path)
    h = sm.hybridize(lambda p, x: m(x) @ p, jnp.ones((2, 6)), name="outer")
    g = h.graph(x)
    assert g.flops_unknown == ("call_exported",) and g.flops == 2 * 2 * 3 * 6
    monkeypatch.setattr(sm.chapter, "_mlp", lambda *a, **k: (h, x))  # describe_mlp's model
    summary = sm.chapter.describe_mlp()
    assert f"flops: at least {g.flops:,} (a loaded model's program is not counted)" in summary


def test_known_trip_counts_are_exact(chapter):
    _, _, h, x = chapter
    assert h.graph(x).flops_exact and h.graph(x).flops_unknown == ()
    assert "at least" not in sm.chapter.describe_mlp(sizes=(4, 2), in_features=3)


def test_cond_costs_its_costliest_branch_as_in_xla():
    w = jnp.ones((32, 32))

    def f(x):
        return jax.lax.cond(x.sum() > 0, lambda x: x @ w, jnp.sin, x)

    g, xla = sm.stage(f)(jnp.ones((4, 32))), _xla_flops(f, jnp.ones((4, 32)))
    assert g.flops >= 2 * 4 * 32 * 32 and abs(g.flops - xla) <= 0.05 * xla, (g.flops, xla)


def test_nested_named_scopes_are_layers():
    def f(x):
        with jax.named_scope("outer"):

            def body(c, _):
                with jax.named_scope("inner"):
                    return jnp.sin(c) * 2, None

            return jax.lax.scan(body, x, None, length=3)[0] + 1

    layers = sm.stage(f)(jnp.ones(3)).by_layer
    assert layers["outer"] == {"scan": 1, "add": 1}
    assert layers["outer/inner"] == {"sin": 1, "mul": 1}


# -- nnx layer names -------------------------------------------------------------------------------
NNX_LAYERS = {
    "nnx_batchnorm": {"dense", "norm", "out"},
    "nnx_dropout": {"dense", "drop", "out"},
    "nnx_modes_eval": {"dense", "norm", "out"},  # an eval-mode Dropout stages no op
    "nnx_two_inputs": {"a", "b"},
    "nnx_depth": {"stem", *(f"hidden/{i}" for i in range(11)), "head"},  # hidden/11 is not called
}


@pytest.mark.parametrize("case", [c for c in ZOO if c.kind == "nnx"], ids=lambda c: c.name)
def test_nnx_submodules_are_named_layers(case):
    h, xs = case.hybridize(), case.inputs(0)
    by_layer = h.graph(*xs, **case.train).by_layer
    assert set(by_layer) - {""} == NNX_LAYERS[case.name]
    for layer in NNX_LAYERS[case.name] - {"norm", "drop"}:  # the nnx.Linear layers
        assert by_layer[layer]["dot_general"] == 1, layer
    stablehlo = h.lower(*xs, **case.eval).as_text(debug_info=True)
    hlo = h.compile(*xs, **case.eval).as_text()
    for layer in NNX_LAYERS[case.name] - {"drop"}:  # eval-mode dropout is no operation
        assert re.search(rf'loc\("[^"]*/{re.escape(layer)}/', stablehlo), layer
        assert re.search(rf'op_name="[^"]*/{re.escape(layer)}/', hlo), layer


def test_nnx_layer_names_leave_the_model_and_its_results_alone():
    case, call = next(c for c in ZOO if c.name == "nnx_depth"), nnx.Linear.__call__
    h, (x, depth) = case.hybridize(), case.inputs(0)
    model, _ = case.build()
    want = model(x, depth)
    chex.assert_trees_all_close(h(x, depth), want, rtol=1e-6)
    chex.assert_trees_all_close(h.eager(x, depth), want, rtol=1e-6)
    h.graph(x, depth)
    for _, m in nnx.iter_modules(h.module):  # no class swapped in for good
        assert type(m) in (NnxDepth, nnx.Linear, nnx.List), type(m)
    assert nnx.Linear.__call__ is call  # its call, wrapped only while a program is traced


class _Block(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.linear(x))


class _Nested(nnx.Module):
    def __init__(self, rngs):
        self.block = _Block(rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.block(x))


def test_nested_nnx_modules_name_their_path_once():
    h = sm.hybridize(_Nested(nnx.Rngs(0)))
    layers = h.graph(jnp.ones((1, 4))).by_layer
    assert layers["block/linear"]["dot_general"] == 1 and layers["head"]["dot_general"] == 1
    assert layers["block"]["custom_jvp_call"] == 1  # the relu, in the block's own call


class _Scanned(nnx.Module):
    """A stack of ``_Block`` s (made by ``nnx.vmap``) applied in turn by ``nnx.scan``, then
    mapped over by ``nnx.vmap``: both transforms run a copy of the module (``nnx.merge``)."""

    def __init__(self, rngs):
        self.blocks = nnx.vmap(_Block)(rngs.split(3))
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        body = nnx.scan(lambda block, x: block(x), in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        x = body(self.blocks, x)
        return nnx.vmap(lambda head, x: head(x), in_axes=(None, 0))(self.head, x[None])[0]


def test_nnx_layers_run_by_nnx_scan_and_nnx_vmap_compute_as_eager():
    """nnx.scan and nnx.vmap run copies of the layers (nnx.merge), which nothing ties to the
    layers they copy: their ops are their caller's, unnamed (the layers keep their classes)."""
    model, x = _Scanned(nnx.Rngs(0)), jnp.ones((1, 4))
    h = sm.hybridize(model)
    layers = h.graph(x).by_layer
    assert layers[""]["scan"] == 1 and layers[""]["custom_jvp_call"] == 1  # the scanned blocks
    assert not {"blocks", "blocks/linear", "vmap(head)"} & set(layers)
    chex.assert_trees_all_close(h(x), model(x), rtol=1e-6)
    assert type(model.blocks) is _Block and type(model.head) is nnx.Linear


class _TypeBranch(nnx.Module):
    """Scales the output of each layer that is exactly an ``nnx.Linear``."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 3, rngs=rngs), nnx.Linear(3, 3, rngs=rngs)])

    def __call__(self, x):
        for layer in self.layers:
            x = layer(x) * (2.0 if type(layer) is nnx.Linear else 1.0)
        return x


class _Averaged(nnx.Module):
    """Runs the average of two layers of one class, ``jax.tree.map`` over the modules."""

    def __init__(self, rngs):
        self.a = nnx.Linear(3, 3, rngs=rngs)
        self.b = nnx.Linear(3, 3, rngs=rngs)

    def __call__(self, x):
        return jax.tree.map(lambda p, q: (p + q) / 2, self.a, self.b)(x)


@pytest.mark.slow
@pytest.mark.parametrize("cls", [_TypeBranch, _Averaged], ids=lambda c: c.__name__)
def test_an_nnx_module_sees_its_layers_classes_in_a_compiled_call(cls):
    """Naming the layers swapped each layer's class for a subclass in compiled calls: a module
    branching on ``type(layer) is nnx.Linear`` answered otherwise than eager, silently, and
    ``jax.tree.map`` over two layers refused them as of different types."""
    model, x = cls(nnx.Rngs(0)), jnp.ones((2, 3))
    want, h = model(x), sm.hybridize(model)
    chex.assert_trees_all_close(h(x), want, rtol=1e-6)
    chex.assert_trees_all_close(h.apply(h.params, x), want, rtol=1e-6)
    assert h.graph(x).primitive_counts["dot_general"] == (2 if cls is _TypeBranch else 1)


@pytest.mark.parametrize("name", ["nnx_batchnorm", "nnx_dropout"])
def test_stage_of_an_nnx_module_whose_call_updates_its_state(name):
    """BatchNorm's statistics in training, a Dropout's rng count: nnx refuses the update of the
    module's own Variables inside make_jaxpr (TraceContextError); stage runs a copy."""
    case = next(c for c in ZOO if c.name == name)
    (x,), model = case.inputs(0), case.build()[0]
    before = nnx.to_pure_dict(nnx.state(model))
    g = sm.stage(model)(x, **case.train)
    assert g.name == type(model).__name__
    want = case.hybridize().graph(x, **case.train)
    assert g.primitive_counts == want.primitive_counts
    assert {k for k in g.by_layer if k} == {k for k in want.by_layer if k} >= {"dense", "out"}
    chex.assert_trees_all_equal(nnx.to_pure_dict(nnx.state(model)), before)  # left as it was


def test_nnx_layer_names_are_per_call_under_threads():
    cases = [c for c in ZOO if c.name in ("nnx_depth", "nnx_two_inputs")]
    hybrids = [(c.name, c.hybridize(), c.inputs(0)) for c in cases]

    def layers(item):
        name, h, xs = item
        return name, set(h.graph(*xs).by_layer) - {""}

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for name, got in pool.map(layers, hybrids * 4):
            assert got == NNX_LAYERS[name]


def test_a_jit_decorated_function_is_staged_as_the_function_it_wraps():
    """flax's randomness guide decorates its ``rnn_forward`` with ``@nnx.jit``: stage() refused
    it, saying to pass stage(rnn_forward), the very call made (``jax.jit`` alike)."""
    fn, cell = _rnn_cell("train")()
    want = sm.hybridize(fn, cell).graph(jnp.ones((2, 5, 3))).primitive_counts
    g = sm.stage(fn)(cell, jnp.ones((2, 5, 3)))
    assert g.name == "rnn_forward" and g.primitive_counts["jit"] == want["jit"] - 1
    assert {p: g.primitive_counts[p] for p in ("scan", "dot_general")} == {
        "scan": 1,
        "dot_general": 1,
    }
    assert cell.count[...] == 0  # staged, not run
    one = jnp.float32(1)
    assert sm.stage(jax.jit(fancy_func))(one, one, one, one).primitive_counts["add"] == 3


def test_input_dependence_follows_calls_loops_and_branches():
    """A scan's (a while's, a cond's, a jit's) outputs were each taken to depend on every
    operand: a step count carried beside the rows depended on them; and what a jit or a scan
    hands back as given was taken as new."""
    from symjax_mlp._hybrid.jaxpr import forwarded, input_dependent

    def f(n, x):
        steps, _ = jax.lax.scan(lambda c, r: ((c[0] + 1, c[1] + r.sum()), r), (n, 0.0), x)
        loop = jax.lax.while_loop(
            lambda c: c[0] < 3, lambda c: (c[0] + 1, c[1] + x.sum()), (n, 0.0)
        )
        branch = jax.lax.cond(n > 0, lambda: (n, x.sum()), lambda: (n + 1, 0.0))
        both = jax.lax.while_loop(
            lambda c: c[1] < 3.0, lambda c: (c[0] + 1, c[1] + 1), (n, x.sum())
        )
        return *steps, *loop, *branch, *jax.jit(lambda a, b: (a, b))(n, x), *both

    jaxpr = jax.make_jaxpr(f)(0, jnp.ones((2, 3))).jaxpr
    got = input_dependent(jaxpr, jaxpr.invars[1:])
    assert got == [False, True, False, True, False, True, False, True, True, True]

    def g(n, x):  # what comes back as given: through a jit, and a scan's carry
        (m, k), _ = jax.lax.scan(lambda c, r: ((c[0], c[1] + 1), r), (n, n), x)
        return *jax.jit(lambda a, b: (b, a))(n, x), m, k, n

    jaxpr = jax.make_jaxpr(g)(0, jnp.ones((2, 3))).jaxpr
    assert forwarded(jaxpr) == [1, 0, 0, None, 0]


# -- names -----------------------------------------------------------------------------------------
def test_stage_names_a_partial_after_its_function():
    one = jnp.float32(1)
    g = sm.stage(functools.partial(fancy_func, one))(one, one, one)
    assert g.name == "fancy_func" and g.to_dot().startswith('digraph "fancy_func"')
    nested = functools.partial(functools.partial(fancy_func, one), one)
    assert sm.stage(nested)(one, one).name == "fancy_func"


def test_arg_reductions_and_cumulative_ops_count_their_flops():
    """argmax and cumsum once counted 0 flops while flops_exact said the count was whole."""
    x = jnp.ones((4, 8))
    for fn in (
        lambda x: jnp.argmax(x, axis=1),
        lambda x: jnp.argmin(x, axis=0),
        lambda x: jnp.cumsum(x, axis=1),
        lambda x: jax.lax.cummax(x, axis=0),
    ):
        g = sm.stage(fn)(x)
        assert g.flops == 4 * 8 and g.flops_exact
        assert g.flops <= _xla_flops(fn, x)  # XLA's reducers and reduce-windows count more


class _Flagged(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(2)(x))


class _FlaggedNnx(nnx.Module):
    def __init__(self):
        self.dense, self.drop = (
            nnx.Linear(3, 2, rngs=nnx.Rngs(0)),
            nnx.Dropout(0.5, rngs=nnx.Rngs(1)),
        )

    def __call__(self, x, *, train: bool):
        return self.drop(self.dense(x), deterministic=not train)


@pytest.mark.parametrize(
    ("kind", "method"),
    [("linen", "graph"), ("linen", "lower"), ("linen", "compile"), ("nnx", "graph"),
     ("nnx", "training_mode")],
)  # fmt: skip
def test_a_hybrid_staged_without_its_flag_names_the_call_that_was_made(kind, method):
    # h.graph(x) without train= said "Pass them as the model takes them ...: h(x, train=train)",
    # advice for another call; lower, compile and (nnx) training_mode said the same
    x = jnp.ones((2, 3))
    if kind == "linen":
        h, name = (
            sm.hybridize(_Flagged(), _Flagged().init(jax.random.key(0), x, train=False)),
            "_Flagged",
        )
    else:
        h, name = sm.hybridize(_FlaggedNnx()), "_FlaggedNnx"
    with pytest.raises(
        sm.SignatureError,
        match=rf"^{name}\.{method}: the call's arguments do not fit the model's inputs "
        rf"\(x, \*, train\): missing a required argument: 'train'\. .*: h\.{method}\(x, "
        r"train=train\)\.$",
    ):
        getattr(h, method)(x)
    assert h.graph(x, train=False).primitive_counts["dot_general"] == 1 and h.trace_count == 0
