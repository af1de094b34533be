"""``horovod.common.util``: the helpers of Horovod's util that scripts and libraries import.

hvdrun has no compiled extension: Horovod's ``torch`` extension is :mod:`hvdrun.torch`, there when torch
can be imported; ``tensorflow`` and ``mxnet`` are never there. The build probes answer from
:mod:`hvdrun.torch.build`, imported on first call, so importing this module does not load torch.
Their ``verbose`` argument is accepted and ignored (nothing is probed in a subprocess).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from hvdrun.runtime.reduce import chunk_bounds

T = TypeVar("T")


def extension_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True for ``"torch"`` when torch can be imported; hvdrun provides no other Horovod extension."""
    return ext_base_name == "torch" and importlib.util.find_spec("torch") is not None


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args: str) -> None:
    """Raise ImportError unless ``ext_name`` (e.g. ``"horovod.torch"``) is available under hvdrun."""
    if not extension_available(ext_name.rpartition(".")[2]):
        raise ImportError(f"{ext_name} is not available under hvdrun --horovod-compat: hvdrun provides "
                          f"horovod.torch only, which needs torch (pip install torch); {ext_env_var} does not apply")


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """True when the extension is available and torch sees a CUDA device."""
    if not extension_available(ext_base_name):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _probe(name: str) -> Any:
    from hvdrun.torch import build

    return getattr(build, name)()


def mpi_built(verbose: bool = False) -> bool:
    """:func:`hvdrun.torch.build.mpi_built`."""
    return bool(_probe("mpi_built"))


def gloo_built(verbose: bool = False) -> bool:
    """:func:`hvdrun.torch.build.gloo_built`."""
    return bool(_probe("gloo_built"))


def nccl_built(verbose: bool = False) -> int:
    """:func:`hvdrun.torch.build.nccl_built` (the NCCL version code, 0 without NCCL)."""
    return int(_probe("nccl_built"))


def ddl_built(verbose: bool = False) -> bool:
    """:func:`hvdrun.torch.build.ddl_built`."""
    return bool(_probe("ddl_built"))


def ccl_built(verbose: bool = False) -> bool:
    """:func:`hvdrun.torch.build.ccl_built`."""
    return bool(_probe("ccl_built"))


@contextlib.contextmanager
def env(**variables: str | None) -> Iterator[None]:
    """Set environment variables (``None`` values are skipped) for the ``with`` block, then restore them."""
    given = {name: value for name, value in variables.items() if value is not None}
    before = {name: os.environ.get(name) for name in given}
    os.environ.update(given)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def get_average_backwards_compatibility_fun(reduce_ops: Any) -> Callable[[int | None, bool | None], int]:
    """A function ``(op, average) -> op``: the legacy ``average`` flag mapped to ``reduce_ops.Average``/``Sum``.

    Giving both raises ValueError; ``average`` alone warns (DeprecationWarning); neither gives Average.
    """

    def resolve(op: int | None, average: bool | None) -> int:
        if op is not None and average is not None:
            raise ValueError("op and average cannot both be given; pass op=hvd.Average or op=hvd.Sum only")
        if op is not None:
            return op
        if average is not None:
            warnings.warn("the average argument is deprecated; use op=hvd.Average or op=hvd.Sum",
                          DeprecationWarning, stacklevel=2)
        return int(reduce_ops.Sum if average is False else reduce_ops.Average)

    return resolve


def num_rank_is_power_2(num_rank: int) -> bool:
    """True for 1, 2, 4, 8, ... (the rank counts Horovod's Adasum requires)."""
    return num_rank > 0 and num_rank & (num_rank - 1) == 0


def split_list(items: Sequence[T], n: int) -> list[Sequence[T]]:
    """``items`` cut into ``n`` consecutive parts; the first ``len(items) % n`` have one more element."""
    return [items[start:stop] for start, stop in chunk_bounds(len(items), n)]


def is_iterable(x: Any) -> bool:
    """True when ``iter(x)`` works."""
    try:
        iter(x)
    except TypeError:
        return False
    return True


def check_installed_version(name: str, version: str, exception: BaseException | None = None) -> None:
    """Nothing to check: hvdrun is not compiled against a framework version, so none can mismatch."""


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """True when version string ``ver`` >= ``target`` (``major.minor.patch``)."""
    if not isinstance(ver, str) or not isinstance(target, str) or target.count(".") != 2:
        raise ValueError(f"expected two version strings, the second as major.minor.patch (e.g. '1.10.0'); "
                         f"got {ver!r} and {target!r}")
    return _release(ver) >= _release(target)


def _release(version: str) -> tuple[int, ...]:
    """``(1, 10, 0)`` for ``"1.10.0+cu121"``: the leading numbers of a version (pre-releases count as released)."""
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


__all__ = [
    "ccl_built", "check_extension", "check_installed_version", "ddl_built", "env", "extension_available",
    "get_average_backwards_compatibility_fun", "gloo_built", "gpu_available", "is_iterable",
    "is_version_greater_equal_than", "mpi_built", "nccl_built", "num_rank_is_power_2", "split_list",
]
