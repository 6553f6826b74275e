import sys

from symjax_mlp.cli import main

sys.exit(main())
