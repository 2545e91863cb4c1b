"""The generated files: cli.md (from the typer app), schemas/plan.schema.json
(from the plan's pydantic models) and docs/rules.md (from the code catalog).

    python -m tpplan.docs            # rewrite all three
    python -m tpplan.docs --check    # exit 1 if any is stale (what the tests check)

cli.md is written from the commands' parameters, not from typer's help screen,
so it depends on neither the terminal width nor colours, and it covers every
command registered on `tpplan.cli.app.app`. docs/rules.md holds the same text
`tpplan rules CODE` prints.
"""

from __future__ import annotations

import inspect
import sys
from enum import Enum
from pathlib import Path
from typing import Any

from .render.schema import schema_text

ROOT = Path(__file__).resolve().parent.parent
CLI_MD = "cli.md"
SCHEMA_JSON = "schemas/plan.schema.json"
RULES_MD = "docs/rules.md"
REGENERATE = "python -m tpplan.docs"

# What `--format json` prints (the apply report's keys: render/apply_report.py).
JSON_OUTPUT = """\
## JSON output

`--format json` prints one JSON object.

- `validate`: `{"ok": bool, "problems": [{"code", "severity": "error"|"warning", "message", "file", "line", "column"}]}`;
  a lint problem whose rule is sure of its fix also has `"fixes": [{"key", "options", "add": bool, "why"}]`, the
  edits to the plan's rules that fix it (what `tpplan init --from` applies): `add` true, `key` is a module that
  gets the rule `options`; false, `key` is the pattern of the rule that gets the options `options`.
- `apply` adds `"world_size": int`, `"modules": {fqn: style}`,
  `"params": {"total_bytes": int, "per_rank_bytes": int}`,
  `"comms": {"forward": {op: count}, "backward": {op: count}}` (op: `all_reduce`, `all_gather`,
  `reduce_scatter`, `all_to_all`, `broadcast`) and `"check": {"passed": bool, "max_abs_diff": float}` or null;
  beyond those: `mode`, `plan`, `model`, `tp`, `dp`, `device`, `backend`, `rank_bytes`,
  `parameters`, `step_time_s` and `steps`; with `--checkpoint`, `"checkpoint": {"path", "format": "hf"|"dcp",
  "files", "tensors", "loaded", "missing", "allowed_missing", "unexpected", "checkpoint_bytes",
  "rank_read_bytes": [int per rank] (empty where no rank is simulated), "dtypes", "layout": {"saved": {"mesh": {axis: size},
  "plan": {"name", "file", "version", "fingerprint"} or null} or null (a checkpoint that records none), "target": {axis: size},
  "reshards": bool, "optimizer": bool (it holds optimizer state)}}` (else null), with `--save`, `"saved": {"path", "format"}`,
  with memory planning `"memory"` (the per-rank peak by category, `peak_module`, `fits`, `after_step`, and
  `"block_reuse": {"container", "blocks", "from", "reused": [fqn], "simulated": [fqn]}`, the blocks simulated
  once and reused, or null), `"comm_bytes"` and `"optimizer_comms"`; a dry run that simulates a mesh
  (memory planning, a version 2 plan's data axes) also `"mesh": {dim: size}`, `"comms_by_axis": {dim:
  {"forward"|"backward": {op: {"count", "bytes"}}}}` (the worst rank's, as `"memory"`) and `"ranks":
  [{"position": {dim: index}, "global_ranks": [int], "memory", "over_limit_bytes", "comms_by_axis"}]`, one per
  distinct position (torchrun: `"mesh"`), and `"notes": [str]`, what the run chose or changed for the user (a default `--tp`, dropout off for `--check`)."""


def cli_markdown(app: Any = None) -> str:
    """The CLI reference: every command registered on `app` (default: tpplan's) with
    its arguments and options."""
    from typer.main import get_command

    from .cli.app import app as tpplan_app

    if app is None:
        app = tpplan_app

    group = get_command(app)
    ctx = group.context_class(group, info_name="tpplan")
    names = group.list_commands(ctx)
    lines = [
        "# tpplan command line",
        "",
        f"<!-- Generated from the typer app in tpplan/cli/ by `{REGENERATE}`: do not edit by hand. -->",
        "",
        _help_text(group),
        "",
        "Usage: `tpplan [OPTIONS] COMMAND [ARGS]...` (or `python -m tpplan ...`)",
    ]
    options = [p for p in group.get_params(ctx) if not getattr(p, "hidden", False) and p.name != "help"]
    if options:
        lines += ["", "Global options (before the command):", "", *(_option_item(p) for p in options)]
    lines += ["", "Commands: " + ", ".join(f"[`{name}`](#tpplan-{name})" for name in names)]
    for name in names:
        command = group.get_command(ctx, name)
        lines += ["", *_command_section(command, command.context_class(command, info_name=name, parent=ctx))]
    if app is tpplan_app:
        lines += ["", JSON_OUTPUT]
    return "\n".join(lines) + "\n"


def _help_text(command: Any) -> str:
    return inspect.cleandoc(command.help or "")


def _command_section(command: Any, ctx: Any) -> list[str]:
    params = [p for p in command.get_params(ctx) if not getattr(p, "hidden", False)]
    arguments = [p for p in params if not p.opts[0].startswith("-")]
    options = [p for p in params if p.opts[0].startswith("-")]
    usage = " ".join(["tpplan", ctx.info_name, "[OPTIONS]" if options else "", *map(_argument_usage, arguments)])
    lines = [f"## tpplan {ctx.info_name}", "", _help_text(command), "", "```text", " ".join(usage.split()), "```"]
    for title, group, describe in (("Arguments", arguments, _argument_item), ("Options", options, _option_item)):
        if group:
            lines += ["", f"{title}:", "", *(describe(p) for p in group)]
    return lines


def _argument_usage(param: Any) -> str:
    name = (param.metavar or param.name.upper()) + ("..." if param.nargs == -1 else "")
    return name if param.required else f"[{name}]"


def _argument_item(param: Any) -> str:
    notes = ["required"] if param.required else []
    return _item(f"`{_argument_usage(param)}`", notes, param.help)


def _option_item(param: Any) -> str:
    names = ", ".join(param.opts + param.secondary_opts)
    if not param.is_flag:
        names += f" {_option_metavar(param)}"
    notes = []
    if param.required:
        notes.append("required")
    if param.multiple:
        notes.append("repeatable")
    if getattr(param, "envvar", None):
        notes.append(f"env: `{param.envvar}`")
    # typer 0.29 keeps `min=` on the parameter, earlier versions on its IntRange type
    minimum = getattr(param, "min", None)
    if minimum is None:
        minimum = getattr(param.type, "min", None)
    if minimum is not None:
        notes.append(f"at least {minimum}")
    default = param.default.value if isinstance(param.default, Enum) else param.default
    # `is`, not `in`: a default of 0 is worth showing, and 0 == False.
    if not (param.is_flag or default is None or default is False or default in ((), [])):
        notes.append(f"default: `{default}`")
    return _item(f"`{names}`", notes, param.help)


def _option_metavar(param: Any) -> str:
    if param.metavar:
        return param.metavar
    if isinstance(param.default, Enum):  # typer turns an Enum annotation into a choice of its values
        return "|".join(member.value for member in type(param.default))
    return param.name.upper()


def _item(name: str, notes: list[str], help_text: str | None) -> str:
    return f"- {name}" + (f" ({', '.join(notes)})" if notes else "") + f": {inspect.cleandoc(help_text or '')}"


def rules_markdown() -> str:
    """docs/rules.md: the table of every problem code, then each code's documentation."""
    from .lint.codes import catalog

    entries = catalog()
    lines = [
        "# Problem codes",
        "",
        f"<!-- Generated by `{REGENERATE}` from tpplan/lint/; do not edit. -->",
        "",
        "Every problem tpplan reports carries one of these codes (`tpplan rules CODE` prints one).",
        "TP0xx: reading the YAML; TP1xx: the plan format; TP2xx: the plan against a model's module tree;",
        "TP3xx: model-aware lint (`tpplan validate --model`); TP5xx: applying and running a plan.",
        "",
        "| code | name | severity | what it catches |",
        "|---|---|---|---|",
        *(f"| [{e.code}](#{e.code.lower()}-{e.name}-{e.severity}) | {e.name} | {e.severity} | {e.summary} |" for e in entries),
        "",
    ]
    for entry in entries:
        lines += [entry.doc.rstrip("\n"), ""]
    return "\n".join(lines)


GENERATED = {CLI_MD: cli_markdown, SCHEMA_JSON: schema_text, RULES_MD: rules_markdown}


def stale_files(root: Path = ROOT) -> list[str]:
    """The generated files under `root` whose content differs from what would be generated now."""
    stale = []
    for name, generate in GENERATED.items():
        path = root / name
        if not path.is_file() or path.read_text(encoding="utf-8") != generate():
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--check"]):
        print(f"usage: {REGENERATE} [--check]", file=sys.stderr)
        return 2
    if not (ROOT / "pyproject.toml").is_file():
        print(f"error: {ROOT} is not the tpplan source tree (no pyproject.toml): run from a checkout", file=sys.stderr)
        return 2
    if args == ["--check"]:
        stale = stale_files()
        for name in stale:
            print(f"{name} is stale: run `{REGENERATE}`", file=sys.stderr)
        return 1 if stale else 0
    for name, generate in GENERATED.items():
        path = ROOT / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(generate(), encoding="utf-8")
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
