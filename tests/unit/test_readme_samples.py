"""The README's sample outputs show what the tool prints."""

from __future__ import annotations

from pathlib import Path

from hvdrun.health.check import CheckOptions, human_bytes

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_check_sample_shows_the_bandwidth_size_check_uses():
    sample = README.read_text()
    assert f" bandwidth   allreduce of {human_bytes(CheckOptions.bandwidth_bytes)} " in sample
