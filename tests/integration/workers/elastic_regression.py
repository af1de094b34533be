"""The linear regression of examples/linear_regression.py written for ``hvd.elastic``, with no code of its own for
the walltime: ``--state-dir`` keeps its state and the next job resumes it. Prints ``exact=`` (the coefficients' hex)
at the end.

    PYTHONPATH=examples hvdrun -np 2 [--state-dir DIR] elastic_regression.py EPOCHS SECONDS_PER_EPOCH
"""

import sys
import time

import torch
from linear_regression import make_data, step  # examples/ on PYTHONPATH

import hvdrun.torch as hvd

EPOCHS, PAUSE_S = int(sys.argv[1]), float(sys.argv[2])
SAMPLES, LR = 1000, 0.01

hvd.init()
features, targets = make_data(SAMPLES)
shard = slice(hvd.rank() * SAMPLES // hvd.size(), (hvd.rank() + 1) * SAMPLES // hvd.size())
state = hvd.elastic.ObjectState(weights=torch.zeros(4, dtype=torch.float64), epoch=0)


@hvd.elastic.run
def train(state):
    if hvd.rank() == 0:
        print(f"starts at epoch {state.epoch}", flush=True)
    while state.epoch < EPOCHS:
        state.weights = step(state.weights, features[shard], targets[shard], SAMPLES, LR, distributed=True)
        state.epoch += 1
        time.sleep(PAUSE_S)
        state.commit()
    return state.weights


weights = train(state)
print(f"rank {hvd.rank()}: exact={','.join(w.hex() for w in weights.tolist())}", flush=True)
