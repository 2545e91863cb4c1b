"""`tpplan schema`: print the plan JSON Schema."""

import sys


def schema() -> None:
    """Print the JSON Schema of the plan format (what schemas/plan.schema.json holds)."""
    from ..render.schema import schema_text

    sys.stdout.write(schema_text())
