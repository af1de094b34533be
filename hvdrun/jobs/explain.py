"""``hvdrun qsub --cluster NAME --explain``: every fact of a cluster file, with the page it was read from.

A site's queues, limits, filesystems, module lines and variables go out of date with the site's
documentation; the file's ``sources:`` section (:mod:`hvdrun.site_sources`) says which page gave each one,
at which commit and on which day. This prints them page by page, with a link to the page as it was read,
then the settings that no page gives (hvdrun's own choices), so that a user can check any value against
its page before trusting a job to it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hvdrun.config import ClusterConfig, load_cluster_config
from hvdrun.errors import ConfigError, UsageError
from hvdrun.site_sources import SiteSources, flatten

_NOT_FACTS = ("name", "description", "sources")  # the file's own words, not facts about the site


def explain_request(cluster: str | None, config_file: str | None) -> str:
    """The explanation of the cluster ``--cluster NAME`` or ``--config FILE`` names.

    Raises:
        UsageError: neither is given (or both).
        ConfigError: the file cannot be read or is not valid.
    """
    config = load_cluster_config(cluster, config_file)
    if config is None:
        raise UsageError("--explain shows a cluster's site facts: give --cluster NAME or --config FILE, e.g. "
                         "hvdrun qsub --cluster aurora --explain")
    return explain_cluster(config)


def explain_cluster(config: ClusterConfig) -> str:
    """Every fact of ``config``'s file grouped by the page it comes from, then those no page gives."""
    leaves = [(key, value) for key, value in flatten(_document(config.source))
              if key.split(".")[0] not in _NOT_FACTS]
    sources = config.sources
    lines = [f"{config.name} ({config.source})"]
    if sources is None:
        lines.append("  this file names no page for its facts (no 'sources:' section)")
    else:
        lines.append(_header(sources))
        for page in sources.pages:
            lines += ["", page, f"  {sources.permalink(page)}"]
            lines += [_line(key, value) for key, value in leaves if page in sources.pages_of(key)]
    own = [(key, value) for key, value in leaves if sources is None or not sources.pages_of(key)]
    if own:
        lines += ["", "from no page (hvdrun's own settings for this machine)"]
        lines += [_line(key, value) for key, value in own]
    return "\n".join(lines) + "\n"


def _header(sources: SiteSources) -> str:
    committed = f" of {sources.committed}" if sources.committed else ""
    return (f"  site facts read {sources.read} from {sources.repository} at commit {sources.commit[:12]}"
            f"{committed}")


def _document(path: str) -> dict[str, Any]:
    """The cluster file's YAML, as read (already validated by :func:`hvdrun.config.load_config`)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read cluster config '{path}' again: {e}") from e
    return data if isinstance(data, dict) else {}


def _line(key: str, value: Any) -> str:
    return f"  {key}: {_shown(value)}"


def _shown(value: Any) -> str:
    """A value as the file gives it: lists in brackets, an empty or padded string in quotes."""
    if isinstance(value, list):
        return "[" + ", ".join(_shown(item) for item in value) + "]"
    if isinstance(value, dict):  # only an empty mapping is a leaf
        return "{}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str) and (not value or value != value.strip()):
        return json.dumps(value)
    return str(value)
