"""``horovod.runner.util``: the runner helpers that Horovod's own test utilities import."""
