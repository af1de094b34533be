"""Host sources: -H strings, hostfiles, nodefiles, Slurm hostlists, allocation detection."""

from __future__ import annotations

import pytest

from hvdrun.errors import HostSpecError
from hvdrun.hosts import (
    Host,
    detect_allocation,
    expand_slurm_hostlist,
    parse_host_string,
    parse_hostfile,
    parse_nodefile,
    parse_tasks_per_node,
)


def test_host_string_keeps_order_and_slots():
    assert parse_host_string("b:4,a:2") == (Host("b", 4), Host("a", 2))


def test_host_string_with_user_and_ipv6():
    hosts = parse_host_string("alice@node1:2,[fe80::1]:3,10.0.0.7:1")
    assert hosts == (Host("node1", 2, "alice"), Host("fe80::1", 3), Host("10.0.0.7", 1))
    assert hosts[0].ssh_target == "alice@node1"


@pytest.mark.parametrize("spec, fragment", [
    ("node1", "not host:slots"),
    ("node1:", "slots must be a positive integer"),
    ("node1:0", "slots must be a positive integer"),
    ("node1:-2", "slots must be a positive integer"),
    ("node1:two", "slots must be a positive integer"),
    ("a:1,,b:1", "empty host"),
    ("", "empty host"),
    ("fe80::1:2", "not host:slots"),
    ("[fe80::zz]:2", "not a valid IPv6 address"),
    ("a;rm -rf /:2", "invalid host name"),
    ("$(reboot):1", "invalid host name"),
    ("-oProxyCommand=x:1", "invalid host name"),
    ("bad user@node:1", "invalid user name"),
    ("a:1,a:2", "listed more than once"),
])
def test_host_string_errors_name_the_input(spec, fragment):
    with pytest.raises(HostSpecError, match=fragment):
        parse_host_string(spec)


def test_hostfile_comments_blank_lines_and_bare_hosts(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("# cluster\n\nnode1 slots=4   # first\nbob@node2 slots=2\nnode3\n")
    assert parse_hostfile(path) == (Host("node1", 4), Host("node2", 2, "bob"), Host("node3", 1))


@pytest.mark.parametrize("text, fragment", [
    ("node1 slots=x\n", "line 1: slots must be a positive integer"),
    ("node1\nnode2 max_slots=3\n", "line 2: unknown field 'max_slots=3'"),
    ("# nothing\n\n", "no hosts found"),
    ("node|1 slots=2\n", "invalid host name"),
])
def test_hostfile_errors_name_file_and_line(tmp_path, text, fragment):
    path = tmp_path / "hosts"
    path.write_text(text)
    with pytest.raises(HostSpecError, match=fragment) as info:
        parse_hostfile(path)
    assert str(path) in str(info.value)


def test_missing_hostfile(tmp_path):
    with pytest.raises(HostSpecError, match="cannot read hostfile"):
        parse_hostfile(tmp_path / "absent")


def test_pbs_nodefile_deduplicated_in_order_with_counts(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("x3006c0s13b0n0.hostmgmt\nx1001c0s1b0n0.hostmgmt\nx3006c0s13b0n0.hostmgmt\n\n")
    assert parse_nodefile(path, "PBS") == (Host("x3006c0s13b0n0.hostmgmt", 2), Host("x1001c0s1b0n0.hostmgmt", 1))


def test_empty_nodefile(tmp_path):
    path = tmp_path / "nodefile"
    path.write_text("\n")
    with pytest.raises(HostSpecError, match="Cobalt nodefile .* is empty"):
        parse_nodefile(path, "Cobalt")


@pytest.mark.parametrize("nodelist, expected", [
    ("nid[001-004,007],gpu[1-2]", ["nid001", "nid002", "nid003", "nid004", "nid007", "gpu1", "gpu2"]),
    ("a[1-2],b[08-10]", ["a1", "a2", "b08", "b09", "b10"]),
    ("rack[1-2]-node[01-02]", ["rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"]),
    ("node01,node03", ["node01", "node03"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("single", ["single"]),
])
def test_slurm_hostlists(nodelist, expected):
    assert expand_slurm_hostlist(nodelist) == expected


@pytest.mark.parametrize("nodelist", ["n[3-1]", "n[1-", "n[a-b]"])
def test_bad_slurm_hostlists(nodelist):
    with pytest.raises(HostSpecError, match="SLURM_JOB_NODELIST: cannot expand"):
        expand_slurm_hostlist(nodelist)


def test_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1", 4) == [2, 2, 2, 1]
    with pytest.raises(HostSpecError, match="describes 2 nodes but the nodelist has 3"):
        parse_tasks_per_node("2(x2)", 3)
    with pytest.raises(HostSpecError, match="cannot parse"):
        parse_tasks_per_node("2x3", 3)


def test_detect_allocation_order_and_kinds(tmp_path):
    pbs = tmp_path / "pbs"
    pbs.write_text("p1\np2\n")
    cobalt = tmp_path / "cobalt"
    cobalt.write_text("thetagpu01\n")
    assert detect_allocation({}) is None
    assert detect_allocation({"PBS_NODEFILE": str(pbs), "SLURM_JOB_NODELIST": "n1"}) == (
        "pbs", (Host("p1", 1), Host("p2", 1)))
    assert detect_allocation({"COBALT_NODEFILE": str(cobalt)}) == ("cobalt", (Host("thetagpu01", 1),))
    assert detect_allocation({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_TASKS_PER_NODE": "3(x2)"}) == (
        "slurm", (Host("n1", 3), Host("n2", 3)))


@pytest.mark.parametrize("spec", ["localhost:1\n", "a:1,\nb:1", "a:1\t", "a\r:1"])
def test_a_control_character_inside_a_host_spec_is_refused(spec):
    with pytest.raises(HostSpecError, match="holds a newline or another control character"):
        parse_host_string(spec)


def test_a_hostfile_line_in_the_h_form_gets_the_hostfile_form_as_a_hint(tmp_path):
    path = tmp_path / "hosts"
    path.write_text("h0 slots=1\nalice@h1:2\n")
    with pytest.raises(HostSpecError, match=r"line 2: 'alice@h1:2' is the -H form; .*write 'alice@h1 slots=2'"):
        parse_hostfile(path)
