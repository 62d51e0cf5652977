"""``python -m blade_relax.cli``: see :func:`blade_relax.cli.main`."""

import sys

from . import main

sys.exit(main())
