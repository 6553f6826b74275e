"""``python -m symjax_mlp``: the command line (see :mod:`symjax_mlp.cli`)."""

import sys

from symjax_mlp.cli import main

sys.exit(main())
