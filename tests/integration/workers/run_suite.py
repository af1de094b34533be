"""Runs pytest on the file given, in this rank (every rank of a job runs it: Horovod's way of running its suite in
one job, for ranks started without hvdrun's launcher)."""

import sys

import pytest

sys.exit(pytest.main(["-q", "-rA", "-p", "no:cacheprovider", "--noconftest", "-o", "addopts=", *sys.argv[1:]]))
