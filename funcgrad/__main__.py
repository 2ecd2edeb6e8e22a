"""``python -m funcgrad``: the same as the ``funcgrad`` console script."""
import sys

from funcgrad.cli import main

sys.exit(main())
