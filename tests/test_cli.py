"""The command line: each subcommand runs, prints what it promises, exits with the right code."""

import contextlib
import os
import re
import signal
import subprocess
import sys
import textwrap

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
    assert "--sizes: must be comma-separated ints" in capsys.readouterr().err
    assert main(["graph", "--activation", "nope"]) == 2
    assert "unknown activation 'nope'" in capsys.readouterr().err
    assert main([]) == 2


def test_a_typo_names_its_subcommand_and_the_closest_name(capsys):
    """A mistyped option said 'symjax-mlp: error: unrecognized arguments: --sizs 3 (see
    symjax-mlp --help)': the root's help, which lists no option of export. The subcommand's
    error now names the closest option, and a mistyped subcommand or choice the closest one."""
    assert main(["export", "e", "--sizs", "3", "--seed=1"]) == 2
    assert capsys.readouterr().err == (
        "symjax-mlp export: error: unrecognized arguments: --sizs 3; did you mean --sizes? "
        "(see symjax-mlp export --help)\n"
    )
    assert main(["exprot", "e"]) == 2
    err = capsys.readouterr().err
    assert "(choose from 'tour', " in err
    assert err.endswith("; did you mean 'export'? (see symjax-mlp --help)\n")
    assert main(["run", "m", "--inptu", "x.npy", "--output", "y.npy"]) == 2
    err = capsys.readouterr().err  # argparse's message: --input is missing
    assert "required: --input; --inptu is no option: did you mean --input? (see" in err
    assert main(["graph", "--format", "jaxp"]) == 2
    assert "; did you mean 'jaxpr'? (see symjax-mlp graph --help)" in capsys.readouterr().err


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


# -- a newcomer's first hour: user errors are one line, bugs a traceback ------------------------
def _one_error(err):
    """Whether ``err`` is one error line, and at most the line that names the options its
    library keywords are (``batch= is --batch``)."""
    lines = err.strip().splitlines()
    return len(lines) == 1 or (len(lines) == 2 and ": on the command line, " in lines[1])


def _run_cli(*argv, timeout=120, **kw):
    return subprocess.run(
        [sys.executable, "-m", "symjax_mlp", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def test_version_and_help_show_defaults(capsys):
    from importlib.metadata import version

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"symjax-mlp {version('symjax_mlp')}"
    assert main(["graph", "--help"]) == 0
    out = capsys.readouterr().out
    assert "(default: 512)" in out and "(default: summary)" in out
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "``" not in out  # plain text, not reStructuredText
    # it said "1 a bug (with the traceback)", but verify exits 1 for a failed check, train 75
    codes = " ".join(out.split("Exit codes:")[1].split("positional arguments")[0].split())
    assert "1 verify found a difference, or a bug" in codes and "75 train lost" in codes


COMMANDS = ("tour", "graph", "export", "inspect", "run", "verify", "bench", "train", "serve")


@pytest.mark.parametrize("command", COMMANDS)
def test_each_options_help_says_its_default_once(capsys, command):
    """argparse added "(default: None)" after a help that said the default: "the most
    connections at once (503 past it; default: 1000) (default: None)", and to required options."""
    assert main([command, "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # one line: the help's wrapping undone
    assert not re.search(r"\(default: (None|False|\()", out)  # Python's words, not typed ones
    options = re.split(r" (?=--?[a-z][a-z-]* )", out.split(" options: ", 1)[1])
    assert len(options) > 1, out
    for option in options:
        assert option.count("default:") <= 1, option
        if option.startswith(("--input ", "--output ")):  # run's required options
            assert "default:" not in option, option


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["graph", "--in-features", "0"], "--in-features: must be an int >= 1; got '0'"),
        (["graph", "--batch", "-3"], "--batch: must be an int >= 1; got '-3'"),
        (["export", "x", "--in-features", "0"], "--in-features: must be an int >= 1"),
        (["export", "x", "--batch", "-3"], "--batch: must be a name for a symbolic batch"),
        (["verify", "x", "--batches", "0"], "--batches: must be comma-separated ints >= 1"),
        (["train", "--epochs", "-1"], "--epochs: must be an int >= 0"),
    ],
)
def test_bad_values_are_one_line_exit_2(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) <= 2


def test_run_input_dir_is_refused(tmp_path, capsys):
    assert main(["run", str(tmp_path), "--input", str(tmp_path), "--output", "y.npy"]) == 2
    assert "is a directory; pass a .npy file" in capsys.readouterr().err


def test_a_missing_extra_names_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    assert main(["train", "--epochs", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'symjax_mlp[data]'" in err and "Traceback" not in err


def test_serve_ray_without_ray_names_the_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.setitem(sys.modules, "ray.serve", None)
    assert main(["serve", str(tmp_path), "--ray", "--dispatch", "async"]) == 2
    err = capsys.readouterr().err
    assert "pip install 'symjax_mlp[ray]'" in err and "Traceback" not in err


def test_a_bug_exits_1_with_the_traceback(monkeypatch, capsys):
    import symjax_mlp.chapter

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(symjax_mlp.chapter, "describe_mlp", broken)
    assert main(["graph"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "RuntimeError: boom" in err and "this is a bug" in err


def test_a_model_too_large_for_memory_exits_2_saying_so_not_as_a_bug(capsys):
    """train --sizes 10000000000000,10 (a typo's extra zeros): XLA's RESOURCE_EXHAUSTED (and
    NumPy's MemoryError) went out as 'this is a bug in symjax_mlp', exit 1, a traceback."""
    assert main(["train", "--sizes", "10000000000000,10", "--epochs", "1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "this is a bug" not in err, err
    assert err.startswith("symjax-mlp train: error: out of memory (RESOURCE_EXHAUSTED: "), err
    assert "use smaller layers (--sizes), batches or inputs" in err, err


_SERVE_ENDLESS = """
import os, sys
from symjax_mlp.cli import main
argv = ["serve", sys.argv[1], "--port", "0", "--allow", "while", "--allow", "dynamic_slice",
        "--warm-up-timeout", "1"]
os._exit(main(argv))  # the batcher's thread still runs the loop on zeros
"""


def test_a_warm_up_that_timed_out_exits_2_naming_the_option(monkeypatch, capsys):
    """The Batcher's warm-up TimeoutError (its own message), in process: exit 2, its message
    and the option that sets warm_up_timeout=, no traceback (the run with a real endless
    model, in a fresh process, is the test below, under -m slow)."""
    from types import SimpleNamespace

    import symjax_mlp as sm
    from symjax_mlp.serving import _lane

    stuck = _lane._STUCK.format(
        self=SimpleNamespace(name="Batcher(doubling)", warming=1), timeout=1
    )

    def serve(path, **settings):
        raise TimeoutError(stuck)

    monkeypatch.setattr(sm.serving, "serve", serve)
    assert main(["serve", "m", "--dispatch", "async", "--warm-up-timeout", "1"]) == 2
    err = capsys.readouterr().err
    says = "symjax-mlp serve: error: Batcher(doubling): warming up, the model did not return"
    assert err.startswith(says + " within 1 s") and "Traceback" not in err, err
    named = "symjax-mlp serve: on the command line, warm_up_timeout= is --warm-up-timeout SECONDS"
    assert named in err and "this is a bug" not in err, err


def test_serve_in_latency_mode_where_jax_ran_already_is_one_line(tmp_path, capsys):
    """serve's default --dispatch sync, by main() in a process where JAX had run, printed
    latency_mode's RuntimeError as a traceback, 'this is a bug in symjax_mlp' (bench's was one
    line already: the two share it now)."""
    import jax.numpy as jnp

    jnp.ones(1)  # JAX's backend starts here, with its default (async) dispatch
    assert main(["serve", str(tmp_path / "m"), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("symjax-mlp serve: error: --dispatch sync: latency_mode(): JAX's")
    assert "in a fresh process" in err and "Traceback" not in err and "bug" not in err


# a fresh process whose batcher thread spins for ever (~3-5 s): CI runs it with `-m slow`; the
# default run keeps the in-process test above and test_serving_hostile's endless warm-up
@pytest.mark.slow
def test_serve_of_a_model_whose_warm_up_never_ends_exits_2_saying_why(tmp_path):
    """An artifact whose loop never ends on zero rows, served with --allow while: the warm-up's
    TimeoutError went out as 'this is a bug in symjax_mlp', exit 1, with a traceback. Its
    message named warm_up_timeout, which neither serve() nor the CLI could set."""
    import jax
    import jax.numpy as jnp

    import symjax_mlp as sm

    pytest.importorskip("uvicorn")

    def doubling(p, x):  # doubles x until its first entry passes p: for ever on zeros
        return jax.lax.while_loop(lambda y: jnp.abs(y[0, 0]) < p, lambda y: y * 2, x)

    sm.export(sm.hybridize(doubling, jnp.float32(10)), tmp_path / "m", example=jnp.ones((1, 2)))
    done = subprocess.run([sys.executable, "-c", _SERVE_ENDLESS, str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "this is a bug" not in done.stderr, done.stderr
    says = "symjax-mlp serve: error: Batcher(doubling): warming up, the model did not return"
    assert done.stderr.startswith(says + " within 1 s"), done.stderr
    named = "symjax-mlp serve: on the command line, warm_up_timeout= is --warm-up-timeout SECONDS"
    assert named in done.stderr, done.stderr


def test_broken_pipe_is_quiet(monkeypatch, capsys):
    """``symjax-mlp graph | head -1``: head closed the pipe; the CLI stops quietly, exit 0, and
    the interpreter's last flush of stdout at exit finds nothing to complain about. (In
    process, on a pipe whose reader is gone: every write breaks, not only one that loses the
    race with head.)"""
    read, write = os.pipe()
    os.close(read)
    stdout = open(write, "w", buffering=1)  # noqa: SIM115 (closed below, as at exit)
    monkeypatch.setattr(sys, "stdout", stdout)
    assert main(["graph", "--sizes", "4,2", "--in-features", "3", "--format", "jaxpr"]) == 0
    stdout.close()  # what the interpreter does at exit: quiet, no BrokenPipeError
    assert capsys.readouterr().err == ""


@contextlib.contextmanager
def _ctrl_c_handled():
    """SIGINT handled (Python's handler) in the block, so a child started there starts with it
    at its default, as from a terminal: a pytest started with SIGINT ignored (``nohup``, a CI's
    background job) passed SIG_IGN on, and the child never saw the SIGINT these tests send."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def test_ctrl_c_exits_130_in_one_line():
    import time

    with _ctrl_c_handled():
        proc = subprocess.Popen(
            [sys.executable, "-u", "-m", "symjax_mlp", "tour", "--calls", "100000000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    proc.stdout.readline()  # the tour's first line: past the imports, inside the tour
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert_interrupted(proc, timeout=60)


_SWALLOWED = """
import gc, sys, threading
from symjax_mlp import cli
def once(phase, info):  # one Ctrl-C, landing in a collector callback (JAX's _xla_gc_callback)
    gc.callbacks.remove(once)
    raise KeyboardInterrupt
class Started:  # the tour's first write: past the imports, inside the command
    def __init__(self, stream):
        self.stream, self.event = stream, threading.Event()
    def write(self, s):
        self.event.set()
        return self.stream.write(s)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stdout = started = Started(sys.stdout)
def collect():
    started.event.wait()
    gc.callbacks.append(once)
    gc.collect()
threading.Thread(target=collect, daemon=True).start()
sys.argv = ["symjax-mlp", "tour", "--calls", "100000000"]
cli.run()
"""


def test_a_ctrl_c_python_can_only_print_still_stops_the_command():
    """CI saw `symjax-mlp tour` run on for a minute after its SIGINT: the KeyboardInterrupt
    landed in JAX's garbage-collector callback, where Python prints an exception and drops
    it ("Exception ignored in: <function _xla_gc_callback>"). It is raised again."""
    with _ctrl_c_handled():
        proc = subprocess.run(
            [sys.executable, "-c", _SWALLOWED], capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 130, proc.stderr[-2000:]
    assert proc.stderr.strip().endswith("symjax-mlp tour: interrupted"), proc.stderr[-2000:]


def test_a_ctrl_c_in_a_collector_callback_on_the_main_thread_is_raised_again():
    """A real Ctrl-C is raised on the main thread only, so the collector callback it lands in
    (JAX's _xla_gc_callback) runs there: raising it again from the hook there raised it inside
    the hook, where Python printed "Exception ignored in sys.unraisablehook" and the command ran
    on (`symjax-mlp export` finished and exited 0). It comes after the hook returns."""
    import functools
    import gc
    import time

    from symjax_mlp import cli

    def once(phase, info):
        gc.callbacks.remove(once)
        raise KeyboardInterrupt

    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(cli._interrupt_again, hook)
    try:  # Ctrl-C handled, as a terminal's CLI has it (ignored: interrupt_main does nothing)
        with _ctrl_c_handled(), pytest.raises(KeyboardInterrupt):
            gc.callbacks.append(once)
            gc.collect()
            for _ in range(1000):  # the command going on: the interrupt lands here
                time.sleep(0.001)
    finally:
        sys.unraisablehook = hook
        if once in gc.callbacks:
            gc.callbacks.remove(once)


def test_ctrl_c_leaves_at_once_while_other_threads_still_work():

    # XLA compiles on its own threads; an interrupt mid-compile used to crash (a segfault)
    # or hang the interpreter's teardown. Here a thread that is still working stands in for
    # them: a normal exit would wait for it, `symjax-mlp` leaves at once.
    code = textwrap.dedent(
        """
        import sys, threading, time
        from symjax_mlp import cli
        threading.Thread(target=time.sleep, args=(300,)).start()  # not a daemon
        sys.argv = ["symjax-mlp", "tour", "--calls", "100000000"]
        cli.run()
        """
    )
    with _ctrl_c_handled():
        proc = subprocess.Popen(
            [sys.executable, "-u", "-c", code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    proc.stdout.readline()  # the tour's first line: inside the command, the thread working
    proc.send_signal(signal.SIGINT)
    assert_interrupted(proc, timeout=90)


def assert_interrupted(proc, timeout):
    """``proc`` (an interrupted ``symjax-mlp tour``) exits 130 with one line, in time."""
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:  # a hung process must not outlive the test
        proc.kill()
        proc.communicate()
    assert proc.returncode == 130, err
    assert err.strip() == "symjax-mlp tour: interrupted"


def test_run_writes_exactly_the_output_path_stdout_and_npz(tmp_path, capsys):
    import numpy as np

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    np.save(tmp_path / "x.npy", np.ones((4, 2), np.float32))
    x = str(tmp_path / "x.npy")
    capsys.readouterr()
    out = tmp_path / "y.out"
    assert main(["run", str(art), "--input", x, "--output", str(out)]) == 0
    assert out.exists() and not (tmp_path / "y.out.npy").exists()
    assert f"wrote {out}: float32[4, 3]" in capsys.readouterr().out
    y = np.load(out)
    npz = tmp_path / "y.npz"
    assert main(["run", str(art), "--input", x, "--output", str(npz)]) == 0
    np.testing.assert_array_equal(np.load(npz)["out0"], y)
    done = subprocess.run(
        [sys.executable, "-m", "symjax_mlp", "run", str(art), "--input", x, "--output", "-"],
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0 and b"wrote stdout: float32[4, 3]" in done.stderr
    import io

    np.testing.assert_array_equal(np.load(io.BytesIO(done.stdout)), y)


def test_run_reads_an_input_from_stdin_and_counts_the_inputs(tmp_path, capsys, monkeypatch):
    """--output - wrote .npy bytes to stdout, but --input - said '-: does not exist; pass a
    .npy file': a pipe could not feed run. Now '-' reads one .npy array from stdin. And two
    --input files for a model of one input said 'Call it as m(args[0])', Python the command
    line has no use for: the --input files are counted against the inputs."""
    import io

    import numpy as np

    art, y = tmp_path / "m", tmp_path / "y.npy"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    for x, code in ((np.ones((4, 2), np.float32), 0), (np.ones((4, 2)), 2)):
        np.save(data := io.BytesIO(), x)
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data.getvalue())))
        assert main(["run", str(art), "--input", "-", "--output", str(y)]) == code
    assert np.load(y).shape == (4, 3)
    err = capsys.readouterr().err
    assert err.startswith("symjax-mlp run: error: stdin (args[0]) holds float64[4, 2] but")
    assert "np.save(file, x.astype(np.float32))" in err  # not np.save("stdin", ...)
    assert main(["run", str(art), "--input", "-", "--input", "-", "--output", str(y)]) == 2
    assert "--input -: given 2 times; stdin holds one array" in capsys.readouterr().err
    np.save(x := tmp_path / "x.npy", np.ones((4, 2), np.float32))
    assert main(["run", str(art), "--input", str(x), "--input", str(x), "--output", "-"]) == 2
    assert capsys.readouterr().err == (
        "symjax-mlp run: error: 2 --input files, but the artifact takes 1 input, args[0]: "
        "float32[b, 2]. Pass one --input per input, in order.\n"
    )


def test_run_to_a_stdout_without_a_byte_buffer(tmp_path, capsys, monkeypatch):
    """main() called in-process with sys.stdout a text stream (io.StringIO, a notebook's): --output
    - crashed with an AttributeError traceback ('no attribute buffer'). Now a text stream is
    refused in one line before the load, and a binary one (io.BytesIO) takes the .npy bytes."""
    import io

    import numpy as np

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    np.save(tmp_path / "x.npy", np.ones((4, 2), np.float32))
    run = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", "-"]
    capsys.readouterr()
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert main(run) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "--output -: stdout is a text stream (StringIO)" in err and "pass a file path" in err
    monkeypatch.setattr(sys, "stdout", io.BytesIO())
    assert main(run) == 0 and "wrote stdout: float32[4, 3]" in capsys.readouterr().err
    assert np.load(io.BytesIO(sys.stdout.getvalue())).shape == (4, 3)
    # a terminal got the .npy bytes, binary that garbles it (curl refuses the same)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    assert main(run) == 2
    assert "--output -: stdout is a terminal" in capsys.readouterr().err


def test_activation_none_is_the_linear_mlp_the_message_offers(tmp_path, capsys):
    """--activation None was refused as "unknown activation 'None'; expected None or one of:
    ...": the library's None, which the command line could not pass."""
    for name in ("None", "none"):
        argv = ["export", str(tmp_path / name), "--sizes", "3", "--in-features", "2"]
        assert main([*argv, "--activation", name]) == 0, capsys.readouterr().err
    assert main(["graph", "--sizes", "4,2", "--activation", "none"]) == 0
    assert "max" not in capsys.readouterr().out  # no relu: max(x, 0)


def test_json_convention_and_train_refuses_paths_before_training(tmp_path, capsys):
    import json

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(art), "--json"]) == 0  # no PATH: stdout
    assert json.loads(capsys.readouterr().out)["format"] == "symjax_mlp.artifact"
    assert main(["inspect", str(art), "--json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["format"] == "symjax_mlp.artifact"
    # an existing export target or a --json directory: refused at once, before any epoch
    assert main(["train", "--export", str(art), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["train", "--json", str(tmp_path), "--quiet"]) == 2
    assert "is a directory" in capsys.readouterr().err
    # `inspect --json ART`: --json's optional PATH took the artifact, and argparse said only
    # that the path is missing; the hint names what --json took and the order that works
    for command in ("inspect", "verify"):
        assert main([command, "--json", str(art)]) == 2
        err = capsys.readouterr().err
        assert "required: path" in err
        assert f"--json took '{art}' as the file to write to" in err
        assert f"Name the artifact first: symjax-mlp {command} ARTIFACT --json" in err


def test_train_refuses_an_export_that_is_or_holds_its_checkpoint_or_json(tmp_path, capsys):
    """--export DIR with --checkpoint DIR (or DIR/ck, or --json DIR) trained every epoch and
    only then had the export refused ('a non-empty directory without manifest.json'): the
    run's model never exported. Now refused before the first epoch, nothing written."""
    cases = [
        (["--checkpoint", "{t}/same", "--export", "{t}/same"], "is the --checkpoint"),
        (["--checkpoint", "{t}/a/ck", "--export", "{t}/a"], "would hold the --checkpoint"),
        (["--json", "{t}/j", "--export", "{t}/j"], "is the --json"),
    ]
    for extra, says in cases:
        argv = ["train", "--epochs", "1", "--sizes", "8,10", "--quiet", "--overwrite", *extra]
        assert main([a.format(t=tmp_path) for a in argv]) == 2
        err = capsys.readouterr().err
        assert f"--export {tmp_path}/" in err and says in err and "Pass --export another" in err
        assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux's sysfs")
def test_train_refuses_an_export_it_cannot_write_before_the_first_epoch(capsys):
    """--export in a read-only directory trained every epoch, then failed: 'cannot write the
    artifact ex: [Errno 30] Read-only file system: '.ex.new-12358-e7ab36f2''. Refused first
    (sysfs takes no new directory, root's neither)."""
    assert main(["train", "--epochs", "1", "--sizes", "8,10", "--export", "/sys/ex"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("symjax-mlp train: error: --export /sys/ex: cannot write in ")
    assert "pass another path" in captured.err and "epoch" not in captured.err + captured.out


def test_train_refuses_a_json_that_is_its_checkpoint_directory(tmp_path, capsys):
    """--checkpoint DIR --json DIR trained every epoch, wrote the checkpoints into DIR, and
    only then failed to write the JSON there ('cannot write DIR (Is a directory). Free space
    there'): refused before the first epoch, nothing written."""
    same = str(tmp_path / "out")
    argv = ["train", "--epochs", "1", "--sizes", "8,10", "--quiet", "--checkpoint", same]
    assert main([*argv, "--json", same]) == 2
    err = capsys.readouterr().err
    assert f"--json {same}: is the --checkpoint {same}; the JSON is a file of its own" in err
    assert "Pass --json another path." in err and list(tmp_path.iterdir()) == []


@pytest.mark.slow  # (the README suite: within 10 minutes on 2 cores)
def test_verify_json_tolerances_and_exit_1_on_a_failed_check(tmp_path, capsys):
    import json

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "16,3", "--in-features", "8"]) == 0
    capsys.readouterr()
    # IREE and XLA round differently: with no tolerance at all, the check fails: exit 1; the
    # JSON lists each check (an OK report's: test_verify_a_bfloat16_artifact_passes)
    argv = ["verify", str(art), "--runtime", "iree", "--batches", "1,128", "--rtol", "0"]
    assert main([*argv, "--atol", "0", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    checks = {(c["runtime"], c["batch"]): c["ok"] for c in report["checks"]}
    assert not report["ok"] and list(checks) == [("iree", 1), ("iree", 128)], report
    assert not checks["iree", 128] and report["errors"] == []


# -- bfloat16 through .npy: NumPy stores it as |V2; run and verify give it its dtype back -------
def _bfloat16_artifact(tmp_path):
    """(path, x): an MLP with bfloat16 params, exported on a bfloat16 (2, 8) input -> (b, 8)."""
    import jax
    import jax.numpy as jnp

    import symjax_mlp as sm

    net = sm.mlp((16, 8))
    x = jax.random.normal(jax.random.key(1), (2, 8)).astype(jnp.bfloat16)
    variables = jax.tree.map(lambda a: a.astype(jnp.bfloat16), net.init(jax.random.key(0), x))
    h = sm.hybridize(net, variables)
    return sm.export(h, tmp_path / "m", example=x).path, h, x


def test_run_reads_and_writes_bfloat16_as_V2_npy(tmp_path, capsys):
    import ml_dtypes
    import numpy as np

    import symjax_mlp as sm

    art, _, x = _bfloat16_artifact(tmp_path)
    np.save(tmp_path / "x.npy", np.asarray(x))
    assert np.load(tmp_path / "x.npy").dtype == np.dtype("V2")  # what NumPy makes of bfloat16
    want = np.asarray(sm.load(art)(x))
    y = tmp_path / "y.npy"
    assert main(["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(y)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {y}: bfloat16[2, 8]" in out
    assert "np.load(...).view(ml_dtypes.bfloat16)" in out
    got = np.load(y)
    assert got.dtype == np.dtype("V2")
    np.testing.assert_array_equal(got.view(ml_dtypes.bfloat16), want)  # bit for bit
    # the output file is an input file: run it again, and into a .npz
    npz = tmp_path / "z.npz"
    assert main(["run", str(art), "--input", str(y), "--output", str(npz)]) == 0
    again = np.load(npz)["out0"].view(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(again, np.asarray(sm.load(art)(want)))


def test_run_refuses_a_float32_file_for_a_bfloat16_input(tmp_path, capsys):
    import numpy as np

    art, _, x = _bfloat16_artifact(tmp_path)
    np.save(tmp_path / "x.npy", np.asarray(x, np.float32))
    y = tmp_path / "y.npy"
    argv = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(y)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"{tmp_path / 'x.npy'} (args[0]) holds float32[2, 8]" in err
    assert "expects bfloat16[b, 8]; nothing is cast" in err
    assert "x.astype(jnp.bfloat16)" in err
    assert "np.bfloat16" not in err.replace("jnp.bfloat16", "")  # no cast that does not exist
    assert not y.exists()


def test_run_refuses_what_is_not_one_npy_array_and_reads_big_endian(tmp_path, capsys):
    """An .npz input, a text file, or two outputs for one .npy: one line, exit 2, nothing
    written; a big-endian file is read as the same numbers."""
    import numpy as np

    import symjax_mlp as sm

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    x = np.ones((4, 2), np.float32)
    np.savez(tmp_path / "x.npz", x=x)
    (tmp_path / "x.txt").write_text("1 2\n3 4\n")
    np.save(tmp_path / "big.npy", x.astype(">f4"))
    y = tmp_path / "y.npy"
    capsys.readouterr()
    for bad, says in (("x.npz", "is an .npz archive"), ("x.txt", "is not a readable .npy")):
        argv = ["run", str(art), "--input", str(tmp_path / bad), "--output", str(y)]
        assert main(argv) == 2, bad
        err = capsys.readouterr().err
        assert f"{tmp_path / bad} {says}" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1 and not y.exists()
    argv = ["run", str(art), "--input", str(tmp_path / "big.npy"), "--output", str(y)]
    assert main(argv) == 0
    np.testing.assert_array_equal(np.load(y), np.asarray(sm.load(art)(x)))


def test_run_refuses_several_outputs_for_one_npy(tmp_path, capsys):
    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm

    x = jnp.ones((2, 4), jnp.float32)
    h = sm.hybridize(lambda p, x: (x * p, x + p), jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=x).path
    np.save(tmp_path / "x.npy", np.asarray(x))
    run = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output"]
    assert main([*run, str(tmp_path / "y.npy")]) == 2
    err = capsys.readouterr().err
    assert f"the model returns 2 arrays, but {tmp_path / 'y.npy'} is one .npy array" in err
    assert "Pass one --output per output, in order, or one .npz path" in err  # was: .npz alone
    assert not (tmp_path / "y.npy").exists() and "Traceback" not in err
    assert main([*run, str(tmp_path / "y.npz")]) == 0
    with np.load(tmp_path / "y.npz") as got:  # closed: a later test's gc warned of it, failing
        np.testing.assert_array_equal(got["out1"], np.full((2, 4), 3.0))


def test_run_writes_every_output_path_or_none(tmp_path, capsys, monkeypatch):
    """Two --output paths, and the second write fails (a full disk): the first path keeps
    what it held, where it was replaced before the second failed; then both are written."""
    import errno
    import os
    import pathlib

    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm
    import symjax_mlp._files

    x = jnp.ones((2, 4), jnp.float32)
    h = sm.hybridize(lambda p, x: (x * p, x + p), jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=x).path
    np.save(tmp_path / "x.npy", np.asarray(x))
    y0, y1 = tmp_path / "y0.npy", tmp_path / "y1.npy"
    for y in (y0, y1):
        y.write_bytes(b"what was there")
    write_file, calls = symjax_mlp._files.write_file, []

    def second_fails(file, data):
        calls.extend([file] if tmp_path in pathlib.Path(file).parents else [])  # no cache's
        if len(calls) == 2 and calls[-1] is file:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        write_file(file, data)

    monkeypatch.setattr(symjax_mlp._files, "write_file", second_fails)
    run = ["run", str(art), "--input", str(tmp_path / "x.npy")]
    assert main([*run, "--output", str(y0), "--output", str(y1)]) == 2
    err = capsys.readouterr().err
    assert f"cannot write {y1} (No space left on device)" in err and "Traceback" not in err
    assert y0.read_bytes() == y1.read_bytes() == b"what was there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "x.npy", "y0.npy", "y1.npy"]
    monkeypatch.undo()
    assert main([*run, "--output", str(y0), "--output", str(y1)]) == 0
    np.testing.assert_array_equal(np.load(y0), np.full((2, 4), 2.0))
    np.testing.assert_array_equal(np.load(y1), np.full((2, 4), 3.0))


def test_run_refuses_two_outputs_that_are_one_file_spelt_two_ways(tmp_path, capsys):
    """--output y.npy --output ./y.npy (or a link to it) passed the 'given twice' check: both
    outputs were written, the second over the first, one output lost without a word."""
    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm

    x = jnp.ones((2, 4), jnp.float32)
    h = sm.hybridize(lambda p, x: (x * p, x + p), jnp.float32(2))
    art = sm.export(h, tmp_path / "m", example=x).path
    np.save(tmp_path / "x.npy", np.asarray(x))
    y, link = tmp_path / "y.npy", tmp_path / "link.npy"
    link.symlink_to(y)
    run = ["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", str(y), "--output"]
    for other in (f"{tmp_path}/./y.npy", str(link)):
        assert main([*run, other]) == 2
        err = capsys.readouterr().err
        assert f"--output {y}: given 2 times (as {y}, {other}); each output is written" in err
        assert not y.exists() and "Traceback" not in err


def test_library_messages_are_printed_as_written_and_the_option_added(tmp_path, capsys):
    """The library names its keyword (overwrite=True); the CLI prints that message unedited
    and adds a line with the option that sets it here (--overwrite)."""
    import symjax_mlp as sm

    art = tmp_path / "m"
    argv = ["export", str(art), "--sizes", "3", "--in-features", "2"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    with pytest.raises(sm.ArtifactError) as e:
        sm.chapter.export_mlp(art, sizes=(3,), in_features=2)
    assert err == [
        f"symjax-mlp export: error: {e.value}",
        "symjax-mlp export: on the command line, overwrite=True is --overwrite",
    ]
    assert main([*argv, "--overwrite"]) == 0


def test_verify_a_bfloat16_artifact_passes(tmp_path, capsys):
    import json

    import symjax_mlp as sm

    art, h, _ = _bfloat16_artifact(tmp_path)
    capsys.readouterr()
    assert main(["verify", str(art), "--batches", "1,3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and [c["batch"] for c in report["checks"]] == [1, 3]
    report = sm.verify(art, reference=h, batches=(2,))
    assert report.ok, str(report)


def test_run_an_entry_point_by_name(tmp_path, capsys):
    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm

    x = jnp.ones((2, 4), jnp.float32)
    double = sm.hybridize(lambda p, x: x * p, jnp.float32(2))
    plus = sm.hybridize(lambda p, x: x + p, jnp.float32(2))
    art = sm.export({"double": double, "plus": plus}, tmp_path / "m", example=x)
    np.save(tmp_path / "x.npy", np.asarray(x))
    run = ["run", str(art.path), "--input", str(tmp_path / "x.npy"), "--output"]
    assert main([*run, str(tmp_path / "y.npy"), "--entry", "plus"]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "y.npy"), np.full((2, 4), 3.0))
    assert main([*run, str(tmp_path / "z.npy")]) == 0  # the default: the first
    np.testing.assert_array_equal(np.load(tmp_path / "z.npy"), np.full((2, 4), 2.0))
    capsys.readouterr()
    assert main([*run, str(tmp_path / "w.npy"), "--entry", "nope"]) == 2
    err = capsys.readouterr().err
    assert "no entry point 'nope'; it has double, plus" in err and "Traceback" not in err
    assert "entries    double (default)" in str(sm.inspect(art.path))


def test_an_embedding_artifact_runs_from_the_cli_with_allow(tmp_path, capsys, monkeypatch):
    """nn.Embed lowers to stablehlo.gather, which load() refuses by default: the refusal says
    how to allow it on the command line, and run, verify and serve take --allow/--trust."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm

    class Embed(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(2)(nn.Embed(50, 8)(ids).mean(axis=1))

    ids = jnp.array([[1, 2, 3], [4, 5, 49]], jnp.int32)
    net = Embed()
    h = sm.hybridize(net, net.init(jax.random.key(0), ids))
    art = sm.export(h, tmp_path / "embed", example=ids)
    np.save(tmp_path / "ids.npy", np.asarray(ids))
    run = ["run", str(art.path), "--input", str(tmp_path / "ids.npy"), "--output"]
    assert main([*run, str(tmp_path / "y.npy")]) == 2
    err = capsys.readouterr().err
    assert "the op stablehlo.gather" in err and "pass allow={'gather'}" in err
    assert err.strip().splitlines()[-1] == (  # the library's keywords, then the CLI's options
        "symjax-mlp run: on the command line, allow= is --allow OP (once per op), trust=True is "
        "--trust, verify_signature= is --key PEM"
    )
    assert "Traceback" not in err
    for opts in (["--allow", "gather"], ["--trust"]):
        assert main([*run, str(tmp_path / "y.npy"), *opts]) == 0
        np.testing.assert_allclose(np.load(tmp_path / "y.npy"), h(ids), rtol=1e-6)
    assert main(["verify", str(art.path), "--allow", "gather"]) == 0
    assert "OK" in capsys.readouterr().out
    seen = {}
    monkeypatch.setattr(sm.serving, "serve", lambda path, **kw: seen.update(kw))
    assert main(["serve", str(art.path), "--dispatch", "async", "--allow", "gather"]) == 0
    assert seen["allow"] == ["gather"] and seen["trust"] is False
    assert seen["verify_signature"] is None


def test_json_paths_are_refused_before_any_work(tmp_path, capsys, monkeypatch):
    """`--json` to a missing directory, a directory, or a place no file can be made (/proc):
    one line and exit 2 before the work, where bench once ran the whole benchmark and then
    printed a traceback."""
    import symjax_mlp as sm

    monkeypatch.setattr(sm, "timeit", lambda *a, **kw: pytest.fail("the benchmark ran"))
    art = sm.chapter.export_mlp(tmp_path / "mlp").path
    for bad, says in (
        (tmp_path / "nope" / "x.json", f"does not exist; make it first (mkdir -p {tmp_path}/nope)"),
        (tmp_path, "is a directory"),
        ("/proc/x.json", "cannot write in /proc"),
    ):
        for argv in (["inspect", str(art)], ["bench", str(art)], ["verify", str(art)]):
            assert main([*argv, "--json", str(bad)]) == 2, argv
            err = capsys.readouterr().err
            assert says in err and "Traceback" not in err, err


def test_serve_on_a_busy_port_or_a_foreign_host_is_one_line_before_the_load(tmp_path, capsys):
    """A port in use, a host that is not this machine's, an unknown log level: exit 2, one
    line, and before the artifact is loaded (here there is none), where serve once compiled
    the model and then printed bind()'s traceback."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for argv, says in (
            (["--port", port], "Address already in use"),
            (["--host", "nope.invalid"], "cannot listen on nope.invalid:8000"),
            (["--log-level", "nope"], "log_level must be one of critical, error"),
            (["--host", ""], "host='' names no address"),  # was every interface, in silence
        ):
            missing = str(tmp_path / "nope")
            assert main(["serve", missing, "--dispatch", "async", *argv]) == 2, argv
            err = capsys.readouterr().err
            assert says in err and "Traceback" not in err, err
            assert _one_error(err), err


def test_an_output_that_cannot_be_written_is_one_line_and_leaves_the_old_file(
    tmp_path, capsys, monkeypatch
):
    """A full disk while writing run's --output or a --json file: exit 2 in one line, and the
    path keeps what it held (no half-written file, no temporary sibling), where the write
    once truncated the file in place and escaped as an OSError traceback."""
    import errno
    import os

    import numpy as np

    import symjax_mlp._files

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    np.save(tmp_path / "x.npy", np.ones((4, 2), np.float32))
    capsys.readouterr()

    def full(file, data):  # half of it, then the disk is full
        with open(file, "wb") as f:
            f.write(data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(symjax_mlp._files, "write_file", full)
    x = str(tmp_path / "x.npy")
    for name, argv in (
        ("y.npy", ["run", str(art), "--input", x, "--output"]),
        ("y.npz", ["run", str(art), "--input", x, "--output"]),
        ("m.json", ["inspect", str(art), "--json"]),
    ):
        target = tmp_path / name
        target.write_bytes(b"what was there")
        assert main([*argv, str(target)]) == 2, name
        err = capsys.readouterr().err
        assert "No space left on device" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
        assert target.read_bytes() == b"what was there"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "m.json", "x.npy", "y.npy", "y.npz"]
    if os.path.exists("/dev/full"):  # a device is written as it is, and its refusal said
        monkeypatch.undo()
        assert main(["run", str(art), "--input", x, "--output", "/dev/full"]) == 2
        assert "cannot write /dev/full (No space left" in capsys.readouterr().err


def test_a_path_the_system_will_not_look_up_is_one_line(tmp_path, capsys):
    """A name longer than the filesystem allows (ENAMETOOLONG), as the artifact, an --input,
    an --output, a --json or an --export path: exit 2 in one line, where os.stat's OSError
    once escaped as a traceback; and an --input that is a device is not said not to exist."""
    import numpy as np

    long = str(tmp_path / ("a" * 300))
    x = tmp_path / "x.npy"
    np.save(x, np.ones((1, 2), np.float32))
    art = str(tmp_path / "m")
    assert main(["export", art, "--sizes", "3", "--in-features", "2"]) == 0
    capsys.readouterr()
    for argv in (
        ["inspect", long],
        ["verify", long],
        ["bench", long],
        ["export", long],
        ["run", long, "--input", str(x), "--output", str(tmp_path / "y.npy")],
        ["run", art, "--input", long, "--output", str(tmp_path / "y.npy")],
        ["run", art, "--input", str(x), "--output", long],
        ["inspect", art, "--json", long],
        ["train", "--export", long, "--quiet"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "File name too long" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert main(["run", art, "--input", "/dev/null", "--output", str(tmp_path / "y.npy")]) == 2
    assert "/dev/null: is not a regular file" in capsys.readouterr().err


def test_train_process_id_without_a_coordinator_is_refused(tmp_path, capsys):
    """--process-id 1 (or -1) alone once trained and exited 0 without writing --json or
    --export (only process 0 writes them): it needs --coordinator, as --num-processes does."""
    for pid in ("1", "-1"):
        argv = ["train", "--process-id", pid, "--json", str(tmp_path / "h.json"), "--quiet"]
        assert main([*argv, "--epochs", "1"]) == 2
        err = capsys.readouterr().err
        assert "--process-id needs --coordinator HOST:PORT" in err and "Traceback" not in err
    assert not (tmp_path / "h.json").exists()


def test_bench_at_a_batch_no_memory_holds_is_one_line(tmp_path, capsys, monkeypatch):
    """bench --batch past what memory (or an array) can hold: exit 2 in one line, where
    drawing the inputs escaped as NumPy's MemoryError (ValueError) traceback."""
    import symjax_mlp as sm

    art = str(sm.chapter.export_mlp(tmp_path / "mlp", sizes=(3,), in_features=512).path)
    for batch in ("99999999999", str(2**60)):  # 186 TiB (past the address space); 2 ZiB
        assert main(["bench", art, "--batch", batch, "--calls", "1", "--repeats", "1"]) == 2
        err = capsys.readouterr().err
        assert "more than this process can hold in memory; pass a smaller batch" in err, err
        assert "Traceback" not in err and _one_error(err), err


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["export", "{tmp}/a", "--seed", str(2**70)], "seed must be an int from -2**63"),
        (["train", "--seed", str(2**70), "--epochs", "1"], "seed must be an int from -2**63"),
        (["graph", "--sizes", str(10**20)], "more elements than any array can have"),
        (["export", "{tmp}/a", "--in-features", str(10**20)], "more elements than any array"),
        (["graph", "--batch", str(10**20)], "or a smaller batch"),
        (["export", "{tmp}/a", "--sizes", str(10**13)], "more than this process can hold"),
    ],
)
def test_numbers_no_array_or_key_holds_are_one_line(tmp_path, capsys, argv, says):
    """Widths, batches and seeds past int64 (or past memory): exit 2 in one line, where JAX's
    TypeError, OverflowError or RESOURCE_EXHAUSTED escaped as a traceback; nothing written."""
    assert main([a.format(tmp=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and _one_error(err), err
    assert list(tmp_path.iterdir()) == []


def test_a_model_past_this_machines_memory_is_refused_before_xla_allocates_it(
    tmp_path, capsys, monkeypatch
):
    """export --sizes 10**13 reached XLA, which raised RESOURCE_EXHAUSTED or, once in a
    loaded test worker, aborted the process: the sizes are now checked against the machine's
    memory first (here a machine of 1 MB, and an MLP of 6 MB)."""
    import symjax_mlp.chapter

    monkeypatch.setattr(symjax_mlp.chapter, "memory", lambda: 2**20)
    assert main(["export", str(tmp_path / "a"), "--sizes", "1024,1024"]) == 2
    err = capsys.readouterr().err
    params = (512 + 1) * 1024 + (1024 + 1) * 1024
    assert f"{params:,} parameters, more than this process can hold in memory" in err, err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    assert 2**30 < symjax_mlp.chapter.memory() < 2**62  # Linux says its memory


def test_train_names_the_seed_option_and_a_seed_that_fits(capsys):
    """train --seed 2**70 said 'seed must be an int from ...' and no fix, and, naming no
    seed=, the CLI could not say which option that is (export's --seed was named)."""
    assert main(["train", "--seed", str(2**70), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert "Pass e.g. seed=0." in err and "on the command line, seed= is --seed" in err, err


def test_verify_refuses_an_infinite_tolerance(tmp_path, capsys):
    """--rtol 1e999 (inf) passed every output, with NumPy's RuntimeWarning on stderr, and
    reported OK: now exit 2 in one line, before the artifact is read."""
    for option in ("--rtol", "--atol"):
        for value in ("1e999", "inf"):
            assert main(["verify", str(tmp_path / "none"), option, value]) == 2
            err = capsys.readouterr().err
            assert "pass a number >= 0, finite" in err and "Traceback" not in err, err


def test_verify_refuses_a_seed_timeout_allow_or_signature_of_the_wrong_kind(tmp_path):
    """sm.verify(seed='1') and seed=-1 were NumPy's TypeError and ValueError, timeout='10'
    and nan Python's, verify_signature=3 os.fspath's; allow='name' was read as its letters
    (load refused {'a', 'e', 'm', 'n'}: now one name, as load takes it, test_first_afternoon)
    and timeout=0 a FAILED report, after the export."""
    import symjax_mlp as sm

    art = str(tmp_path / "not read")  # each refused before the artifact is read
    cases = {
        "seed": ("1", -1, 1.0, True),
        "timeout": ("10", float("nan"), 0, -1, float("inf")),
        "allow": (b"name", 3),
        "verify_signature": (3, ["x.sig"]),
    }
    for option, values in cases.items():
        for value in values:
            with pytest.raises(sm.ConfigError, match=rf"^verify\({option}=.*\): pass "):
                sm.verify(art, **{option: value})


def test_run_says_a_text_or_empty_input_is_no_npy_file_not_a_pickle(tmp_path, capsys):
    """NumPy reads any bytes but a .npy or .npz as a pickle, and its refusal told a user with a
    text (or empty) --input to use allow_pickle=: now the file is said not to be a .npy."""
    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    (tmp_path / "x.txt").write_text("1 2\n3 4\n")
    (tmp_path / "empty.npy").write_bytes(b"")
    capsys.readouterr()
    for name, says in (
        ("x.txt", "(it does not begin with .npy's magic string \\x93NUMPY but b'1 2\\n3 ')"),
        ("empty.npy", "(it is empty)"),
    ):
        argv = ["run", str(art), "--input", str(tmp_path / name), "--output", "-"]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / name} is not a readable .npy array {says}" in err, err
        assert "allow_pickle" not in err and "pickled" not in err, err


def test_run_refuses_an_output_that_is_its_input_or_a_file_of_the_artifact(tmp_path, capsys):
    """--output x.npy with --input x.npy replaced the input with the output, and --output
    ART/manifest.json broke the artifact, both exit 0: refused now, before any work."""
    import numpy as np

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    x = tmp_path / "x.npy"
    np.save(x, np.ones((4, 2), np.float32))
    before, manifest = x.read_bytes(), (art / "manifest.json").read_bytes()
    capsys.readouterr()
    for out, says in (
        (str(x), f"is the --input {x}"),
        (f"{tmp_path}/../{tmp_path.name}/x.npy", f"is the --input {x}"),
        (str(art / "manifest.json"), f"is a file of the artifact {art}"),
    ):
        assert main(["run", str(art), "--input", str(x), "--output", out]) == 2, out
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert x.read_bytes() == before and (art / "manifest.json").read_bytes() == manifest
    assert main(["run", str(art), "--input", str(x), "--output", str(tmp_path / "y.npy")]) == 0
    assert (tmp_path / "y.npy").exists()


def test_no_output_goes_into_the_artifact_directory(tmp_path, capsys):
    """`run A --input x.npy --output A/y.npy` (and `inspect A --json A/r.json`) wrote a new file
    into the artifact, which verify_signature (covering the whole directory) then refused:
    refused before any work, naming the path, the artifact and the fix."""
    import numpy as np

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    x = tmp_path / "x.npy"
    np.save(x, np.ones((4, 2), np.float32))
    files = sorted(p.name for p in art.iterdir())
    capsys.readouterr()
    for argv, out in (
        (["run", str(art), "--input", str(x), "--output"], art / "y.npy"),
        (["run", str(art), "--input", str(x), "--output"], tmp_path / "m" / ".." / "m" / "y.npz"),
        (["inspect", str(art), "--json"], art / "report.json"),
    ):
        assert main([*argv, str(out)]) == 2, out
        err = capsys.readouterr().err
        assert f"{out}: is inside the artifact {art}" in err, err
        assert "Pass another path, outside the artifact." in err and "Traceback" not in err
        assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in art.iterdir()) == files


def test_an_empty_output_path_is_refused_not_taken_for_the_working_directory(capsys):
    """--output '' and --json '' were 'is a directory' (Path('') is '.'); train --json ''
    trained and wrote nothing. Each is now refused as empty, before any work."""
    for argv in (
        ["run", "nope", "--input", __file__, "--output", ""],
        ["inspect", "nope", "--json", ""],
        ["train", "--json", "", "--quiet"],
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "'': is empty; pass a file path" in err and "Traceback" not in err, err


def test_serve_ray_on_a_host_not_this_machines_is_one_line(capsys, tmp_path):
    """serve --ray --port 0 looks for a free port on --host: a host that does not resolve
    was socket.gaierror's traceback."""
    pytest.importorskip("ray")
    argv = ["serve", str(tmp_path), "--ray", "--port", "0", "--host", "nope.invalid"]
    assert main([*argv, "--dispatch", "async"]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on nope.invalid:0" in err and "Traceback" not in err, err


def test_train_checkpoint_empty_or_too_long_is_one_line(tmp_path, capsys, monkeypatch):
    """--checkpoint '' trained and wrote step_* into the working directory; a name too long
    was os.stat's traceback. Both are refused before the first epoch."""
    monkeypatch.chdir(tmp_path)
    for path, says in (("", "the checkpoint directory is ''"), ("a" * 300, "File name too long")):
        assert main(["train", "--checkpoint", path, "--epochs", "1", "--quiet"]) == 2
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_an_empty_export_path_is_refused(tmp_path, capsys, monkeypatch):
    """export '' said '. already exists' (Path('') is '.'); train --export '' trained and
    exported nothing, exit 0. Both are refused as empty, before any work."""
    monkeypatch.chdir(tmp_path)
    for argv, says in (
        (["export", ""], "export: the path is ''"),
        (["train", "--export", "", "--quiet"], "--export '': is empty"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_stdout_closed_by_the_shell_is_one_line(tmp_path):
    """`--output -` or `--json -` with stdout closed (>&-: sys.stdout is None) was an
    AttributeError traceback after the work; now exit 2 in one line."""
    import numpy as np

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    np.save(tmp_path / "x.npy", np.ones((1, 2), np.float32))
    for argv, says in (
        (["run", str(art), "--input", str(tmp_path / "x.npy"), "--output", "-"], "--output -"),
        (["inspect", str(art), "--json", "-"], "--json -"),
    ):
        done = subprocess.run(
            f"{sys.executable} -m symjax_mlp {' '.join(argv)} >&-",
            shell=True,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2, done.stderr
        assert (
            done.stderr.strip()
            == f"symjax-mlp {argv[0]}: error: {says}: stdout is closed; pass a file path"
        )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--replicas", "4"], "--replicas: only with --ray; add --ray, or drop it"),
        (["--replica-cpus", "0.5", "--ray-address", "auto"], "--replica-cpus, --ray-address: only"),
        (["--ray", "--max-connections", "9"], "--max-connections: not with --ray; drop it"),
        (["--ray", "--log-level", "info"], "--log-level: not with --ray"),
    ],
)
def test_serve_refuses_an_option_of_the_other_server(tmp_path, capsys, argv, says):
    """`serve --replicas 4` (no --ray) served one uvicorn process and said nothing of the
    replicas asked for; with --ray, uvicorn's options were dropped as quietly. Refused at
    once, in one line, before anything is loaded (here there is no artifact)."""
    assert main(["serve", str(tmp_path / "nope"), "--dispatch", "async", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_a_path_with_a_newline_or_an_escape_is_one_line_shown_escaped(tmp_path, capsys):
    """A path the user typed with a newline split the error over two lines (an escape acted on
    the terminal): the library's message and argparse's name it escaped, as repr() does."""
    odd = str(tmp_path / "bad\nname\x1b[31m")
    for argv in (["inspect", odd], ["run", str(tmp_path), "--input", odd, "--output", "y.npy"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and "bad\\nname\\x1b[31m" in err, err


def test_a_library_keyword_is_named_as_its_option_whole_word(tmp_path, capsys, monkeypatch):
    """The library names its keywords (verify's batches=, timeit's batch=, the batcher's
    max_batch=) and no CLI flag; the CLI adds the option of each, matched as a whole word:
    max_batch= is --max-batch, never batch='s --batch."""
    import symjax_mlp as sm

    art = str(sm.chapter.export_mlp(tmp_path / "m", sizes=(3,), in_features=2).path)
    static = str(sm.chapter.export_mlp(tmp_path / "s", sizes=(3,), in_features=2, batch=3).path)
    with pytest.raises(sm.ConfigError, match=r"pass smaller batches, e.g. batches=\(1, 7\)") as e:
        sm.verify(art, batches=(1, 10**9))
    assert "--batches" not in str(e.value)
    cases = [
        (["verify", art, "--batches", f"1,{10**9}"], "batches= is --batches"),
        (["bench", static, "--batch", "4", "--calls", "1", "--repeats", "1"], "batch= is --batch"),
        (
            ["serve", art, "--max-batch", str(10**9), "--dispatch", "async"],
            "max_batch= is --max-batch",
        ),
    ]
    for argv, said in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and "Traceback" not in err[0] and "--batch" not in err[0], err
        assert err[1] == f"symjax-mlp {argv[0]}: on the command line, {said}"

    def timeit(*args, **kwargs):
        raise sm.ConfigError("timeit(model, max_batch=3): a message naming max_batch=.")

    monkeypatch.setattr(sm, "timeit", timeit)
    assert main(["bench", art, "--calls", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "symjax-mlp bench: error: timeit(model, max_batch=3): a message naming max_batch=."
    ]


def test_verify_checks_a_runtime_or_batch_given_twice_once(tmp_path, capsys):
    """--runtime jax --runtime jax loaded the artifact twice in the fresh process, listed each
    check twice and reported the second, warm load as the fresh one; a batch given twice was
    counted twice against what verify may draw. Each is checked once now."""
    import json

    import symjax_mlp as sm

    art = str(sm.chapter.export_mlp(tmp_path / "m", sizes=(3,), in_features=2).path)
    argv = ["verify", art, "--runtime", "jax", "--runtime", "jax", "--batches", "1,2,1", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(c["runtime"], c["batch"]) for c in report["checks"]] == [("jax", 1), ("jax", 2)]
    with pytest.raises(sm.ConfigError, match=r"verify\(runtimes='jax'\): choose from .* a tuple"):
        sm.verify(art, runtimes="jax")


def test_verify_passes_an_artifact_whose_outputs_hold_the_references_nans(tmp_path, capsys):
    """log(x) of drawn normal inputs is NaN where x < 0, in the reference and the fresh
    process alike: every check FAILed, 'max |err| 0 ... output 0 differs beyond tolerance'."""
    import jax.numpy as jnp
    import numpy as np

    import symjax_mlp as sm

    h = sm.hybridize(lambda p, x: jnp.log(x) * p["w"], {"w": jnp.ones(4)})
    art = sm.export(h, tmp_path / "log", example=np.ones((1, 4), np.float32), batch="b").path
    assert main(["verify", str(art), "--batches", "16"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "ok   jax   batch    16  max |err|         0" in out, out


@pytest.mark.filterwarnings("default::FutureWarning")
def test_the_expiry_warning_is_one_line_on_the_command_line(tmp_path, capsys):
    """A CLI user saw the artifact-expiry FutureWarning in Python's raw format, its file:line
    and a line of library source under it; the CLI prints it as one line of its own. The
    library still warns as Python does, and the CLI puts showwarning back after the command."""
    import json
    import warnings

    import numpy as np

    import symjax_mlp as sm

    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3,2", "--in-features", "4"]) == 0
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["compatible_until"] = "2000-01-01"
    (art / "manifest.json").write_text(json.dumps(manifest))
    np.save(tmp_path / "x.npy", np.ones((2, 4), np.float32))
    capsys.readouterr()
    before = warnings.showwarning
    argv = [
        "run",
        str(art),
        "--input",
        str(tmp_path / "x.npy"),
        "--output",
        str(tmp_path / "y.npz"),
    ]
    assert main(argv) == 0 and warnings.showwarning is before
    err = capsys.readouterr().err
    want = f'symjax-mlp run: warning: symjax_mlp.load("{art}"): the artifact leaves jax.export'
    assert err.startswith(want) and err.count("\n") == 1, err
    assert "FutureWarning" not in err and "warnings.warn" not in err
    with pytest.warns(FutureWarning, match="compatibility window on 2000-01-01 .already."):
        sm.load(art)


def test_the_cli_reads_no_private_attribute_of_argparse():
    """The options a message names were found through argparse's privates (parser._actions,
    argparse._SubParsersAction), which the house keeps in _compat.py only. build_parser keeps
    a public mapping instead: each subcommand's parser, and each parser's options."""
    import ast
    import pathlib

    import symjax_mlp.cli as cli

    found = []
    for file in sorted(pathlib.Path(cli.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(file.read_text())):
            attr = getattr(node, "attr", "")
            if attr.startswith("_") and not attr.startswith("__") and attr != "_exit":
                found.append(f"{file.name}:{node.lineno}: .{attr}")
    assert not found, found
    parser = cli.build_parser()
    assert set(parser.commands) == set(COMMANDS)
    flags = {f for a in parser.commands["verify"].options for f in a.option_strings}
    assert {"--batches", "--rtol", "--key", "--json", "-h"} <= flags


def test_json_is_never_written_into_the_artifact_read_and_an_empty_path_is_refused(
    tmp_path, capsys
):
    """`inspect A --json A/manifest.json` replaced the artifact's manifest (exit 0), as run's
    --output once did (refused since); `run '' ...` blamed --output for being "a file of the
    artifact " (the working directory). Both are refused before any work, saying why."""
    art = tmp_path / "m"
    assert main(["export", str(art), "--sizes", "3,2", "--in-features", "4"]) == 0
    manifest = (art / "manifest.json").read_bytes()
    capsys.readouterr()
    for command in (["inspect", str(art)], ["verify", str(art), "--batches", "1"]):
        for name in ("manifest.json", "model.jaxexport"):
            assert main([*command, "--json", str(art / name)]) == 2
            err = capsys.readouterr().err
            assert f"--json {art / name}: is a file of the artifact {art}" in err, err
            assert "Pass another path" in err
    assert (art / "manifest.json").read_bytes() == manifest
    assert main(["inspect", str(art), "--json", str(tmp_path / "report.json")]) == 0
    assert (tmp_path / "report.json").exists()
    for command in (["inspect", ""], ["run", "", "--input", str(tmp_path / "report.json")]):
        argv = [*command, "--output", str(tmp_path / "y.npy")] if command[0] == "run" else command
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "PATH '': is empty; pass the artifact directory" in err and "--output" not in err, (
            err
        )


def test_inspect_json_is_strict_json_for_a_manifest_holding_an_infinite_number(
    tmp_path, capsys, monkeypatch
):
    """A stranger's manifest may hold 1e400 (json reads it as inf): `inspect --json` wrote
    `Infinity`, which JSON has not (jq and JavaScript refuse it). It writes "inf", as text."""
    import json

    art = tmp_path / "dür\udcfc"  # and a byte UTF-8 cannot decode (a Latin-1 name's ü)
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0  # was a bug
    assert capsys.readouterr().out.startswith(f"exported {tmp_path}/dür\\xfc: (args[0]")
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["metadata"] = {"big": 1e400, "fine": [1.5, {"small": -1e400}]}
    (art / "manifest.json").write_text(json.dumps(manifest))
    assert main(["inspect", str(art), "--json"]) == 0

    def refuse(name):
        raise AssertionError(f"not JSON: {name}")

    card = json.loads(capsys.readouterr().out, parse_constant=refuse)["metadata"]
    assert card == {"big": "inf", "fine": [1.5, {"small": "-inf"}]}
    # under LC_ALL=C, PYTHONUTF8=0: a UnicodeEncodeError ('\\xfc' in its path) shown as a bug
    typed = os.fsencode(art).decode("ascii", "surrogateescape")  # sys.argv under LC_ALL=C
    code, out, err = _under_ascii(monkeypatch, ["inspect", typed])
    assert code == 0 and f"{tmp_path}/dür".encode() in out and not err, err


def _under_ascii(monkeypatch, argv):
    """``symjax-mlp ARGV`` as LC_ALL=C PYTHONUTF8=0 runs it: ASCII streams; (code, out, err)."""
    import io

    from symjax_mlp import cli

    out, err = (io.TextIOWrapper(io.BytesIO(), "ascii", e, write_through=True)
                for e in ("surrogateescape", "backslashreplace"))  # fmt: skip
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(SystemExit) as e:
        cli.run(argv)
    monkeypatch.undo()
    return e.value.code, out.buffer.getvalue(), err.buffer.getvalue()


def test_a_non_ascii_path_under_an_ascii_locale_is_written_as_typed(tmp_path, monkeypatch):
    """Under LC_ALL=C (PYTHONUTF8=0) `inspect .../dür` said 'd\\xfcr', a byte the path has not
    (inspect of an artifact there: a UnicodeEncodeError reported as a bug, see the test above):
    the command writes UTF-8, as Python's UTF-8 mode does, so the path comes back as typed."""
    typed = "dür".encode().decode("ascii", "surrogateescape")  # sys.argv under LC_ALL=C
    code, _, err = _under_ascii(monkeypatch, ["inspect", str(tmp_path / typed)])
    said = f"{tmp_path}/dür does not exist. Pass the directory written by symjax_mlp.export.\n"
    assert code == 2 and err.endswith(said.encode()), err


@pytest.mark.slow  # three CLI processes, each past JAX's import (~1 s): over a unit test's budget
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/<pid>/maps")
def test_ctrl_c_amid_the_imports_exits_130_in_one_line():
    """A Ctrl-C in the CLI's first second, while JAX was imported, printed a KeyboardInterrupt
    traceback (or crashed in jaxlib's initialisation, a segfault). Each Ctrl-C here lands while
    NumPy and JAX are imported: the command exits 130 with its one line."""
    import time
    from pathlib import Path

    for delay in (0, 0.03, 0.1):
        with _ctrl_c_handled():
            proc = subprocess.Popen(
                [sys.executable, "-m", "symjax_mlp", "tour", "--calls", "100000000"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        try:
            while "numpy" not in Path(f"/proc/{proc.pid}/maps").read_text():  # imports begun
                time.sleep(0.001)
        except OSError:  # it ended: its stderr says why
            pass
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        assert_interrupted(proc, timeout=60)


def test_run_and_train_print_an_odd_output_path_escaped(tmp_path, capsys, monkeypatch):
    """`run --output` and `train --export` to a path holding an escape and a byte the locale
    cannot decode printed it raw: the escape acted on the terminal (a UnicodeEncodeError, shown
    as a bug, under a strict stdout). They print it as export does: \\x1b and \\xfc."""
    import types

    import numpy as np

    import symjax_mlp.training

    art, x, odd = tmp_path / "m", tmp_path / "x.npy", tmp_path / "y\x1b[31m\udcfc"
    assert main(["export", str(art), "--sizes", "3", "--in-features", "2"]) == 0
    np.save(x, np.ones((1, 2), np.float32))
    capsys.readouterr()
    assert main(["run", str(art), "--input", str(x), "--output", f"{odd}.npy"]) == 0
    assert capsys.readouterr().out == f"wrote {tmp_path}/y\\x1b[31m\\xfc.npy: float32[1, 3]\n"
    done = types.SimpleNamespace(test_accuracy=1.0, epoch=1, step=1, compiled=True,
                                 train_seconds=0.0, export=lambda *a, **k: None)  # fmt: skip
    monkeypatch.setattr(symjax_mlp.training, "train", lambda *a, **k: done)  # no epoch run
    assert main(["train", "--quiet", "--export", str(odd)]) == 0
    assert capsys.readouterr().out.startswith(f"exported the trained model to {tmp_path}/y\\x1b")


def test_run_passes_params_to_load(monkeypatch, tmp_path):
    """``run --params FILE`` is ``load(path, params=FILE)`` (the slow test below runs it)."""
    import symjax_mlp as sm
    from symjax_mlp.serving import _app

    got = {}

    def fake_load(path, **options):
        got.update(options)
        raise sm.ConfigError("stop here")

    monkeypatch.setattr(_app, "load", fake_load)
    (tmp_path / "x.npy").write_bytes(b"")
    x, y = str(tmp_path / "x.npy"), str(tmp_path / "y.npy")
    argv = ["run", str(tmp_path / "m"), "--input", x, "--output", y]
    assert main([*argv, "--params", "w.safetensors"]) == 2
    assert got["params"] == "w.safetensors"
    assert main(argv) == 2 and got["params"] is None


@pytest.mark.slow  # two exports, three runs: 4 s
def test_run_takes_params_as_load_does(tmp_path, capsys):
    """``sm.load(path, params=...)`` had no ``run`` twin: other weights for the artifact's
    program could not be run from the shell. ``--params`` runs seed 0's program on seed 1's
    weights, as seed 1's artifact answers."""
    import numpy as np

    for seed in ("0", "1"):
        argv = ["export", str(tmp_path / seed), "--sizes", "3", "--in-features", "2"]
        assert main([*argv, "--seed", seed]) == 0
    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.float32).reshape(4, 2))
    run = ["run", str(tmp_path / "0"), "--input", str(tmp_path / "x.npy"), "--output"]
    assert main([*run, str(tmp_path / "y0.npy")]) == 0
    other = str(tmp_path / "1" / "params.safetensors")
    assert main([*run, str(tmp_path / "y.npy"), "--params", other]) == 0
    run[1] = str(tmp_path / "1")
    assert main([*run, str(tmp_path / "y1.npy")]) == 0
    y, y0, y1 = (np.load(tmp_path / f"{n}.npy") for n in ("y", "y0", "y1"))
    np.testing.assert_array_equal(y, y1)
    assert not np.array_equal(y, y0)


def test_bench_takes_warmup_as_timeit_does(monkeypatch, tmp_path):
    """``sm.timeit(..., warmup=)`` had no ``bench`` twin: its 50 untimed calls per row were
    fixed from the shell."""
    import symjax_mlp as sm
    from symjax_mlp.cli import _args

    got = {}

    def fake_timeit(model, **options):
        got.update(options)
        raise sm.ConfigError("stop here")

    monkeypatch.setattr(_args, "load_model", lambda args: "model")
    monkeypatch.setattr(sm, "timeit", fake_timeit)
    assert main(["bench", str(tmp_path), "--warmup", "3", "--calls", "10"]) == 2
    assert got["warmup"] == 3 and got["calls"] == 10
