"""What the launcher and the workers say to each other: imported by both, importing neither.

* ``wire.py``: framed, marshalled messages and the mutual HMAC authentication with the job's secret;
* ``sockets.py``: the control plane's listening sockets (where to bind, a taken port retried);
* ``inspection.py``: what an inspector (``hvdrun stacks``, Ctrl-\\ to hvdrun) asks rank 0 for, and the job's
  folded report of every rank's stacks and collectives;
* ``rounds.py``: an elastic job's membership messages and a worker's assignment in a round.
* ``tree.py``: the rendezvous tree of a large job's hosts (each host's parent, where inner hosts listen).

Standard library only (and hvdrun's errors, environment names and rank lists): the launcher loads none of
the worker runtime, nor numpy, through it.
"""
