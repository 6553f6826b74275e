"""README.md, executed: every code block runs as written, in order, in one fresh directory and
one fresh process (as a reader runs them, outside the suite's settings).

A fenced block tagged ``python`` runs in one shared namespace (like a notebook), ``bash`` with
``bash -e``, and ``console`` is a shell session: each ``$ `` line runs, and the lines under it
are what it must print. An untagged block right after a code block (nothing but blank lines
between them) is that block's output and is compared with what it printed, after masking what
legitimately changes from run to run (timestamps, timings, sizes, hashes). ``text`` blocks are
prose. Two blocks run elsewhere: the quick start (``.ci/run`` executes it as written), and the
2-process training run (``tests/test_multiprocess.py`` runs it on a free port and checks what
it writes: the same two processes would otherwise run twice).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"
# what tests/conftest.py adds
SUITE_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")
ELSEWHERE = "--num-processes 2"  # the block that tests/test_multiprocess.py runs
FENCE = re.compile(r"^```([a-z]*)\n(.*?)^```\n", re.M | re.S)
MASKS = (  # what changes between runs, replaced by a token in both texts
    (re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d[+\-Z][\d:]*"), "<time>"),
    (re.compile(r"\b[0-9a-f]{16}\.\.\."), "<hash>"),
    (re.compile(r"\d[\d,]*\.?\d*\s*(?:µs|ms|s|sec|kB|MB|B)\b"), "<measure>"),
    (re.compile(r"\d+\.\d+%"), "<percent>"),
    (re.compile(r"\b\d+ steps\b"), "<steps>"),
)


def blocks() -> list[tuple[str, str, str | None]]:
    """``(tag, code, shown output or None)`` for every fenced block of the README, in order."""
    text = README.read_text()
    found = list(FENCE.finditer(text))
    out: list[tuple[str, str, str | None]] = []
    skip = set()
    for i, m in enumerate(found):
        if i in skip:
            continue
        tag, code = m.group(1), m.group(2)
        shown = None
        if tag in ("python", "bash") and i + 1 < len(found):
            nxt = found[i + 1]
            if nxt.group(1) == "" and not text[m.end() : nxt.start()].strip():
                shown, _ = nxt.group(2), skip.add(i + 1)
        out.append((tag, code, shown))
    return out


def _mask(text: str) -> list[str]:
    lines = []
    for line in text.strip().splitlines():
        for pattern, token in MASKS:
            line = pattern.sub(token, line)
        lines.append(line.rstrip())
    return lines


def _compare(shown: str, got: str, what: str) -> None:
    want, have = _mask(shown), _mask(got)
    if want and want[-1] == "...":  # the README shows the head of a long output
        want, have = want[:-1], have[: len(want) - 1]
    assert have == want, f"{what} printed:\n{got}\nbut the README shows:\n{shown}"


def _console(code: str) -> list[tuple[str, str]]:
    """``$ cmd`` lines and the output shown under each."""
    runs: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            runs.append((line[2:].split("  #")[0].strip(), []))
        elif runs:
            runs[-1][1].append(line)
    return [(cmd, "\n".join(shown)) for cmd, shown in runs]


def _shell(cmd: str, cwd: Path, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", cmd],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, f"`{cmd}` failed ({done.returncode}):\n{done.stderr[-3000:]}"
    return done.stdout


def test_the_quick_start_is_what_ci_runs():
    tag, code, _ = blocks()[0]
    assert tag == "bash"
    ci = (README.parent / ".ci" / "run").read_text()
    commands = [line for line in code.splitlines() if line and not line.startswith("#")]
    assert any("scripts/bench.py" in c for c in commands)
    for command in commands:
        assert command in ci, f".ci/run does not run the quick start's {command!r}"
    assert "python -m pytest -m slow" in ci  # what the quick start's command leaves out


@pytest.mark.slow
def test_every_readme_block_runs_as_written(tmp_path):
    """In a fresh process, as a reader runs them: XLA as it compiles for users (the suite
    compiles at -O0 and with other fusion kernels, tests/conftest.py, and printed digits may
    differ at round-off there) and one CPU device (not the suite's eight)."""
    env = _env()
    if shutil.which("iree-compile", path=env["PATH"]) is None:
        pytest.fail("the README's IREE recipe needs iree-compile: pip install -e '.[iree]'")
    flags = env.get("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if f not in SUITE_XLA_FLAGS)
    _shell(shlex.join([sys.executable, __file__, str(tmp_path)]), tmp_path, env)


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def run_blocks(directory: Path) -> None:
    """Every block after the quick start, in order, in ``directory`` (this process's cwd)."""
    env, namespace = _env(), {"__name__": "__readme__"}
    for n, (tag, code, shown) in enumerate(blocks()[1:], start=2):
        what = f"README block {n} ({tag})"
        if tag == "python":
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                exec(compile(code, what, "exec"), namespace)
            if shown is not None:
                _compare(shown, buffer.getvalue(), what)
        elif tag == "bash":
            if ELSEWHERE in code:  # test_the_cli_starts_a_2_process_run_as_the_readme_shows
                continue
            got = _shell(code, directory, env)
            if shown is not None:
                _compare(shown, got, what)
        elif tag == "console":
            for cmd, want in _console(code):
                got = _shell(cmd, directory, env)
                if want.strip():
                    _compare(want, got, f"{what}: $ {cmd}")
        else:
            assert tag in ("", "text"), f"{what}: unknown block tag {tag!r}"


if __name__ == "__main__":  # the test's fresh process
    run_blocks(Path(sys.argv[1]))
