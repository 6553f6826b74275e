"""``python -m symjax_mlp``: the command line (see :mod:`symjax_mlp.cli`)."""

from symjax_mlp.cli import run

run()
