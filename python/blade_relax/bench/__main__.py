"""``python -m blade_relax.bench``: see :func:`blade_relax.bench.main`."""

import sys

from .cli import main

sys.exit(main())
