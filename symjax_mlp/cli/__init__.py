"""symjax-mlp (also python -m symjax_mlp): the chapter's hybrid programming from the shell.

Exit codes: 0 ok, 1 verify found a difference, or a bug (with its traceback), 2 a user error
(one line, no traceback), 75 train lost another process of a --coordinator run, 130
interrupted.
"""

from __future__ import annotations

import _thread
import argparse
import codecs
import contextlib
import difflib
import functools
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from symjax_mlp._artifact.format import printable  # a newline in a path: still one line
from symjax_mlp._files import exhausted
from symjax_mlp.cli import _args, _run, _serve, _train
from symjax_mlp.cli._args import count, int_list, keywords, show, subcommand

PROG = "symjax-mlp"
_EXTRAS = {  # a missing module -> the optional extra that installs it
    "iree": "iree", "sklearn": "data", "matplotlib": "plot", "torch": "torch",
    "starlette": "serve", "uvicorn": "serve", "model_signing": "sign", "ray": "ray",
}  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose usage errors are one line (and a pointer to ``--help``), which
    keeps its ``options`` in order (what messages may name) and its subcommands' ``commands``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.options: list[argparse.Action] = []  # before argparse's own add_argument("-h")
        self.commands: dict[str, Any] = {}
        self.given: list[str] = []  # the arguments parsed last, for error() to look into
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.given = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        message = printable(message) + _closest(message, self.options, self.given)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        """Every option's help ends with its default as typed (256,128,2), unless it says it
        or has none (a flag's False, an option's None: not given)."""
        action = super().add_argument(*args, **kwargs)
        self.options.append(action)
        default = action.default
        none = action.required or any(default is v for v in (argparse.SUPPRESS, None, False))
        if action.option_strings and not none and "default" not in (action.help or ""):
            typed = ",".join(map(str, default)) if isinstance(default, tuple) else "%(default)s"
            action.help = f"{action.help or ''} (default: {typed})".lstrip()
        return action


def _closest(message: str, options: list[argparse.Action], given: list[str]) -> str:
    """``; did you mean X?`` for a mistyped choice, or one of ``options``, that argparse's
    ``message`` names, or that left a required option out (``--inptu``, among ``given``)."""
    choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)$", message)
    required = message.startswith("the following arguments are required: ")
    if choice:
        typed, names = [choice[1]], re.findall(r"'([^']*)'", choice[2])
    elif required or message.startswith("unrecognized arguments: "):
        names = [name for a in options for name in a.option_strings]
        words = [w.split("=")[0] for w in (given if required else message.split()[2:])]
        typed = [w for w in words if w[:2] == "--" and not any(n.startswith(w) for n in names)]
    else:
        return ""
    close = [(t, difflib.get_close_matches(t, names, n=1)) for t in typed]
    said = [(f"'{c[0]}'" if choice else c[0]) for _, c in close if c]
    if required and said:  # the message names what is missing, not what was typed
        return "; " + "; ".join(f"{t} is no option: did you mean {c[0]}?" for t, c in close if c)
    return f"; did you mean {' or '.join(said)}?" if said else ""


def _run_tour(args: argparse.Namespace) -> None:
    from symjax_mlp.chapter import tour

    tour(calls=args.calls)


def _run_graph(args: argparse.Namespace) -> None:
    from symjax_mlp.chapter import describe_mlp

    _args.say(describe_mlp(args.sizes, **keywords(args, "in_features batch activation format")))


def _run_export(args: argparse.Namespace) -> None:
    from symjax_mlp.chapter import export_mlp

    platforms = tuple(p for p in args.platforms.split(",") if p)
    options = keywords(args, "sizes in_features activation seed batch overwrite")
    art = export_mlp(args.path, platforms=platforms, **options)
    where = printable(str(art.path))  # a byte no locale decodes: \xfc, not a UnicodeEncodeError
    _args.say(f"exported {where}: {art.signature}; platforms {', '.join(art.platforms)}")


def _run_inspect(args: argparse.Namespace) -> None:
    from symjax_mlp import inspect

    art = inspect(args.path)
    show(art, art.to_json(), args.json)


def _run_verify(args: argparse.Namespace) -> int:
    from symjax_mlp import verify

    runtimes = tuple(args.runtime or ("jax",))
    options = keywords(args, "batches rtol atol seed timeout")
    report = verify(args.path, runtimes=runtimes, **options, **_args.load_options(args))
    show(report, report.to_dict(), args.json)
    return 0 if report.ok else 1


def _run_bench(args: argparse.Namespace) -> None:
    from symjax_mlp import timeit

    if args.dispatch == "sync":
        _args.sync_dispatch()
    timing = timeit(_args.load_model(args), **keywords(args, "batch calls repeats warmup"))
    show(timing, timing.to_dict(), args.json)


_MLP = (  # the library's message offers None as an activation: here it is one
    ("--sizes", {"type": int_list("256,128,2"), "default": (256, 128, 2), "help": "layer widths"}),
    ("--in-features", {"type": count, "default": 512}),
    ("--activation", {"type": lambda name: None if name in ("None", "none") else name,
                      "default": "relu", "help": "a jax.nn activation name, or none (linear)"}),
)  # fmt: skip
_ARTIFACT = ("path", {"help": "an artifact directory"})
#: every subcommand, in --help's order: :func:`subcommand`'s arguments after its name (help,
#: handler, options as ``(name, keywords)``, ...); those of run, train and serve in their modules
_COMMANDS = {
    "tour": ("the chapter, step by step, on real objects", _run_tour, (
        ("--calls", {"type": count, "default": 1000, "help": "calls in the timing"}),)),
    "graph": ("print the MLP's symbolic program", _run_graph, (
        *_MLP, ("--batch", {"type": count, "default": 1}),
        ("--format", {"choices": ("jaxpr", "stablehlo", "hlo", "dot", "summary"),
                      "default": "summary"}))),
    "export": ("export the chapter's MLP as a portable artifact", _run_export, (
        ("path", {"help": "the artifact directory to write"}), *_MLP,
        ("--seed", {"type": int, "default": 0, "help": "seeds the initial weights"}),
        ("--batch", {"type": _args.batch, "default": "b", "help": "a symbolic name (b) or a size"}),
        ("--platforms", {"default": "cpu", "help": "comma-separated, e.g. cpu,cuda"}),
        ("--overwrite", {"action": "store_true", "help": "replace an existing artifact"}))),
    "inspect": ("an artifact's manifest, signature and StableHLO ops", _run_inspect, (
        _ARTIFACT, _args.json_option("the manifest"))),
    "run": _run.COMMAND,
    "verify": ("reload an artifact in a fresh process and check it", _run_verify, (
        _ARTIFACT,
        ("--runtime", {"action": "append", "choices": ("jax", "iree"), "help": "repeatable"}),
        ("--batches", {"type": int_list("1,7,128"), "default": (1, 7, 128),
                       "help": "e.g. 1,7,128"}),
        ("--rtol", {"type": _args.nonnegative, "default": 1e-5}),
        ("--atol", {"type": _args.nonnegative, "default": 1e-5}),
        ("--seed", {"type": int, "default": 0, "help": "seeds the random inputs"}),
        ("--timeout", {"type": _args.positive, "default": 300.0, "metavar": "SECONDS",
                       "help": "the most the fresh process may take"}),
        *_args.TRUST, _args.json_option("the report"))),
    "bench": ("time an artifact's calls against its AOT-compiled floor (sm.timeit): min and "
              "median per call, synced and pipelined. The project's benchmark is python "
              "scripts/bench.py", _run_bench, (
        ("path", {"help": "an exported artifact directory"}),
        ("--runtime", {"choices": ("jax", "iree"), "default": "jax", "help": "the runtime to "
                       "time"}),
        ("--entry", {"help": "the entry point to time (default: the artifact's default)"}),
        ("--batch", {"type": count, "default": 1, "help": "the size of the symbolic batch"}),
        ("--calls", {"type": count, "default": 1000, "help": "calls per repeat"}),
        ("--repeats", {"type": count, "default": 7, "help": "repeats of each row"}),
        ("--warmup", {"type": count, "default": 50, "help": "untimed calls of each row first"}),
        ("--dispatch", {"choices": ("async", "sync"), "default": "async", "help": "JAX's CPU "
                        "dispatch: async is JAX's default, sync the latency mode "
                        "(sm.serving.latency_mode(): calls run on the calling thread)"}),
        *_args.TRUST, _args.json_option("the timings"))),
    "train": _train.COMMAND,
    "serve": _serve.COMMAND,
}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    from symjax_mlp import __version__

    parser = _Parser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=f"{PROG} {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in _COMMANDS.items():
        subcommand(sub, name, *command)
    parser.commands = sub.choices
    return parser


# A library message's keyword, the subcommand's option for it (its dest), as typed, where the
# keyword is not the option's dest or names a value: the CLI prints the library's message as it
# is, then the options it names, never editing its text. Every other option is its dest's
# keyword (batch= is --batch, max_batch= is --max-batch), but for _NO_KEYWORD's.
_OPTIONS = (
    ("overwrite=True", "overwrite", "--overwrite"),
    ("resume=True", "resume", "--resume"),
    ("checkpoint=DIR", "checkpoint", "--checkpoint DIR"),
    ("allow=", "allow", "--allow OP (once per op)"),
    ("trust=True", "trust", "--trust"),
    ("verify_signature=", "key", "--key PEM"),
    ("ray_actor_options=", "replica_cpus", "--replica-cpus N"),
    ("runtimes=", "runtime", "--runtime (once per runtime)"),
    ("compiled=False", "eager", "--eager"),
    ("address=", "ray_address", "--ray-address ADDRESS"),
)
_READ = ("inspect", "run", "verify", "bench")  # the subcommands whose PATH is an artifact
#: options that set no library keyword of their name
_NO_KEYWORD = frozenset(("help", "json", "export", "quiet", "ray", "key", "eager", "replica_cpus"))


def _named(text: str, word: str) -> bool:
    """Whether ``text`` names ``word`` whole (``batch=`` is not in ``max_batch=``, ``--batch``
    not in ``--batch-size``)."""
    end = "" if word.endswith("=") else r"(?![\w-])"
    return re.search(rf"(?<![\w.-]){re.escape(word)}{end}", text) is not None


def _options_said(message: str, command: _Parser) -> list[str]:
    """``keyword is --option`` for each keyword ``message`` names that an option of
    ``command`` sets, unless the message names that option already."""
    options = [a for a in command.options if a.option_strings]
    taken = {keyword.split("=")[0] for keyword, _, _ in _OPTIONS} | _NO_KEYWORD
    pairs = [(k, o) for k, dest, o in _OPTIONS if dest in {a.dest for a in options}] + [
        (f"{a.dest}=", f"{a.option_strings[0]} {a.metavar or ''}".rstrip())
        for a in options
        if a.dest not in taken
    ]
    return [
        f"{keyword} is {option}"
        for keyword, option in pairs
        if _named(message, keyword) and not _named(message, option.split()[0])
    ]


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit code, as the module docstring lists them."""
    from symjax_mlp._errors import SymjaxError, first_line

    parser, given = build_parser(), list(sys.argv[1:] if argv is None else argv)
    try:
        args, extra = parser.parse_known_args(given)
        if extra:  # the subcommand's error: its name, its help, its options to suggest
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as e:  # argparse exits 2 on bad usage, 0 on --help and --version
        if e.code == 2 and "--json" in given[1:-1]:  # --json's optional PATH took the artifact
            taken = given[given.index("--json") + 1]
            if os.path.isdir(taken):
                print(
                    f"{PROG} {given[0]}: --json took {printable(taken)!r} as the file to write "
                    f"to. Name the artifact first: {PROG} {given[0]} ARTIFACT --json",
                    file=sys.stderr,
                )
        return int(e.code or 0)
    where = f"{PROG} {args.command}"
    try:
        if args.command in _READ and args.path == "":  # Path("") is the working directory
            raise argparse.ArgumentTypeError("PATH '': is empty; pass the artifact directory")
        if getattr(args, "json", None) not in (None, "-") and args.command != "train":
            _args.writable(args.json, "--json", overwrite=True)  # refused before any work
            _args.outside_artifact(args.json, "--json", getattr(args, "path", None))
        with warnings.catch_warnings():  # restores showwarning after the command
            warnings.showwarning = functools.partial(_warning, where, warnings.showwarning)
            return args.handler(args) or 0  # verify's 1: a check failed
    except (SymjaxError, argparse.ArgumentTypeError, TimeoutError) as e:  # a Batcher's warm-up
        message = str(e)
        for arg in given:  # a newline in a path: still one line
            if arg.strip():  # not a lone "\n", which would escape the message's own lines
                message = message.replace(arg, printable(arg))
        print(f"{where}: error: {message}", file=sys.stderr)
        said = _options_said(message, parser.commands[args.command])
        if said:
            print(f"{where}: on the command line, {', '.join(said)}", file=sys.stderr)
        return 2
    except ImportError as e:
        name = (e.name or "").split(".")[0]
        if name not in _EXTRAS:
            return _bug(where)
        extra = f"pip install 'symjax_mlp[{_EXTRAS[name]}]'"
        print(f"{where}: error: this needs the optional package {name!r}: {extra}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return _interrupted(where)
    except BrokenPipeError:  # `| head` closed the pipe: stop quietly, as cat and grep do
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:
        said = first_line(e)
        if isinstance(e, MemoryError) or said.startswith("RESOURCE_EXHAUSTED"):  # XLA's
            sizes = " (--sizes)" if "sizes" in vars(args) else ""
            print(f"{where}: error: out of memory ({said}); use smaller layers{sizes}, batches "
                  "or inputs, or a machine with more memory.", file=sys.stderr)  # fmt: skip
            return 2
        if isinstance(e, OSError) and (fix := exhausted(e)):  # this process's limit: no bug
            print(f"{where}: error: {printable(str(e))}. {fix}", file=sys.stderr)
            return 2
        return _bug(where)


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _warning(
    where: str, python: Callable[..., None], message: Any, category: Any, filename: str,
    *args: Any, **kwargs: Any,
) -> None:  # fmt: skip
    """The library's warnings as one line, ``symjax-mlp verify: warning: ...`` (not Python's
    two lines with one of library source under); others as Python shows them."""
    if os.path.abspath(filename).startswith(_PACKAGE + os.sep):
        print(f"{where}: warning: {printable(str(message))}", file=sys.stderr)
    else:
        python(message, category, filename, *args, **kwargs)


def _import_jax() -> None:
    """Imports JAX with Ctrl-C held until it is imported (then raised): a SIGINT amid jaxlib's
    extension's initialisation crashes the interpreter (a segfault) or fails the import."""
    block = getattr(signal, "pthread_sigmask", None)  # (POSIX)
    held = block(signal.SIG_BLOCK, {signal.SIGINT}) if block else None
    try:
        import jax  # noqa: F401
    finally:
        if block:
            block(signal.SIG_SETMASK, held)


def _interrupted(where: str) -> int:
    print(f"\n{where}: interrupted", file=sys.stderr)
    return 130


def _bug(where: str) -> int:
    traceback.print_exc()
    bug = "this is a bug in symjax_mlp (the traceback above); please report it."
    print(f"{where}: {bug}", file=sys.stderr)
    return 1


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The ``symjax-mlp`` command: exits with :func:`main`'s code; after an interrupt (130)
    at once (``os._exit``: tearing the interpreter down under XLA's threads can crash or hang).
    A Ctrl-C that lands where Python can only print it (a garbage-collector callback) is
    raised again, not lost. Under an ASCII locale it writes UTF-8, as Python's UTF-8 mode
    does: a path comes back as typed (``printable`` decodes its bytes so)."""
    hook = sys.unraisablehook
    sys.unraisablehook = functools.partial(_interrupt_again, hook)
    for stream in (sys.stdout, sys.stderr):  # LC_ALL=C with PYTHONUTF8=0: ASCII
        with contextlib.suppress(AttributeError, LookupError, TypeError, ValueError):  # no file
            if codecs.lookup(stream.encoding).name == "ascii":
                stream.reconfigure(encoding="utf-8")  # its errors= kept
    try:
        _import_jax()
        code = main(argv)
    except KeyboardInterrupt:  # before main's own handling: amid JAX's import, main's parser
        given = sys.argv[1:] if argv is None else argv
        code = _interrupted(" ".join([PROG, *[a for a in given[:1] if a[:1] != "-"]]))
    sys.unraisablehook = hook
    if code == 130:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(130)
    sys.exit(code)


def _interrupt_again(hook: Callable[[Any], None], unraisable: Any) -> None:
    """A Ctrl-C is raised on the main thread, so this hook runs there, and a SIGINT raised in
    it would be raised inside it (printed and lost): a thread raises it once the hook's last
    call, ``release``, lets it go."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        left = threading.Lock()
        left.acquire()
        threading.Thread(target=_interrupt_after, args=(left,), daemon=True).start()
        left.release()
        return
    hook(unraisable)


def _interrupt_after(left: threading.Lock) -> None:
    with left:
        _thread.interrupt_main()  # a SIGINT again, for the main thread's next bytecode
