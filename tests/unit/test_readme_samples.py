"""The README's samples show what the tool prints and accepts."""

from __future__ import annotations

import shlex
from pathlib import Path

from hvdrun.health.check import CheckOptions, human_bytes

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_check_sample_shows_the_bandwidth_size_check_uses():
    sample = README.read_text()
    assert f" bandwidth   allreduce of {human_bytes(CheckOptions.bandwidth_bytes)} " in sample


def test_every_hosts_sample_is_a_valid_plan():
    from hvdrun.hosts import parse_host_string
    from hvdrun.ranks import assign_slots

    lines = [line.removeprefix("$ ") for line in README.read_text().splitlines()]
    samples = [line.split("#")[0].replace("$(hostname)", "node0") for line in lines
               if line.startswith("hvdrun ") and " -H " in line]
    assert len(samples) >= 6
    for sample in samples:
        words = shlex.split(sample)
        hosts = parse_host_string(words[words.index("-H") + 1])
        if "-np" in words:
            assign_slots(hosts, int(words[words.index("-np") + 1]))  # -np within the slots
