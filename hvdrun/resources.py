"""The one resolver for data shipped with hvdrun: ``templates/`` and ``cluster_configs/``.

In a wheel they live inside the package (``hvdrun/templates``); in a source checkout or an
editable install they are the top-level folders of the repository.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def data_dir(name: str) -> Path:
    """Return the folder ``name`` ("templates" or "cluster_configs") that hvdrun ships."""
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"hvdrun data folder '{name}' is missing from {_PACKAGE_DIR}; reinstall hvdrun")
