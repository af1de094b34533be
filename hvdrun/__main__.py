"""``python -m hvdrun`` is the ``hvdrun`` command."""

from hvdrun.cli import main

main()
