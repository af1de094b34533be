"""``python -m hvdrun`` and the ``hvdrun`` console script (``hvdrun.__main__:main``): hvdrun's stop signals are its
own from the import of this module on, before click and the rest of hvdrun are imported (a signal there ends
hvdrun with one line and exit code 128 + N, never a traceback or a silent death)."""

import signal

from hvdrun.interrupts import exit_if_interrupted, own_signals

own_signals()  # at import: the console script imports this module before it calls main()


def main() -> None:
    """The ``hvdrun`` command."""
    try:
        with exit_if_interrupted():  # a signal while the command line's modules are imported
            from hvdrun.cli import main as run_command_line

            run_command_line()
    finally:  # the interpreter's exit puts back the default of every handler but "ignore": Ctrl-\ would dump core
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)


if __name__ == "__main__":
    main()
