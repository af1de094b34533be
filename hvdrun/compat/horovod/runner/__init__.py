"""``horovod.runner``: ``run(func, args=(), kwargs=None, num_proc=1, ...)`` is :func:`hvdrun.launch.function.run`."""

from hvdrun.launch.function import run

__all__ = ["run"]
