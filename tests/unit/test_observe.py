"""The inspector's side of seeing a running job (issue #35): rates from two samples, hosts folded and the worst
ranks first, the live view's text, the start-up phases, the plots, the report's escaping, the metrics page as
Prometheus' own parser reads it, and optimizer steps counted once each."""

from __future__ import annotations

import re
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import hvdrun.torch as hvd
from hvdrun.errors import UsageError
from hvdrun.observe.charts import line_chart, phase_bars
from hvdrun.observe.metrics import _Collector, parse_address
from hvdrun.observe.rates import Sample, fold_hosts, rates, worst
from hvdrun.observe.report import Binding, JobRecord, StartupTimes, render
from hvdrun.observe.sampler import MAX_POINTS, History
from hvdrun.observe.top import STRAGGLER_MARK, view
from hvdrun.observe.top import render as render_top
from hvdrun.runtime import context
from hvdrun.runtime.forensics import FlightRecorder


def vitals(rank: int, at: float, collectives: int, waited: float, steps: int, host: str = "n0") -> dict:
    return {"rank": rank, "host": host, "pid": 100 + rank, "time": at, "collectives": collectives,
            "bytes": collectives * 1000, "waited_s": waited, "steps": steps, "current": None, "rss": 1 << 20,
            "gpu_bytes": None, "process_start": at - 10, "init_start": at - 5}


def sample(at: float, size: int, per_rank, stragglers: dict | None = None, hosts_of=lambda rank: "n0") -> Sample:
    ranks = {rank: vitals(rank, at, *per_rank(rank), host=hosts_of(rank)) for rank in range(size)}
    if stragglers is not None:
        ranks[0]["stragglers"] = stragglers
    return Sample(ranks, {}, size, at)


def test_rates_are_per_second_of_each_ranks_own_clock_and_a_wait_share_is_at_most_one():
    before = sample(100.0, 3, lambda rank: (10, 1.0, 5))
    after = sample(102.0, 3, lambda rank: (30, 1.0 + [0.5, 3.0, 0.2][rank], 9),
                   stragglers={"window": 40, "ranks": {2: [0.9, 0.03, True]}, "said": []})
    rows = {row.rank: row for row in rates(before, after)}
    assert rows[0].collectives_per_s == 10 and rows[0].bytes_per_s == 10_000 and rows[0].steps_per_s == 2
    assert rows[0].wait_share == 0.25 and rows[1].wait_share == 1.0  # two threads waiting at once: still one share
    assert (rows[2].straggler, rows[2].last_share, rows[2].lag_s) == (True, 0.9, 0.03) and not rows[0].straggler
    first = rates(None, after)  # one sample: counters, no rates yet
    assert all(row.collectives_per_s == 0 and row.collectives == 30 for row in first)


def test_a_large_job_is_folded_into_hosts_and_its_worst_ranks():
    size = 24

    def host(rank: int) -> str:
        return f"x3000c0s{rank // 12}b0n0"

    before = sample(0.0, size, lambda rank: (0, 0.0, 0), hosts_of=host)
    slow = 13
    after = sample(1.0, size, lambda rank: (50, 0.1 if rank == slow else 0.6, 20),
                   stragglers={"window": 500, "ranks": {slow: [0.94, 0.18, True], 5: [0.02, 0.001, False]},
                               "said": [[1.0, "hvdrun: straggler: rank 13 on x3000c0s1b0n0 arrived last ..."]]},
                   hosts_of=host)
    rows = rates(before, after)
    assert [row.rank for row in worst(rows, 3)] == [13, 5, 0]
    hosts = fold_hosts(rows)
    assert [h.host for h in hosts] == ["x3000c0s0b0n0", "x3000c0s1b0n0"] and hosts[1].stragglers == [13]
    assert hosts[0].ranks == list(range(12)) and hosts[0].bytes_per_s == 12 * 50_000
    assert hosts[1].mean_wait_share == pytest.approx((11 * 0.6 + 0.1) / 12) and hosts[1].max_wait_share == 0.6
    assert hosts[1].collectives_per_s_per_rank == 50 and hosts[1].steps_per_s_per_rank == 20
    shown = view("abcd", before, after)
    assert shown["folded"] and len(shown["ranks"]) == 10 and shown["ranks"][0]["rank"] == 13
    text = render_top(shown)
    assert "the 10 worst ranks:" in text and text.count(STRAGGLER_MARK) == 2  # its host's row and its own
    assert re.search(rf"^x3000c0s1b0n0\s+12 .*{STRAGGLER_MARK} \(rank 13\)$", text, re.M), text
    assert text.rstrip().endswith("rank 13 on x3000c0s1b0n0 arrived last ...")


def test_a_small_job_lists_every_rank_and_the_ranks_without_vitals():
    before = sample(0.0, 3, lambda rank: (0, 0.0, 0))
    after = sample(2.0, 3, lambda rank: (8, 0.2, 4))
    del after.ranks[2]
    after.absent[2] = "did not answer within 3 s (busy in code that holds Python's lock?)"
    text = render_top(view("j", before, after))
    assert "ranks:" in text and "RANKS" not in text  # one host: no host table
    assert re.search(r"^\s+2 no vitals: did not answer within 3 s", text, re.M), text


def test_startup_phases_per_host_from_the_launchers_clock():
    times = StartupTimes(started=100.0, spawned=103.0, host_of={0: "a", 1: "a", 2: "b", 3: "b"},
                         reached={"a": 101.0, "b": 102.5}, entered={0: 104.0, 1: 104.5, 2: 105.0, 3: 105.2},
                         joined={0: 106.0, 1: 106.0, 2: 106.1, 3: 106.4}, process_start={0: 103.2, 2: 103.5})
    phases = dict(times.phases())
    assert phases["a"] == pytest.approx([1.0, 2.0, 0.2, 1.3, 1.5])
    assert phases["b"] == pytest.approx([2.5, 0.5, 0.5, 1.7, 1.2])
    never = StartupTimes(started=0.0, spawned=1.0, host_of={0: "c"})  # not reached over SSH; never in init()
    assert dict(never.phases())["c"] == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_plots_draw_every_series_and_say_when_there_is_nothing():
    chart = line_chart("rate", {"rank 0": [(0.0, 1.0), (1.0, 3.0)], "rank <1>": [(0.5, 2.0)]}, "per s")
    assert chart.startswith('<svg class="plot"') and chart.count("<polyline") == 2 and "rank &lt;1&gt;" in chart
    assert "<p class=\"empty\">" in line_chart("rate", {}, "per s")
    bars = phase_bars("start", [("host", [1.0, 0.0, 2.0])], ("a", "b", "c"))
    assert bars.count('class="bar"') == 3


def test_the_history_keeps_a_bounded_number_of_points():
    history = History()
    for index in range(3 * MAX_POINTS):
        taken = sample(float(index), 2, lambda rank, count=index: (count, 0.0, 0))
        history.add(taken, rates(None, taken))
    assert MAX_POINTS // 2 <= len(history.ranks[0]) <= MAX_POINTS and history.ranks[0][0][0] == 0.0
    assert len(history.hosts["n0"]) == len(history.ranks[0])


def test_the_report_escapes_what_the_job_names():
    record = JobRecord("train.py --name '<script>alert(1)</script>'", "j1", "local", 0,
                       [Binding(0, "<b>host</b>", 0, "", "")],
                       StartupTimes(0.0, 1.0, {0: "<b>host</b>"}, entered={0: 2.0}, joined={0: 3.0}), History(),
                       outcome="failed", summary="rank 0 <failed>", exit_code=1, ended=5.0)
    page = render(record)
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>host</b>" not in page and "rank 0 &lt;failed&gt;" in page
    assert page.count("<script>") == 1  # the page's own check of its plots, nothing else


def test_the_metrics_page_parses_with_prometheus_clients_own_parser():
    collector = _Collector("j1")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    families = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    assert families["hvdrun_job_ranks"].samples == []  # before the first sample: no values, still a valid page
    before, after = sample(0.0, 2, lambda rank: (0, 0.0, 0)), sample(1.0, 2, lambda rank: (6, 0.25, 3))
    collector.latest = (after, rates(before, after))
    samples = {(s.name, s.labels.get("rank")): s for f in text_string_to_metric_families(
        generate_latest(registry).decode()) for s in f.samples}
    assert samples[("hvdrun_rank_collectives_total", "1")].value == 6
    assert samples[("hvdrun_rank_wait_share", "0")].value == 0.25
    assert samples[("hvdrun_rank_optimizer_steps_per_second", "0")].labels == {"job": "j1", "rank": "0", "host": "n0"}
    assert ("hvdrun_rank_gpu_memory_bytes", "0") not in samples  # no GPU: no value rather than a made-up 0


@pytest.mark.parametrize(("text", "expected"), [("9400", ("127.0.0.1", 9400)), ("0.0.0.0:0", ("0.0.0.0", 0)),
                                                ("[::1]:9400", ("::1", 9400))])
def test_metrics_addresses(text, expected):
    assert parse_address(text) == expected


@pytest.mark.parametrize("text", ["", "host:", "host:http", "70000"])
def test_bad_metrics_addresses_are_usage_errors(text):
    with pytest.raises(UsageError, match="expected PORT or ADDR:PORT"):
        parse_address(text)


@pytest.fixture
def single_rank(monkeypatch):
    for name in ("HVDRUN_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PALS_RANKID", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    hvd.init()
    yield context.current()
    hvd.shutdown()


def test_an_optimizer_step_counts_once_wrapped_or_not_and_after_a_step_that_raised(single_rank):
    recorder = single_rank.engine.recorder
    model = torch.nn.Linear(2, 1)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                       named_parameters=model.named_parameters())
    model(torch.ones(2)).sum().backward()
    plain.step()
    assert recorder.steps == 1
    wrapped.step()
    wrapped.step()
    assert recorder.steps == 3

    class Failing(torch.optim.SGD):
        def step(self, closure=None):  # torch runs its pre hooks, then no post hook: the step raised
            raise RuntimeError("a step that raised")

    with pytest.raises(RuntimeError):
        Failing(model.parameters(), lr=0.1).step()
    assert recorder.steps == 3
    wrapped.step()
    assert recorder.steps == 4


def test_a_wait_in_progress_counts_and_a_wait_inside_a_wait_counts_once():
    recorder = FlightRecorder()
    outer = recorder.wait_begins(at=time.time() - 2.0)  # a thread blocked for 2 s already: not idle
    assert 1.9 < recorder.waited_s() < 3.0
    inner = recorder.wait_begins()  # the same thread drives the op it waits for
    recorder.wait_ends(inner)
    assert 1.9 < recorder.waited_s()
    recorder.wait_ends(outer, at=time.time())
    done = recorder.waited_s()
    assert 1.9 < done < 3.0 and recorder.waited_s() == done  # ended: no longer grows
    recorder.wait_ends(recorder.wait_begins(at=time.time() + 5.0))  # a clock that stepped back: never negative
    assert recorder.waited_s() == done
