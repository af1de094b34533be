"""hvdrun's version, in one place (``hvdrun.__version__`` re-exports it)."""

__version__ = "0.1.0"
