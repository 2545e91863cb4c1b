"""cli.md and schemas/plan.schema.json are generated; these tests fail when they are stale."""

from __future__ import annotations

import json
from typing import Annotated

import pytest
import typer

from tpplan import docs
from tpplan.core.schema import plan_json_schema


@pytest.mark.parametrize("name", list(docs.GENERATED))
def test_generated_file_is_up_to_date(name):
    path = docs.ROOT / name
    assert path.is_file(), f"{name} is missing: run `{docs.REGENERATE}`"
    assert path.read_text(encoding="utf-8") == docs.GENERATED[name](), f"{name} is stale: run `{docs.REGENERATE}`"


def test_committed_schema_is_the_plan_json_schema():
    assert json.loads((docs.ROOT / docs.SCHEMA_JSON).read_text(encoding="utf-8")) == plan_json_schema()


def test_every_default_in_the_schema_is_valid_plan_input():
    # An editor fills in these defaults: each must load as written.
    from tpplan import load_plan

    defs = plan_json_schema()["$defs"]
    checked = 0
    for name, spec in defs.items():
        if "style" not in spec["properties"]:
            continue
        style = spec["properties"]["style"]["const"]
        required = {key: ["replicate"] for key in spec.get("required", []) if key != "style"}
        for key, prop in spec["properties"].items():
            if "default" in prop and prop["default"] is not None:
                rule = {"style": style, **required, key: prop["default"]}
                load_plan(text=json.dumps({"version": 1, "rules": {"m": rule}}))
                checked += 1
    assert checked >= 10


def test_cli_reference_does_not_depend_on_the_terminal(monkeypatch):
    wide = docs.cli_markdown()
    monkeypatch.setenv("COLUMNS", "30")
    monkeypatch.setenv("FORCE_COLOR", "1")
    assert docs.cli_markdown() == wide
    assert "\x1b" not in wide


def test_cli_reference_covers_every_registered_command():
    from typer.main import get_command

    from tpplan.cli.app import app

    group = get_command(app)
    names = group.list_commands(group.context_class(group, info_name="tpplan"))
    assert {"validate", "schema"} <= set(names)
    text = docs.cli_markdown()
    for name in names:
        assert f"\n## tpplan {name}\n" in text


def test_cli_reference_lists_arguments_and_options_with_help_and_defaults():
    app = typer.Typer()

    @app.command()
    def greet(
        names: Annotated[list[str], typer.Argument(metavar="NAME", help="Who to greet.")],
        times: Annotated[int, typer.Option(metavar="N", min=1, help="How often.")] = 2,
        loud: Annotated[bool, typer.Option("--loud", help="Shout.")] = False,
    ) -> None:
        """Say hello."""

    @app.command()
    def part() -> None:
        """Say goodbye."""

    text = docs.cli_markdown(app)
    assert "## tpplan greet\n\nSay hello.\n\n```text\ntpplan greet [OPTIONS] NAME...\n```" in text
    assert "- `NAME...` (required): Who to greet." in text
    assert "- `--times N` (at least 1, default: `2`): How often." in text
    assert "- `--loud`: Shout." in text
    assert "## tpplan part\n\nSay goodbye." in text
