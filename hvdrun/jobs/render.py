"""Job scripts from ``templates/``: Jinja2 with StrictUndefined, layout only.

Every value is quoted by the code before it reaches a template (directives by the scheduler
back-end, paths and the launch line here); templates only place lines. The rendered script is then
checked against its scheduler's directive rules, so a custom template cannot silently lose a
directive.
"""

from __future__ import annotations

import shlex
from pathlib import Path

from hvdrun.errors import UsageError
from hvdrun.jobs import SCHEDULERS, scheduler_for
from hvdrun.jobs.scheduler import CHAIN_ENDED, JobSpec, Scheduler, ScriptRules, quote
from hvdrun.resources import data_dir


def directive_lines(spec: JobSpec, scheduler: Scheduler) -> list[str]:
    """Generated directives minus ``skip_directives`` (substring match), then the extra ones."""
    lines = [line for line in scheduler.directives(spec)
             if not any(skip in line for skip in spec.skip_directives)]
    return lines + [scheduler.extra_directive(text) for text in spec.directives]


def _template_path(spec: JobSpec) -> Path:
    name = spec.template or f"{spec.scheduler}.sh.j2"
    path = Path(name) if "/" in name else data_dir("templates") / name
    if not path.is_file():
        shipped = ", ".join(f"{kind}.sh.j2" for kind in SCHEDULERS)
        raise UsageError(f"--template {name!r}: no such file (shipped: {shipped})")
    return path


def render_script(spec: JobSpec) -> str:
    """The job script of ``spec``, checked against its scheduler's directive rules.

    Raises:
        UsageError: a template error, or a script whose directives the scheduler would not read.
    """
    import jinja2

    scheduler = scheduler_for(spec.scheduler)
    path = _template_path(spec)
    env = jinja2.Environment(loader=jinja2.FileSystemLoader([str(path.parent), str(data_dir("templates"))]),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True, autoescape=False)
    context = {"directives": directive_lines(spec, scheduler), "setup": list(spec.setup),
               "workdir": quote(spec.workdir), "launch": shlex.join(spec.launch),
               "python": quote(spec.launch[0]), "exit_file": quote(spec.exit_file),
               "job_name": quote(spec.job_name), "scheduler": spec.scheduler, "cluster": quote(spec.cluster),
               "chain": _chain_lines(spec)}
    try:
        text = env.get_template(path.name).render(context)
    except jinja2.TemplateError as e:
        raise UsageError(f"template {path}: {e}") from e
    check_script(text, scheduler.rules, str(path))
    return text


def _chain_lines(spec: JobSpec) -> dict[str, str] | None:
    """A chain's lines in the job (``hvdrun chain-link``, :mod:`hvdrun.jobs.chain`); None for a job of no chain."""
    if spec.link is None:
        return None
    step = [spec.launch[0], "-m", "hvdrun", "chain-link"]
    where = [spec.link.chain_file, str(spec.link.number)]
    end = shlex.join([*step, "end", *where]) + ' "$rc" "$stopped_by"'  # the script's variables, unquoted here
    return {"begin": shlex.join([*step, "begin", *where]), "end": end, "events_file": quote(spec.link.events_file),
            "ended_code": str(CHAIN_ENDED)}


def check_script(text: str, rules: ScriptRules, source: str) -> None:
    """Refuse a script whose directives its scheduler would ignore or misread.

    - every directive comes before the first command (all schedulers stop reading there);
    - Cobalt: directives are the topmost lines, no blank line among them;
    - PBS: no comment lines inside the directive block, no comment after a directive.
    """
    lines = text.splitlines()
    if not lines or not lines[0].startswith("#!"):
        raise UsageError(f"{source}: a job script must start with a '#!' line")
    seen_directive, ended, comment = False, False, ""
    for number, line in enumerate(lines[1:], start=2):
        stripped = line.strip()
        where = f"{source}, line {number}"
        if stripped.startswith(rules.prefix + " ") or stripped == rules.prefix:
            if ended:
                raise UsageError(f"{where}: '{stripped}' comes after the first command or blank line; "
                                 f"{rules.prefix} directives there are ignored")
            if not rules.comments_in_block and "#" in stripped[len(rules.prefix):]:
                raise UsageError(f"{where}: comment on a directive line ('{stripped}'); PBS may read it as an option")
            if comment and seen_directive:
                raise UsageError(f"{where}: comment inside the {rules.prefix} block ('{comment}'); "
                                 "PBS may read it as a directive: move it below the directives")
            seen_directive = True
        elif stripped.startswith("#") or not stripped:
            ended = ended or rules.blank_line_ends_block  # Cobalt: directives are the topmost lines
            comment = comment or (stripped if not rules.comments_in_block else "")
        else:
            ended = True
    if not seen_directive:
        raise UsageError(f"{source}: no {rules.prefix} directives at the top of the script")
