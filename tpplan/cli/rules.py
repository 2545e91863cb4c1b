"""`tpplan rules [CODE]`: what each problem code means, from the same text as docs/rules.md."""

from typing import Annotated, Optional

import typer

from .output import usage_error


def rules(
    code: Annotated[
        Optional[str],
        typer.Argument(metavar="CODE", help="A code (TP311) or a rule name (head-divisibility); omitted: list every code.", show_default=False),
    ] = None,
) -> None:
    """Document the checks: list every problem code, or print one code's documentation."""
    from ..lint.codes import catalog, find

    if code is None:
        entries = catalog()
        width = max(len(entry.name) for entry in entries)
        for entry in entries:
            typer.echo(f"{entry.code}  {entry.name:<{width}}  {entry.severity:<7}  {entry.summary}")
        typer.echo("\n`tpplan rules CODE` prints one code's documentation, with a failing and a passing example.")
        return
    entry = find(code)
    if entry is None:
        from difflib import get_close_matches

        names = [e.code for e in catalog()] + [e.name for e in catalog()]
        close = get_close_matches(code.upper() if code[:2].lower() == "tp" else code.lower(), names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else "; `tpplan rules` lists them all"
        usage_error(f"unknown code or rule name {code!r}{hint}")
    typer.echo(entry.doc.rstrip("\n"))
