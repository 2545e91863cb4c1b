"""The plan JSON Schema as text: what `tpplan schema` prints and schemas/plan.schema.json holds."""

from __future__ import annotations

import json


def schema_text() -> str:
    """The plan JSON Schema, keys sorted so the committed file diffs cleanly."""
    from ..core.schema import plan_json_schema

    return json.dumps(plan_json_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"
