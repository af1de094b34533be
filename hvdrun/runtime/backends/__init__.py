"""Backends execute negotiated collectives on contiguous buffers: ring (ours), mpi, gloo/nccl."""
