"""Launchers: start the workers of a job and supervise them (see ``base.py``)."""
