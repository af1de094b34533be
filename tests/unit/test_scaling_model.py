"""The cost model's negotiation (``benchmarks/scaling.py``): a cycle of held (cached) ops sends one tally a merge
step whatever the number of ranks, where every rank's announcement reaching every rank grows with N."""

from __future__ import annotations

import pytest

from tests.benchmark_module import benchmark_module


@pytest.fixture(scope="module")
def scaling():
    with benchmark_module("scaling") as module:
        yield module


def link_bytes_per_step(scaling, hosts: int, per_host: int, held: int | None) -> float:
    cost = scaling.hier_allgather(hosts, per_host, 20, held)
    return cost["beta"] / cost["alpha"]  # alpha counts the steps across hosts


def test_a_held_cycle_moves_the_same_bytes_a_step_at_any_size_and_the_general_form_grows(scaling):
    held = [link_bytes_per_step(scaling, hosts, 12, 128) for hosts in (4, 1024, 4096)]
    general = [link_bytes_per_step(scaling, hosts, 12, None) for hosts in (4, 1024, 4096)]
    assert held == [128] * 3, held  # the host's leader sends one tally a step (its 11 others none)
    assert general[0] < general[1] < general[2] and general[2] > 100 * held[2], general


def test_the_default_setting_models_held_cycles_and_without_them_the_same_steps_move_more_bytes(scaling):
    setting = scaling.Setting()
    assert setting.held_bytes == 128
    before = scaling.Setting(held_bytes=None)
    for hosts in (64, 4096):
        now = scaling.hvdrun_cost("auto", hosts, 12, 16 << 20, setting)[0]
        then = scaling.hvdrun_cost("auto", hosts, 12, 16 << 20, before)[0]
        assert now["alpha"] == then["alpha"] and now["beta"] < then["beta"], (hosts, now, then)


def test_shapes_held_out_of_the_fit_are_each_compared_and_counted(scaling):
    """``--check``: every point of a shape the fit did not see counts in the error summary, MPI sharing cores too."""
    params = dict(scaling.START)
    setting = scaling.Setting()
    exact = scaling.Point("hvdrun auto", 3, 2, 4 << 10, 1.0, 2)
    model = scaling.point_cost(exact, setting, True)[0].seconds(params)
    points = [scaling.Point("hvdrun auto", 3, 2, 4 << 10, model, 2),  # the model exactly: error 0
              scaling.Point("MPI", 6, 1, 4 << 10, 2 * scaling.point_cost(
                  scaling.Point("MPI", 6, 1, 4 << 10, 1.0, 2), setting, True)[0].seconds(params), 2)]  # half: -50%
    table = scaling.check_table(points, params, setting, True, held_out=True)
    assert "| +0% |" in table and "| -50% |" in table, table
    assert "Median |error| 25%, largest 50%, over the 2 points of shapes the fit did not see" in table, table
    assert "Median |error| 0%" in scaling.check_table(points, params, setting, True), "fitted: MPI 6 x 1 left out"


def test_compiled_steps_cost_one_python_turn_per_cycle_at_any_number_of_hosts(scaling):
    """A held cycle's steps across hosts (MPICH's fold for a non-power-of-two host count included) run in one
    compiled call: gamma once per cycle at 2, 6 or 4,096 hosts, with data (a lone eager op) or without (a held
    range); every step still pays alpha. Without the module (sweeps before it), a gamma a step; and the general
    form's negotiation (nothing held) stays Python's."""
    def gamma(hosts: int, compiled: bool, nbytes: int = 4096, held: int | None = 128) -> float:
        return scaling.merged_eager(hosts, 1, 20, nbytes, held, compiled).get("gamma", 0.0)

    assert [gamma(hosts, True) for hosts in (2, 6, 1024, 4096)] == [1, 1, 1, 1]
    assert [gamma(hosts, False) for hosts in (2, 6, 1024, 4096)] == [1, 4, 10, 12]
    assert gamma(1024, True, nbytes=0) == 1 and gamma(1024, True, nbytes=0, held=None) == 10
    cost = scaling.merged_eager(1024, 12, 20, 4096, 128, True)
    assert cost["alpha"] == 10 and cost["gamma"] == 1  # ten steps across; the board's rounds inside the one call
    assert cost["alpha_local"] == 2  # the host's posts, then the leader's result


def test_compiled_doubling_pays_one_python_turn_and_its_fold_stays_python(scaling):
    assert scaling.cross_hosts("doubling", 1024, 65536, compiled=True)["gamma"] == 1
    assert scaling.cross_hosts("doubling", 1024, 65536)["gamma"] == 10
    assert scaling.cross_hosts("doubling", 6, 65536, compiled=True)["gamma"] == 3  # two fold steps in Python
    assert scaling.cross_hosts("halving", 1024, 65536, compiled=True)["gamma"] == 20  # Rabenseifner: Python's


def test_a_buffer_that_fits_a_post_crosses_the_host_in_two_board_rounds_whatever_its_ranks(scaling):
    """Inside the host, up to a post's size: two Python turns at 2, 4 or 12 ranks a host, where the host's rings
    take 2 (L - 1); past it, the rings."""
    post = scaling.POST_BYTES
    assert [scaling.local_phases(per_host, 64 << 10)["gamma"] for per_host in (2, 4, 12)] == [2, 2, 2]
    assert [scaling.local_phases(per_host, post + 8)["gamma"] for per_host in (2, 4, 12)] == [2, 6, 22]
    assert scaling.local_phases(1, 64 << 10) == {}  # one rank a host: nothing inside it


def test_a_hosts_leader_alone_crosses_so_its_link_carries_one_copy_of_the_data(scaling):
    """A lone eager op at 12 ranks a host: each step across hosts moves one tally and the data (the leader's), not
    twelve; the others read the job's value from the board."""
    cost = scaling.merged_eager(4096, 12, 20, 4096, 128, True)
    assert cost["beta"] == 12 * (128 + 4096), cost  # twelve steps of one copy


def test_the_model_with_the_fitted_parameters_meets_the_issues_thousand_host_targets(scaling):
    """At 1,024 and 4,096 hosts x 12 (docs/scaling.md's fitted alpha, beta, gamma): a 4 KB and a 64 KB allreduce as
    the runtime picks them within 2x MPI's time, and a cached cycle's coordination within 0.5 ms."""
    params = {"alpha": 16.96e-6, "beta": 0.558e-9, "gamma": 9.80e-6, **scaling.FIXED}
    setting = scaling.Setting()
    for hosts in (1024, 4096):
        for nbytes in (4 << 10, 64 << 10):
            hvdrun, _ = scaling.column_time("hvdrun rules", hosts, 12, nbytes, setting, params)
            mpi, _ = scaling.column_time("MPI", hosts, 12, nbytes, setting, params)
            assert hvdrun <= 2 * mpi, (hosts, nbytes, hvdrun / mpi)
        cycle = scaling.hier_allgather(hosts, 12, setting.message_bytes, setting.held_bytes, setting.compiled_steps)
        assert cycle.seconds(params) <= 0.5e-3, (hosts, cycle.seconds(params))
