"""The start-up model's rendezvous (``benchmarks/startup_model.py``): with the rendezvous tree, the admissions in a
row grow with its depth (a logarithm of the hosts), not with the hosts; every record still reaches rank 0."""

from __future__ import annotations

import pytest

from tests.benchmark_module import benchmark_module


@pytest.fixture(scope="module")
def model():
    with benchmark_module("startup_model") as module:
        yield module


def test_admissions_grow_with_the_trees_depth_and_records_with_the_ranks(model):
    p = model.Params(c_row=0.0, alpha=0.0)  # the admissions alone
    assert model.rendezvous_time(p, 33, 12) == pytest.approx(33 * p.c_join)  # rank 0 admits every host
    admissions = [model.rendezvous_time(p, hosts, 12) / (p.rendezvous_fanout * p.c_join) for hosts in
                  (34, 1_024, 4_096, 32_768)]
    assert admissions == pytest.approx([2, 2, 3, 3])  # levels of at most 32 admissions each
    without = model.rendezvous_time(p, 4_096, 12, tree=False)
    assert without == pytest.approx(4_096 * p.c_join) and without > 40 * model.rendezvous_time(p, 4_096, 12)
    records = model.Params(c_join=0.0, alpha=0.0)
    assert model.rendezvous_time(records, 4_096, 12) == pytest.approx(4_096 * 12 * records.c_row)


def test_the_tree_reads_the_source_once_and_grows_by_its_depth(model):
    fs = model.FileSystem(c_start=0.0)
    assert [model.source_bytes(fs, hosts, "tree") for hosts in (32, 1_024, 4_096)] == [fs.env_bytes] * 3
    assert model.source_bytes(fs, 1_024, "packed") == 1_025 * fs.env_bytes  # the pack, then every host
    assert [model.tree_depth(hosts, 4) for hosts in (1, 2, 5, 6, 21, 22, 1_024, 4_096)] == [0, 1, 1, 2, 2, 3, 5, 6]
    rate = min(fs.client_bw, fs.link_bw / fs.stage_fanout, fs.unpack_bw, fs.relay_bw)
    level = fs.chunk / rate
    assert model.fs_time(fs, 4_096, "tree") - model.fs_time(fs, 1_024, "tree") == pytest.approx(level)


def test_the_shared_file_systems_storm_grows_with_the_nodes(model):
    fs = model.FileSystem()
    storm = model.fs_time(fs, 4_096, "shared") - model.fs_time(fs, 1_024, "shared")
    assert storm == pytest.approx(3_072 * (fs.import_ops / fs.md_rate + fs.import_bytes / fs.fs_bw))
    assert model.fs_time(fs, 4_096, "copper") < model.fs_time(fs, 4_096, "shared") / 10
    with pytest.raises(ValueError, match="unknown way"):
        model.fs_time(fs, 2, "nfs")
