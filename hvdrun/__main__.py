"""``python -m hvdrun`` is the ``hvdrun`` command."""

from hvdrun.interrupts import exit_if_interrupted, own_signals

own_signals()  # before click and the rest are imported: a signal during start-up ends hvdrun with one line

with exit_if_interrupted():
    from hvdrun.cli import main

main()
