"""Byte channels between ring neighbours: shared memory on one host, TCP between hosts.

Each rank owns a :class:`~hvdrun.runtime.transport.base.TxChannel` to the next rank of the
ring and an :class:`~hvdrun.runtime.transport.base.RxChannel` from the previous one. Both
are non-blocking; :class:`~hvdrun.runtime.transport.base.Waiter` blocks when neither can
make progress.
"""
