"""horovodrun's own options, mapped onto hvdrun's settings: tuning flags, ``--config-file`` and ``--check-build``.

A Horovod user's command line keeps working: each option that means something here becomes the
worker variable Horovod's runtime reads (``HOROVOD_FUSION_THRESHOLD``, ...), which hvdrun's runtime
reads too; ``--config-file`` reads Horovod's YAML of the same parameters (an option given on the
command line wins, as in horovodrun); options that cannot apply are refused with the reason.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from hvdrun import envvars
from hvdrun.errors import ConfigError, UsageError

MIB = 1 << 20
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

# horovodrun options that have no meaning in hvdrun, and why (refused rather than silently ignored)
REFUSED = {
    "--autotune": "hvdrun has no autotuner; set --fusion-threshold-mb and --cycle-time-ms yourself "
                  "('hvdrun bench' measures the sizes that matter)",
    "--hierarchical-allreduce": "hvdrun's ring allreduce already keeps traffic inside a host in shared memory",
    "--hierarchical-allgather": "hvdrun's ring allgather already keeps traffic inside a host in shared memory",
    "--torus-allreduce": "hvdrun has no NCCL torus allreduce",
    "--jsrun": "hvdrun does not drive IBM jsrun; use --launcher mpiexec or ssh inside the LSF job",
    "--binding-args": "give binding options to mpiexec with --mpi-args",
}


@dataclass(frozen=True)
class HorovodTuning:
    """horovodrun's runtime parameters (None: not given). Field names are horovodrun's option names."""

    fusion_threshold_mb: float | None = None
    cycle_time_ms: float | None = None
    cache_capacity: int | None = None
    timeline_filename: str | None = None
    timeline_mark_cycles: bool | None = None
    no_stall_check: bool | None = None
    stall_check_warning_time_seconds: float | None = None
    stall_check_shutdown_time_seconds: float | None = None
    log_level: str | None = None
    controller: str | None = None  # "mpi" or "gloo"

    def overlaid(self, other: HorovodTuning) -> HorovodTuning:
        """These values, with ``other``'s where these are not given (the command line over the file)."""
        return replace(self, **{f.name: getattr(other, f.name) for f in fields(self) if getattr(self, f.name) is None})

    def worker_env(self) -> dict[str, str]:
        """The variables Horovod's launcher would give the workers for these parameters."""
        env: dict[str, str] = {}
        if self.fusion_threshold_mb is not None:
            env[envvars.HOROVOD_FUSION_THRESHOLD] = str(int(self.fusion_threshold_mb * MIB))
        if self.cycle_time_ms is not None:
            env[envvars.HOROVOD_CYCLE_TIME] = f"{self.cycle_time_ms:g}"
        if self.cache_capacity is not None:
            env[envvars.HOROVOD_CACHE_CAPACITY] = str(self.cache_capacity)
        if self.timeline_filename:
            env[envvars.HOROVOD_TIMELINE] = str(Path(self.timeline_filename).resolve())
        if self.timeline_mark_cycles:
            env[envvars.HOROVOD_TIMELINE_MARK_CYCLES] = "1"
        if self.no_stall_check is not None:
            env[envvars.HOROVOD_STALL_CHECK_DISABLE] = "1" if self.no_stall_check else "0"
        if self.stall_check_warning_time_seconds is not None:
            env[envvars.HOROVOD_STALL_CHECK_TIME_SECONDS] = f"{self.stall_check_warning_time_seconds:g}"
        if self.stall_check_shutdown_time_seconds is not None:
            env[envvars.HOROVOD_STALL_SHUTDOWN_TIME_SECONDS] = f"{self.stall_check_shutdown_time_seconds:g}"
        if self.log_level:
            env[envvars.HOROVOD_LOG_LEVEL] = self.log_level
        return env


# --config-file: section -> {key: (field, type)}
_SECTIONS: dict[str, dict[str, tuple[str, type]]] = {
    "params": {"fusion_threshold_mb": ("fusion_threshold_mb", float), "cycle_time_ms": ("cycle_time_ms", float),
               "cache_capacity": ("cache_capacity", int), "hierarchical_allreduce": ("", bool),
               "hierarchical_allgather": ("", bool), "torus_allreduce": ("", bool)},
    "autotune": {"enabled": ("", bool), "log_file": ("", str), "warmup_samples": ("", int),
                 "steps_per_sample": ("", int), "bayes_opt_max_samples": ("", int),
                 "gaussian_process_noise": ("", float)},
    "timeline": {"filename": ("timeline_filename", str), "mark_cycles": ("timeline_mark_cycles", bool)},
    "stall_check": {"enabled": ("no_stall_check", bool),
                    "warning_time_seconds": ("stall_check_warning_time_seconds", float),
                    "shutdown_time_seconds": ("stall_check_shutdown_time_seconds", float)},
    "library_options": {"mpi_threads_disable": ("", bool), "num_nccl_streams": ("", int),
                        "thread_affinity": ("", int), "gloo_timeout_seconds": ("", int)},
    "logging": {"level": ("log_level", str), "with_timestamp": ("", bool), "hide_timestamp": ("", bool)},
}
# keys that ask for a feature hvdrun does not have when set to True
_UNAVAILABLE = {("params", "hierarchical_allreduce"): REFUSED["--hierarchical-allreduce"],
                ("params", "hierarchical_allgather"): REFUSED["--hierarchical-allgather"],
                ("params", "torus_allreduce"): REFUSED["--torus-allreduce"],
                ("autotune", "enabled"): REFUSED["--autotune"]}


def load_config_file(path: str) -> HorovodTuning:
    """Horovod's ``--config-file`` YAML.

    Raises:
        ConfigError: not YAML, an unknown section or key, a value of the wrong type, or a feature
            hvdrun does not have (autotune, hierarchical or torus allreduce), naming file and key.
    """
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as e:
        raise ConfigError(f"--config-file {path}: cannot read it: {e.strerror}") from e
    except yaml.YAMLError as e:
        from hvdrun.config import yaml_error_message

        raise ConfigError(f"--config-file {yaml_error_message(path, e)}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"--config-file {path}: expected a mapping of sections, got {type(data).__name__}")
    values: dict[str, Any] = {}
    for section, entries in data.items():
        if section == "controller":
            if entries not in ("gloo", "mpi"):
                raise ConfigError(f"--config-file {path}: 'controller' is {entries!r}; expected gloo or mpi")
            values["controller"] = entries
            continue
        keys = _SECTIONS.get(section)
        if keys is None or not isinstance(entries, dict):
            raise ConfigError(f"--config-file {path}: unknown section {section!r}; expected controller, "
                              f"{', '.join(_SECTIONS)}")
        for key, value in entries.items():
            values.update(_config_value(path, section, key, value, keys))
    return HorovodTuning(**values)


def _config_value(path: str, section: str, key: str, value: Any,
                  keys: Mapping[str, tuple[str, type]]) -> dict[str, Any]:
    if key not in keys:
        raise ConfigError(f"--config-file {path}: unknown key '{section}.{key}'; allowed: {', '.join(keys)}")
    field_name, kind = keys[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"--config-file {path}: '{section}.{key}' must be {kind.__name__}, got {value!r}")
    if isinstance(value, (int, float)) and not isinstance(value, bool) and (not math.isfinite(value) or value < 0):
        raise ConfigError(f"--config-file {path}: '{section}.{key}' must be a finite number >= 0, got {value!r}")
    if value is True and (section, key) in _UNAVAILABLE:
        raise ConfigError(f"--config-file {path}: '{section}.{key}: true' cannot apply: {_UNAVAILABLE[section, key]}")
    if not field_name:
        return {}  # Horovod's knob for something hvdrun does not have, set to its default: nothing to do
    if field_name == "no_stall_check":
        value = not value
    if field_name == "log_level" and str(value).upper() not in LOG_LEVELS:
        raise ConfigError(f"--config-file {path}: 'logging.level' is {value!r}; "
                          f"expected one of {', '.join(LOG_LEVELS)}")
    return {field_name: value.upper() if field_name == "log_level" else value}


def check_controller(controller: str | None, launcher: str | None) -> tuple[str | None, dict[str, str]]:
    """``--mpi`` / ``--gloo`` (or the file's ``controller``): (the launcher to use, worker variables).

    ``--mpi`` runs the ranks under mpiexec with the MPI backend (``hvd.mpi_enabled()`` is True);
    ``--gloo`` runs hvdrun's own TCP/shared-memory ring, the part Horovod's gloo controller plays.

    Raises:
        UsageError: a controller that contradicts ``--launcher``.
    """
    if controller is None:
        return launcher, {}
    if controller == "mpi":
        if launcher not in (None, "mpiexec", "srun"):
            raise UsageError(f"--mpi runs the ranks under MPI, but --launcher {launcher} does not; drop one of them")
        return launcher or "mpiexec", {envvars.BACKEND: "mpi"}
    return launcher, {envvars.BACKEND: "ring"}


def check_build() -> str:
    """Horovod's ``--check-build`` report, answered for this installation."""
    import torch

    def mark(on: bool) -> str:
        return "X" if on else " "

    has_mpi = importlib.util.find_spec("mpi4py") is not None
    dist = torch.distributed.is_available()
    nccl = bool(dist and torch.cuda.is_available() and torch.distributed.is_nccl_available())
    from hvdrun.version import __version__

    gloo = bool(dist and torch.distributed.is_gloo_available())
    return "\n".join([
        f"hvdrun v{__version__}:", "", "Available Frameworks:",
        "    [ ] TensorFlow", f"    [X] PyTorch ({torch.__version__})", "    [ ] MXNet", "",
        "Available Controllers:", f"    [{mark(has_mpi)}] MPI (mpi4py)",
        "    [X] Gloo (hvdrun's TCP/shared-memory ring)", "",
        "Available Tensor Operations:", f"    [{mark(nccl)}] NCCL (torch.distributed)", "    [ ] DDL",
        "    [ ] CCL", f"    [{mark(has_mpi)}] MPI", f"    [{mark(gloo)}] Gloo",
    ])


def horovodrun_settings(values: dict[str, Any], launcher: str | None) -> tuple[str | None, dict[str, str]]:
    """(launcher, worker variables) from horovodrun's options as ``hvdrun run`` received them (its tuning flags,
    ``horovod_config_file``, ``disable_cache``), over its ``--config-file``; ``values`` is consumed.

    Raises:
        UsageError: a controller that cannot apply with ``launcher``; ConfigError: a bad config file.
    """
    config_file = values.pop("horovod_config_file")
    values.pop("disable_cache")
    if values["log_level"]:
        values["log_level"] = values["log_level"].upper()
    tuning = HorovodTuning(**values)
    if config_file:
        tuning = tuning.overlaid(load_config_file(config_file))
    launcher, controller_env = check_controller(tuning.controller, launcher)
    return launcher, {**tuning.worker_env(), **controller_env}
