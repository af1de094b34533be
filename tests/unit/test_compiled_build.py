"""What ``pip install`` builds: the compiled module goes into a platform wheel, and the wheel's module loads; without a
compiler the wheel is pure Python and the install says so in one note (``hatch_build.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LIBRARY = "hvdrun/runtime/compiled/_uniform_steps.so"


def build_wheel(out: Path, **env: str) -> tuple[Path, str]:
    pytest.importorskip("hatchling")  # the dev extra's: the wheel is built from this checkout, no isolation
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-v", "-w",
                           str(out), str(REPO)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **env}, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    [wheel] = out.glob("hvdrun-*.whl")
    return wheel, done.stdout + done.stderr


def test_the_wheel_carries_the_compiled_module_and_it_loads(tmp_path):
    wheel, _ = build_wheel(tmp_path / "wheel")
    assert wheel.name.endswith("linux_x86_64.whl") or "-none-any" not in wheel.name
    with zipfile.ZipFile(wheel) as archive:
        assert LIBRARY in archive.namelist()
        archive.extractall(tmp_path / "installed")
    from hvdrun.runtime import compiled

    library = compiled.load({}, tmp_path / "installed" / LIBRARY)  # the wheel's own, at this source's interface
    assert library is not None and library.hvdrun_uniform_steps_abi() == compiled.ABI_VERSION


def test_without_a_compiler_the_wheel_is_pure_python_with_one_note(tmp_path):
    wheel, output = build_wheel(tmp_path / "wheel", CC="/bin/false")
    assert wheel.name.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert LIBRARY not in archive.namelist()
    assert "hvdrun: note: the compiled module was not built (/bin/false failed on " in output
