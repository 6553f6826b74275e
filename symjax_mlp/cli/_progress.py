"""Progress for the long commands: a rich bar on a terminal, plain lines on stderr otherwise."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def epochs_progress(epochs: int, *, quiet: bool) -> Iterator[Callable[[Any], None] | None]:
    """``on_epoch`` for :func:`symjax_mlp.training.train`: a bar over ``epochs``, or lines."""
    if quiet:
        yield None
        return
    width = len(str(epochs))

    def line(r: Any) -> str:
        return (
            f"loss {r.loss:.4f}  train {r.train_accuracy:.2%}  test {r.test_accuracy:.2%}  "
            f"{r.seconds:.2f} s"
        )

    if not sys.stderr.isatty():

        def plain(r: Any) -> None:
            done = round(20 * r.epoch / epochs)
            bar = "#" * done + "." * (20 - done)
            print(f"epoch {r.epoch:>{width}}/{epochs} [{bar}] {line(r)}", file=sys.stderr)

        yield plain
        return
    from rich import progress as rp
    from rich.console import Console

    columns = (
        rp.TextColumn("epoch"),
        rp.MofNCompleteColumn(),
        rp.BarColumn(),
        rp.TimeElapsedColumn(),
        rp.TextColumn("ETA"),
        rp.TimeRemainingColumn(),
        rp.TextColumn("{task.description}"),
    )
    with rp.Progress(*columns, console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("", total=epochs)

        def update(r: Any) -> None:
            bar.update(task, completed=r.epoch, description=line(r))

        yield update
