"""The command line: each subcommand runs, prints what it promises, exits with the right code."""

import subprocess
import sys

import pytest

from symjax_mlp.cli import main


def test_graph_summary(capsys):
    assert main(["graph", "--sizes", "8,4", "--in-features", "16"]) == 0
    out = capsys.readouterr().out
    assert "flops:" in out and "HybridSequential/layers_1: add=1, dot_general=1" in out


@pytest.mark.parametrize(
    ("fmt", "marker"),
    [
        ("jaxpr", "dot_general["),
        ("stablehlo", "stablehlo.dot_general"),
        ("hlo", "HloModule"),
        ("dot", "digraph"),
    ],
)
def test_graph_formats(capsys, fmt, marker):
    assert main(["graph", "--sizes", "4,2", "--in-features", "3", "--format", fmt]) == 0
    assert marker in capsys.readouterr().out


def test_bad_arguments_exit_2(capsys):
    assert main(["graph", "--sizes", "4,x"]) == 2
    assert "--sizes must be comma-separated ints" in capsys.readouterr().err
    assert main(["graph", "--activation", "nope"]) == 2
    assert "unknown activation 'nope'" in capsys.readouterr().err
    assert main([]) == 2


def test_tour_walks_the_chapter(capsys):
    assert main(["tour", "--calls", "3"]) == 0
    out = capsys.readouterr().out
    assert "fancy_func(1, 2, 3, 4) = 10" in out
    assert "constant(10)" in out
    assert "Tracer(float32[1,3])" in out
    assert "Without hybridization:" in out and "With hybridization:" in out
    assert "compiled raises ControlFlowError" in out


def test_python_dash_m_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "symjax_mlp", "graph", "--sizes", "2", "--in-features", "2"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "dot_general=1" in done.stdout
