"""The package's build hook: ``pip install`` compiles hvdrun's optional compiled module
(``hvdrun/runtime/compiled``) with the system's C compiler, into the wheel (a platform wheel then) or, for an
editable install, next to its source. Without a compiler, or when it fails, the install goes on with one note and
hvdrun runs its pure-Python path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

COMPILED = Path("hvdrun", "runtime", "compiled")


class CompiledModuleHook(BuildHookInterface):  # type: ignore[misc]
    """Builds ``_uniform_steps.so`` before the wheel is assembled."""

    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        here = Path(self.root) / COMPILED
        toolchain = _toolchain(here / "toolchain.py")
        library = here / toolchain.LIBRARY_NAME
        problem = toolchain.compile_library(library, here / toolchain.SOURCE_NAME)
        if problem is not None:
            self.app.display_warning(f"hvdrun: note: the compiled module was not built ({problem.splitlines()[0]}); "
                                     "hvdrun runs its pure-Python path (python -m hvdrun.runtime.compiled builds it "
                                     "later)")
            return
        if version != "editable":  # an editable install loads it from the source tree, where it now is
            build_data["pure_python"] = False
            build_data["infer_tag"] = True
            build_data["force_include"][str(library)] = str(COMPILED / toolchain.LIBRARY_NAME)


def _toolchain(path: Path) -> Any:
    """hvdrun's toolchain module, loaded by its path (hvdrun and numpy are not importable while it builds)."""
    spec = importlib.util.spec_from_file_location("hvdrun_build_toolchain", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
