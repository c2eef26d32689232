"""python -m ringcomm.bench: the collectives benchmark (collectives.py)."""

import sys

from .collectives import main

sys.exit(main())
