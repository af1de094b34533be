"""docs/internals.md's "Where each concern lives" names every module under hvdrun/, so the map stays whole."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvdrun"
PAGE = ROOT / "docs" / "internals.md"
SECTION = "## Where each concern lives"
MIRROR = "compat/horovod/"  # Horovod's module paths, named in the map as one entry


def _only_reexports(path: Path) -> bool:
    """An ``__init__.py`` that defines nothing of its own: a docstring and imports, at most a lazy
    ``__getattr__`` that hands out another module's names."""
    tree = ast.parse(path.read_text())
    defined = [node for node in tree.body if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)]
    return all(node.name == "__getattr__" for node in defined)


def _modules() -> list[str]:
    """Every module of the package that the map must name, relative to ``hvdrun/``."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if "__pycache__" in path.parts or relative.startswith(MIRROR):
            continue
        if path.name == "__init__.py" and _only_reexports(path):
            continue
        found.append(relative)
    return found


def _map_text() -> str:
    """The map section of the page: from its heading to the next heading of the same level."""
    text = PAGE.read_text()
    start = text.index(f"\n{SECTION}\n")
    end = text.find("\n## ", start + len(SECTION) + 2)
    return text[start:end if end != -1 else len(text)]


def _named(relative: str, text: str) -> bool:
    """Whether ``relative`` (``launch/stage_tree.py``) appears as a whole path, not as the tail of a longer one."""
    return re.search(rf"(?<![\w/.-]){re.escape(relative)}(?![\w/])", text) is not None


def test_the_package_has_modules_to_map():
    modules = _modules()
    assert "launch/stage_tree.py" in modules and "runtime/compiled/__init__.py" in modules
    assert "launch/__init__.py" not in modules  # a docstring only


def test_every_module_under_hvdrun_is_named_in_the_internals_map():
    text = _map_text()
    missing = [relative for relative in _modules() if not _named(relative, text)]
    assert not missing, (f"docs/internals.md, section {SECTION!r}, does not name {', '.join(missing)}: add each, "
                         "relative to hvdrun/, with the concern it is the home of")


def test_the_map_names_the_compiled_modules_c_source_and_the_horovod_mirror():
    text = _map_text()
    assert _named("runtime/compiled/uniform_steps.c", text)
    assert (PACKAGE / "runtime" / "compiled" / "uniform_steps.c").exists()
    assert f"`{MIRROR}**`" in text


def test_every_path_the_map_names_exists():
    named = re.findall(r"`((?:\w+/)*\w+\.(?:py|c))`", _map_text())
    absent = [relative for relative in named if not relative.startswith("tests/") and not (PACKAGE / relative).exists()]
    assert not absent, f"docs/internals.md's map names modules that are not under hvdrun/: {', '.join(absent)}"
