"""``python -m hvdrun`` is the ``hvdrun`` command."""

from hvdrun.interrupts import exit_if_interrupted, own_signals

with exit_if_interrupted():  # from before the signals are hvdrun's: a signal during start-up ends it with one line
    own_signals()  # before click and the rest are imported
    from hvdrun.cli import main

    main()
