"""The host agents' pure parts: the tree's shape, their wire format, the tagged lines, the plan of a rank."""

from __future__ import annotations

import io
import os
import sys

import pytest

from hvdrun.hosts import Host
from hvdrun.launch.agent_forest import AgentHost, agent_tree, lost_note, plan_entry, tree_nodes
from hvdrun.launch.launcher import WorkerSpec
from hvdrun.launch.remote.connections import SshTarget
from hvdrun.launch.remote.host_agent.messages import MAX_FRAME_BYTES, frame, read_frame, subtree
from hvdrun.launch.remote.lines import tag, untag
from hvdrun.ranks import Slot


def depth(tree: dict[int, list[int]], node: int = -1) -> int:
    return max((1 + depth(tree, child) for child in tree[node]), default=0)


def test_the_tree_of_the_docstring():
    tree = agent_tree(10, 3)
    assert tree[-1] == [0, 1, 2] and tree[0] == [3, 4, 5] and tree[1] == [6, 7, 8] and tree[2] == [9]
    assert all(tree[index] == [] for index in range(3, 10))


@pytest.mark.parametrize(("count", "fanout", "levels"), [(1, 32, 1), (32, 32, 1), (33, 32, 2), (1056, 32, 2),
                                                          (1057, 32, 3), (32, 4, 3), (4, 2, 2), (5, 1, 5)])
def test_every_host_is_reached_once_and_the_tree_is_as_shallow_as_the_fanout_allows(count, fanout, levels):
    tree = agent_tree(count, fanout)
    reached = [child for children in tree.values() for child in children]
    assert sorted(reached) == list(range(count))
    assert all(len(children) <= fanout for children in tree.values())
    assert depth(tree) == levels


def test_a_fanout_below_one_is_refused():
    with pytest.raises(ValueError, match="at least 1"):
        agent_tree(4, 0)


def test_nodes_carry_targets_commands_and_children():
    hosts = [AgentHost(f"h{i}", SshTarget(f"h{i}", f"10.0.0.{i}", 22, "root", ("/k",)), f"start h{i}", 2 * (i == 0))
             for i in range(5)]
    roots = tree_nodes(hosts, 2)
    assert [root["name"] for root in roots] == ["h0", "h1"]
    assert [node["name"] for node in subtree(roots[0])] == ["h0", "h2", "h3"]
    assert [node["name"] for node in subtree(roots[1])] == ["h1", "h4"]
    assert roots[0]["target"] == ["h0", "10.0.0.0", 22, "root", ("/k",)] and roots[0]["ports"] == 2
    assert roots[1]["children"][0]["command"] == "start h4"


def test_frames_round_trip_and_end_cleanly():
    stream = io.BytesIO(frame(("plan", 3, [(5, ["5", "--", "x"], {"A": "b"}, "/w")])) + frame(("signal", 3, None, 75)))
    assert read_frame(stream.read) == ("plan", 3, [(5, ["5", "--", "x"], {"A": "b"}, "/w")])
    assert read_frame(stream.read) == ("signal", 3, None, 75)
    assert read_frame(stream.read) is None
    truncated = io.BytesIO(frame(("plan", 1, []))[:-1])
    assert read_frame(truncated.read) is None
    with pytest.raises(ValueError, match="at most"):
        read_frame(io.BytesIO((MAX_FRAME_BYTES + 1).to_bytes(4, "big")).read)


@pytest.mark.parametrize("line", [b"text\n", b"progress\r", b"windows\r\n", b"no terminator", b"", b"[9]<exit>:1\n"])
def test_tagged_lines_give_back_what_was_written(line):
    tagged = tag(7, "stdout", line)
    assert tagged.endswith((b"\n", b"\r")) and tagged.count(b"\n") <= 1
    assert untag(tagged) == (7, "stdout", line)


def test_untagged_lines_are_not_taken_for_tagged_ones():
    assert untag(b"mpiexec: warning\n") is None
    assert untag(b" [1]<stdout>:x\n") is None


def test_a_ranks_plan_keeps_its_secret_off_the_command_line_and_its_hosts_python_first():
    slot = Slot(rank=3, local_rank=1, cross_rank=1, size=4, local_size=2, cross_size=2, host=Host("h2", 2),
                host_index=1)
    env = {"HVDRUN_SECRET": "s", "HVDRUN_JOB_ID": "j", "HVDRUN_RANK": "3", "HOME": "/mine", "PATH": "/usr/bin"}
    rank, guard_argv, rank_env, cwd = plan_entry(WorkerSpec(slot, ("/opt/py/bin/python", "t.py"), env, "/w",
                                                            "/opt/py/bin/python"), 2.5)
    assert (rank, cwd) == (3, "/w") and guard_argv[0] == "2.5" and guard_argv[-3:] == ["--", "/opt/py/bin/python",
                                                                                         "t.py"]
    assert "--track" in guard_argv and "s" not in guard_argv
    assert rank_env["HVDRUN_SECRET"] == "s" and "HOME" not in rank_env  # the host's own login HOME stays
    assert rank_env["PATH"] == "/opt/py/bin:/usr/bin"
    same = plan_entry(WorkerSpec(slot, ("t",), env, "/w", sys.executable), 1)[2]
    assert same["PATH"] == "/usr/bin"


def test_a_lost_host_names_the_hosts_that_went_with_it():
    lost = {"host": "h1", "status": -1, "stderr": "", "beneath": ["h3", "h4", "h5", "h6"]}
    assert lost_note("h1", lost) == ("lost its SSH connection (host h1 down, or sshd killed the session); the ranks "
                                     "of the 4 host(s) reached through it went with it: h3, h4, h5 and 1 more")
    assert lost_note("h4", lost).startswith("lost its SSH connection (through h1: ")
    crashed = lost_note("h1", {"host": "h1", "status": 1, "stderr": "Traceback\nValueError: bad frame"})
    assert crashed == "lost its SSH connection: hvdrun's agent on h1 ended with exit code 1 (ValueError: bad frame)"


def test_an_agent_that_hears_nothing_from_above_takes_it_for_gone(monkeypatch, capsys):
    """A host above that crashed or was cut off sends no end of file: silence past SILENCE_S ends the agent's stdin
    (and so its ranks), while the pings of a live host above keep it going."""
    from hvdrun.launch.remote.host_agent import main as host_agent

    monkeypatch.setattr(host_agent, "SILENCE_S", 0.2)
    read, write = os.pipe()
    saved = os.dup(0)
    os.dup2(read, 0)
    try:
        os.write(write, b"ping")
        assert host_agent._stdin(16) == b"ping"
        assert host_agent._stdin(16) == b""  # 0.2 s of silence
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)
    assert "heard nothing from above for 0.2 s" in capsys.readouterr().err
