"""How the compiled module is built: the C compiler, its flags, an atomic build. The standard library only, and
nothing of hvdrun: the package's build hook (``hatch_build.py``, run by ``pip install``) loads this file by its path,
before hvdrun or numpy can be imported."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

SOURCE_NAME = "uniform_steps.c"
LIBRARY_NAME = "_uniform_steps.so"
# -fno-trapping-math: FP compares may be evaluated for every element (no trap is assumed), so the reductions
# with their NaN rule vectorize; results are the same bits
FLAGS = ("-O2", "-ftree-vectorize", "-fno-trapping-math", "-fwrapv", "-shared", "-fPIC", "-std=c11", "-D_GNU_SOURCE")


def compile_library(output: Path, source: Path) -> str | None:
    """Compile ``source`` into ``output`` with the system's C compiler (``$CC``, else cc or gcc), atomically (a rank
    that loads it meanwhile sees the old library or the new one); None when it worked, else why not."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return "no C compiler found (set CC, or install gcc)"
    partial = output.with_suffix(f".{os.getpid()}.tmp")
    try:
        result = subprocess.run([compiler, *FLAGS, "-o", str(partial), str(source)], capture_output=True, text=True,
                                check=False)
    except OSError as e:
        return f"cannot run {compiler}: {e}"
    if result.returncode:
        partial.unlink(missing_ok=True)
        return f"{compiler} failed on {source}:\n{result.stderr.strip()}"
    partial.replace(output)
    return None
