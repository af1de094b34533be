"""``horovod.common`` under ``hvdrun --horovod-compat``: Horovod's framework-neutral modules, as hvdrun's objects."""
