"""``python -m funcgrad``: the same as the ``funcgrad`` console script."""
from funcgrad.cli import console_main

console_main()
