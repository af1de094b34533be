"""``horovod.common.process_sets``: :mod:`hvdrun.torch.process_sets`' classes, set and functions."""

from hvdrun.torch.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set

__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
