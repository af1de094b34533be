"""Every dtype torch.distributed takes, through every collective and reduction op, against a float64 reference.

Values are chosen so that the float32 accumulation of float16/bfloat16 is exact: hvdrun's result must then
equal the float64 reference rounded once, bit for bit. NaN and infinities sit at fixed positions and must
propagate as numpy's fold does. Adasum gets different random vectors on every rank and is compared with a float64
reference of Horovod's pairwise adaptive sum (hvdrun combines in float64 and rounds once). Rank 0 prints one
``row`` line per dtype and collective that passed, the largest error of float16/bfloat16 sums of random normal
data in units of the last place of the result, and the dtypes whose blocking allreduces the fast lane served.
"""

import sys

import numpy as np
import torch
from adasum_reference import reference

import hvdrun.torch as hvd
from hvdrun.runtime import context

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
LANE = context.current().engine.lane  # None where the job has no fast lane
FLOATS = ("bfloat16", "float16", "float32", "float64")
INTS = ("uint8", "int8", "int16", "int32", "int64")
OPS = {hvd.Sum: ("sum", np.add), hvd.Average: ("average", np.add), hvd.Min: ("min", np.minimum),
       hvd.Max: ("max", np.maximum), hvd.Product: ("product", np.multiply)}
rows: list[str] = []
lane_served: dict[str, int] = {}  # dtype: blocking allreduces the fast lane took


def values(seed: int, dtype: str, n: int, op: int) -> np.ndarray:
    """Float64 values every dtype holds exactly, whose float32 sums and products are exact too."""
    rng = np.random.default_rng(seed)
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(np.float64)
    if op == hvd.Product:
        pool = [1, 2] if dtype == "uint8" else [-1, 1, 2] if dtype in INTS else [-1, 0.5, 1, 2]
    elif dtype in INTS:
        pool = list(range(0, 21)) if dtype == "uint8" else list(range(-20, 21))
    else:
        pool = [-2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3]
    return rng.choice(pool, n).astype(np.float64)


def with_specials(array: np.ndarray, rank: int, dtype: str) -> np.ndarray:
    """NaN on rank 1 at 0, +inf on rank 0 at 1, -inf on rank 0 and +inf on rank 1 at 2 (floats only)."""
    if dtype in FLOATS and array.size >= 3:
        array = array.copy()
        specials = {0: {0: 1.0, 1: np.inf, 2: -np.inf}, 1: {0: np.nan, 1: 1.0, 2: np.inf}}.get(rank, {})
        for index, value in specials.items():
            array[index] = value
    return array


def tensor(array: np.ndarray, dtype: str) -> torch.Tensor:
    return torch.from_numpy(array).to(getattr(torch, dtype))


def expected(inputs: list[np.ndarray], op: int, dtype: str) -> torch.Tensor:
    fold = OPS[op][1]
    total = inputs[0].copy()
    for other in inputs[1:]:
        total = fold(total, other)
    if op == hvd.Average:
        total = total / SIZE
    if dtype in INTS:
        total = np.trunc(total)
    return tensor(total, dtype)


def same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    a, b = got.to(torch.float64).numpy(), want.to(torch.float64).numpy()
    assert np.array_equal(a, b, equal_nan=True), f"{what}: {a[:6]} != {b[:6]}"


def ops_for(dtype: str) -> list[int]:
    return [hvd.Min, hvd.Max] if dtype == "bool" else list(OPS)


def check_allreduce(dtype: str, case: int) -> None:
    for op in ops_for(dtype):
        name = OPS[op][0]
        for n, how in ((5, "blocking"), (70_000, "blocking"), (300, "async"), (300, "grouped")):
            inputs = [with_specials(values(case * 97 + r, dtype, n, op), r, dtype) for r in range(SIZE)]
            mine, want = tensor(inputs[RANK], dtype), expected(inputs, op, dtype)
            if how == "async":
                got = hvd.synchronize(hvd.allreduce_async(mine, op=op))
            elif how == "grouped":
                got = hvd.grouped_allreduce([mine, mine.clone()], op=op)[1]
            else:
                before = LANE.used if LANE is not None else 0
                got = hvd.allreduce_(mine, op=op)
                if LANE is not None and LANE.used > before:
                    lane_served[dtype] = lane_served.get(dtype, 0) + 1
            same(got, want, f"allreduce {dtype} {name} n={n} {how}")
        rows.append(f"{dtype} allreduce-{name}")


def my_block(full: torch.Tensor) -> torch.Tensor:
    """This rank's block of dim 0 after a reducescatter: the first ``len % SIZE`` ranks get one more row."""
    sizes = [len(full) // SIZE + (1 if r < len(full) % SIZE else 0) for r in range(SIZE)]
    return full[sum(sizes[:RANK]):sum(sizes[:RANK + 1])]


def check_reducescatter(dtype: str, case: int) -> None:
    """Every op alone, and grouped with a second tensor of another shape (rows not divisible by the size)."""
    for op in ops_for(dtype):
        name = OPS[op][0]
        inputs = [with_specials(values(case * 89 + r, dtype, 2 * SIZE + 1, op), r, dtype) for r in range(SIZE)]
        got = hvd.reducescatter(tensor(inputs[RANK], dtype), op=op)
        same(got, my_block(expected(inputs, op, dtype)), f"reducescatter {dtype} {name}")
        rows.append(f"{dtype} reducescatter-{name}")
        second = [values(case * 83 + r, dtype, 3 * (SIZE + 1), op).reshape(SIZE + 1, 3) for r in range(SIZE)]
        first_out, second_out = hvd.grouped_reducescatter([tensor(inputs[RANK], dtype), tensor(second[RANK], dtype)],
                                                          op=op)
        same(first_out, got, f"grouped reducescatter {dtype} {name} first")
        same(second_out, my_block(expected(second, op, dtype)), f"grouped reducescatter {dtype} {name} second")
    rows.append(f"{dtype} grouped-reducescatter")


def check_movement(dtype: str, case: int) -> None:
    parts = [tensor(with_specials(values(case + r, dtype, 3 * (r + 1), hvd.Sum), r, dtype), dtype).reshape(r + 1, 3)
             for r in range(SIZE)]
    same(hvd.allgather(parts[RANK]), torch.cat(parts), f"allgather {dtype}")
    rows.append(f"{dtype} allgather")
    vectors = [tensor(values(case * 5 + r, dtype, 2 * (SIZE - r), hvd.Sum), dtype) for r in range(SIZE)]
    gathered = hvd.grouped_allgather([parts[RANK], vectors[RANK]])
    same(gathered[0], torch.cat(parts), f"grouped allgather {dtype} first")
    same(gathered[1], torch.cat(vectors), f"grouped allgather {dtype} second")
    rows.append(f"{dtype} grouped-allgather")
    for root in range(SIZE):
        mine = parts[RANK][:1].clone() if RANK == root else torch.zeros((1, 3), dtype=parts[0].dtype)
        same(hvd.broadcast(mine, root_rank=root), parts[root][:1], f"broadcast {dtype} root={root}")
    rows.append(f"{dtype} broadcast")
    blocks = [[tensor(values(case * 7 + 10 * i + j, dtype, 2 * (j + 1), hvd.Sum), dtype) for j in range(SIZE)]
              for i in range(SIZE)]
    got, received = hvd.alltoall(torch.cat(blocks[RANK]), splits=[2 * (j + 1) for j in range(SIZE)])
    same(got, torch.cat([blocks[i][RANK] for i in range(SIZE)]), f"alltoall {dtype}")
    rows.append(f"{dtype} alltoall")


def check_adasum(dtype: str, case: int) -> None:
    """Different vectors on every rank against the float64 reference of the same (rounded) inputs: hvdrun combines
    in float64 and rounds once, so every element is within one unit in the last place of its dtype (float64: the
    same arithmetic, within a few units of the largest element)."""
    inputs = [tensor(np.random.default_rng(case * 31 + r).normal(size=(4, 16)), dtype) for r in range(SIZE)]
    want = reference([t.double().numpy() for t in inputs])
    got = hvd.allreduce(inputs[RANK], op=hvd.Adasum)
    assert got.dtype == inputs[RANK].dtype and got.shape == inputs[RANK].shape, f"adasum {dtype}: {got.dtype}"
    info = torch.finfo(getattr(torch, dtype))
    error = np.abs(got.double().numpy().ravel() - want)
    if dtype == "float64":
        assert error.max() <= 8 * info.eps * np.abs(want).max(), f"adasum {dtype}: {error.max()}"
    else:
        ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(want), info.tiny)))) * info.eps
        assert (error <= ulp).all(), f"adasum {dtype}: {(error / ulp).max():.2f} ulp"
    rows.append(f"{dtype} adasum")


def check_bool_refusals() -> None:
    for op in (hvd.Sum, hvd.Average, hvd.Product):
        try:
            hvd.allreduce(torch.ones(3, dtype=torch.bool), op=op)
        except ValueError as e:
            assert "Min (logical and) or Max (logical or)" in str(e), e
        else:
            raise AssertionError(f"bool {OPS[op][0]} was not refused")
    rows.append("bool refuses-sum-average-product")


def check_mixed_dtypes_refused() -> None:
    """float16 on rank 0, bfloat16 elsewhere: both travel as float32, yet the ranks must hear of the mismatch."""
    mine = torch.ones(4, dtype=torch.float16 if RANK == 0 else torch.bfloat16)
    try:
        hvd.allreduce(mine, name="mixed", op=hvd.Sum)
    except hvd.HorovodInternalError as e:
        assert "dtype differs across ranks (rank 0: float16; rank" in str(e), e
    else:
        raise AssertionError("float16 against bfloat16 was not refused")
    rows.append("float16-against-bfloat16 refused")


def largest_error_ulps(dtype: str) -> float:
    """Sums of random normal values: hvdrun's result against the float64 sum of the same (rounded) inputs."""
    inputs = [torch.from_numpy(np.random.default_rng(500 + r).normal(size=20_000)).to(getattr(torch, dtype))
              for r in range(SIZE)]
    got = hvd.allreduce(inputs[RANK], op=hvd.Sum).double()
    exact = sum(t.double() for t in inputs)
    ulp = torch.from_numpy(np.spacing(np.abs(got.numpy()).astype(np.float32)).astype(np.float64))
    ulp *= 2.0 ** (23 - (7 if dtype == "bfloat16" else 10))  # the spacing of float32, widened to this dtype's
    return float(((got - exact).abs() / ulp).max())


for index, dtype in enumerate(INTS + FLOATS + ("bool",)):
    check_allreduce(dtype, 10 * index + 1)
    check_reducescatter(dtype, 10 * index + 2)
    check_movement(dtype, 10 * index + 3)
    if dtype in FLOATS:
        check_adasum(dtype, 10 * index + 4)
check_bool_refusals()
check_mixed_dtypes_refused()
errors = {dtype: largest_error_ulps(dtype) for dtype in ("bfloat16", "float16")}
assert max(errors.values()) <= 0.5, errors  # one rounding of an exact float32 sum
# one write per rank, the table after a barrier: unprefixed output of mpiexec's ranks must not interleave
sys.stdout.write(f"rank {RANK}: {len(rows)} dtype checks passed\n")
sys.stdout.flush()
hvd.barrier()
if RANK == 0:
    precision = " ".join(f"{dtype}={error:.3f}ulp" for dtype, error in errors.items())
    served = " ".join(f"{dtype}={count}" for dtype, count in lane_served.items())
    sys.stdout.write("".join(f"row {row}\n" for row in rows) + f"precision {precision}\nlane served {served}\n")
    sys.stdout.flush()
hvd.shutdown()
