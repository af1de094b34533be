"""Where a cluster file's site facts come from: the ``sources:`` section of a cluster YAML.

A site's facts (queues and their limits, filesystems, module lines, environment variables, the
high-speed interface) are copied from the site's own documentation, and go out of date with it. The
``sources:`` section names, for each fact, the page it was read from, in which version of the
documentation and on what day::

    sources:
      repository: argonne-lcf/user-guides     # the documentation's repository (owner/name)
      commit: 7d04a3f91d5eaf6d731be6d267617c2e5cbe722e
      committed: "2026-08-19"                 # the date of that commit
      read: "2026-11-27"                      # the day the pages were read
      pages:                                  # page -> the keys of this file it gives (a key covers its sub-keys)
        docs/aurora/running-jobs-aurora.md: [scheduler.queues, cpu_bind]

``hvdrun qsub --cluster NAME --explain`` prints every fact with its page (:mod:`hvdrun.jobs.explain`).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from hvdrun.errors import ConfigError

SOURCE_KEYS = ("repository", "commit", "committed", "read", "pages")
_REPOSITORY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")
_COMMIT_RE = re.compile(r"[0-9a-f]{7,40}")
_DATE_RE = re.compile(r"\d{4}-\d{2}-\d{2}")
_PAGE_RE = re.compile(r"[A-Za-z0-9_.-]+(/[A-Za-z0-9_.-]+)*")


@dataclass(frozen=True)
class SiteSources:
    """The pages a cluster file's site facts were read from (see the module docstring).

    Attributes:
        repository: the documentation's repository, ``owner/name``.
        commit: the commit of that repository the pages were read at.
        committed: the date of that commit (``YYYY-MM-DD``), or None.
        read: the day the pages were read (``YYYY-MM-DD``).
        pages: each page's path in the repository -> the keys of the cluster file it gives.
    """

    repository: str
    commit: str
    read: str
    committed: str | None = None
    pages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def pages_of(self, key: str) -> list[str]:
        """The pages that give ``key`` (a page that gives ``scheduler.queues`` gives ``scheduler.queues.debug``)."""
        return [page for page, keys in self.pages.items() if any(covers(given, key) for given in keys)]

    def permalink(self, page: str) -> str:
        """The page at the commit it was read at, on GitHub."""
        return f"https://github.com/{self.repository}/blob/{self.commit}/{page}"


def covers(given: str, key: str) -> bool:
    """Whether the dotted key ``given`` is ``key`` or one of its parents."""
    return key == given or key.startswith(given + ".")


def flatten(data: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Every leaf of a YAML document as (dotted key, value); lists and scalars are leaves.

    Example: ``{"a": {"b": 1, "c": [2]}}`` gives ``("a.b", 1)`` and ``("a.c", [2])``.
    """
    if isinstance(data, dict) and data:
        for key, value in data.items():
            yield from flatten(value, f"{prefix}.{key}" if prefix else str(key))
    elif prefix:
        yield prefix, data


def value_at(data: Any, key: str) -> Any:
    """The value at dotted ``key`` of a YAML document.

    Raises:
        KeyError: the document has no such key.
    """
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            raise KeyError(key)
        data = data[part]
    return data


def parse_sources(data: Any, document: Mapping[str, Any], source: str) -> SiteSources | None:
    """Validate the ``sources:`` section ``data`` of the cluster file ``document`` (read from ``source``).

    Raises:
        ConfigError: a missing or malformed field, or a page naming a key the file does not have.
    """
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: 'sources' must be a mapping with {', '.join(SOURCE_KEYS)}")
    unknown = [str(k) for k in data if k not in SOURCE_KEYS]
    if unknown:
        raise ConfigError(f"{source}: unknown key 'sources.{unknown[0]}'; allowed keys: {', '.join(SOURCE_KEYS)}")
    repository = _text(data, "repository", _REPOSITORY_RE, "owner/name, e.g. argonne-lcf/user-guides", source)
    commit = _text(data, "commit", _COMMIT_RE, "7 to 40 lower-case hex digits", source)
    return SiteSources(repository=repository, commit=commit, read=_date(data, "read", source),
                       committed=_date(data, "committed", source) if "committed" in data else None,
                       pages=_pages(data.get("pages"), document, source))


def _text(data: Mapping[str, Any], key: str, pattern: re.Pattern[str], expected: str, source: str) -> str:
    value = data.get(key)
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ConfigError(f"{source}: 'sources.{key}' must be {expected}, got {value!r}")
    return value


def _date(data: Mapping[str, Any], key: str, source: str) -> str:
    """A ``YYYY-MM-DD`` date, quoted or not (YAML reads an unquoted one as a date)."""
    value = data.get(key)
    if isinstance(value, datetime.date) and not isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, str) and _DATE_RE.fullmatch(value):
        try:
            return datetime.date.fromisoformat(value).isoformat()
        except ValueError:  # 2026-02-30
            pass
    raise ConfigError(f"{source}: 'sources.{key}' must be a date YYYY-MM-DD, e.g. \"2026-11-27\", got {value!r}")


def _pages(data: Any, document: Mapping[str, Any], source: str) -> dict[str, tuple[str, ...]]:
    """``page -> [key, ...]``; every page a relative path, every key one the file has."""
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{source}: 'sources.pages' must map each page to the keys it gives, e.g. "
                          "{docs/aurora/running-jobs-aurora.md: [scheduler.queues]}")
    pages = {}
    for page, keys in data.items():
        where = f"{source}: sources.pages.{page}"
        if not isinstance(page, str) or not _PAGE_RE.fullmatch(page) or ".." in page.split("/"):
            raise ConfigError(f"{source}: 'sources.pages' key {page!r} must be a page's path in the repository, "
                              "e.g. docs/aurora/running-jobs-aurora.md")
        if not isinstance(keys, list) or not keys or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"{where} must list the keys of this file the page gives, e.g. [scheduler.queues]")
        for key in keys:
            try:
                value_at(document, key)
            except KeyError:
                raise ConfigError(f"{where} names '{key}', which is not a key of this file") from None
        pages[page] = tuple(keys)
    return pages
