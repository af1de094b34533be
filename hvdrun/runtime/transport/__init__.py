"""Byte channels between ring neighbours: shared memory on one host, TCP between hosts.

Each rank owns a :class:`~hvdrun.runtime.transport.channels.TxChannel` to the next rank of the
ring and an :class:`~hvdrun.runtime.transport.channels.RxChannel` from the previous one. Both
are non-blocking; :class:`~hvdrun.runtime.transport.channels.Waiter` blocks when neither can
make progress.
"""
