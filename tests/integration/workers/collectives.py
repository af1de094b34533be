"""Every collective, dtype, op and length against a NumPy reference computed from all ranks' inputs."""

import numpy as np
import torch

import hvdrun.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
DTYPES = ["int32", "int64", "float16", "float32", "float64"]
OPS = {hvd.Sum: "sum", hvd.Average: "average", hvd.Min: "min", hvd.Max: "max", hvd.Product: "product"}
LENGTHS = [0, 1, SIZE + 1, 50_003]  # empty, one element, not divisible by size, above the eager threshold
TOLERANCE = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}
checks = 0


def data(case: int, rank: int, dtype: str, length: int, op: int) -> np.ndarray:
    rng = np.random.default_rng(1000 * case + rank)
    if op == hvd.Product:
        values = rng.choice([1, 2], size=length) if "int" in dtype else rng.uniform(0.9, 1.1, size=length)
    else:
        values = rng.integers(-50, 50, size=length) if "int" in dtype else rng.normal(size=length)
    return values.astype(dtype)


def reference(inputs: list, op: int, dtype: str, prescale: float, postscale: float) -> np.ndarray:
    wide = [x.astype(np.float64) * prescale if prescale != 1 else x.astype(np.float64) for x in inputs]
    if "int" in dtype:
        wide = [w.astype(dtype).astype(np.float64) for w in wide]  # Horovod scales integers, then casts back
    fold = {hvd.Sum: np.sum, hvd.Average: np.sum, hvd.Min: np.min, hvd.Max: np.max, hvd.Product: np.prod}[op]
    result = fold(np.stack(wide), axis=0) if wide[0].size else wide[0]
    factor = postscale / SIZE if op == hvd.Average else postscale
    return (result * factor).astype(dtype) if factor != 1 else result.astype(dtype)


def check(name: str, got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    global checks
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    if dtype in TOLERANCE:
        assert np.allclose(got.astype(np.float64), want.astype(np.float64), rtol=TOLERANCE[dtype],
                           atol=TOLERANCE[dtype]), f"{name}: {got[:5]} != {want[:5]}"
    else:
        assert np.array_equal(got, want), f"{name}: {got[:5]} != {want[:5]}"
    checks += 1


case = 0
for dtype in DTYPES:
    for op in OPS:
        for length in LENGTHS:
            for in_place in (False, True):
                case += 1
                prescale, postscale = ((0.5, 3.0) if dtype.startswith("float") and op == hvd.Sum else (1.0, 1.0))
                mine = torch.from_numpy(data(case, RANK, dtype, length, op))
                kwargs = {"op": op, "prescale_factor": prescale, "postscale_factor": postscale}
                if in_place:
                    before = mine
                    got = hvd.allreduce_(mine, **kwargs)
                    assert got is before, "allreduce_ must return its input"
                else:
                    copy = mine.clone()
                    got = hvd.allreduce(mine, **kwargs)
                    assert torch.equal(mine, copy), "allreduce must not modify its input"
                want = reference([data(case, r, dtype, length, op) for r in range(SIZE)], op, dtype, prescale,
                                 postscale)
                check(f"allreduce {dtype} {OPS[op]} n={length} in_place={in_place}", got.numpy(), want, dtype)

for dtype in DTYPES + ["uint8", "int8", "int16"]:
    rows = [(r * 3) % 5 for r in range(SIZE)]  # first dimension differs per rank, zero included
    parts = [np.full((rows[r], 3), r, dtype=dtype) for r in range(SIZE)]
    got = hvd.allgather(torch.from_numpy(parts[RANK]))
    check(f"allgather {dtype}", got.numpy(), np.concatenate(parts), dtype)
    for root in range(SIZE):
        value = np.arange(7, dtype=dtype) + root
        got = hvd.broadcast(torch.from_numpy(value if RANK == root else np.zeros(7, dtype)), root_rank=root)
        check(f"broadcast {dtype} root={root}", got.numpy(), value, dtype)

for length in (1, SIZE, 2 * SIZE + 1, 30_001):
    inputs = [data(7000 + length, r, "float64", length * 2, hvd.Sum).reshape(length, 2) for r in range(SIZE)]
    got = hvd.reducescatter(torch.from_numpy(inputs[RANK]), op=hvd.Sum)
    bounds = np.cumsum([0] + [length // SIZE + (1 if r < length % SIZE else 0) for r in range(SIZE)])
    check(f"reducescatter n={length}", got.numpy(), np.sum(inputs, axis=0)[bounds[RANK]:bounds[RANK + 1]], "float64")

splits = [[(i + j) % 3 for j in range(SIZE)] for i in range(SIZE)]  # rows rank i sends to rank j
sends = [np.concatenate([np.full((splits[i][j], 2), 100 * i + j, "int64") for j in range(SIZE)]) for i in range(SIZE)]
got, received = hvd.alltoall(torch.from_numpy(sends[RANK]), splits=splits[RANK])
want = np.concatenate([np.full((splits[i][RANK], 2), 100 * i + RANK, "int64") for i in range(SIZE)])
check("alltoall", got.numpy(), want, "int64")
check("alltoall splits", received.numpy(), np.array([splits[i][RANK] for i in range(SIZE)], np.int32), "int32")

tensors = [torch.full((n,), float(RANK)) for n in (1, 100, 3)]
for got, n in zip(hvd.grouped_allreduce(tensors, op=hvd.Sum), (1, 100, 3), strict=True):
    check("grouped_allreduce", got.numpy(), np.full(n, sum(range(SIZE)), np.float32), "float32")
hvd.barrier()
print(f"rank {RANK}: {checks} checks passed")
hvd.shutdown()
