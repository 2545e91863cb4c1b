"""The memory plan of `apply --dry-run` as text: a bar per category at the peak,
the verdict against --memory-limit, and the table of TP degrees that fit."""

from __future__ import annotations

from ..memory.memory_report import CATEGORIES, DegreeFit, MemoryReport

_COLORS = {"parameters": "blue", "gradients": "magenta", "optimizer": "yellow", "activations": "green", "temporaries": "red"}


def _bar(value: int, total: int, width: int = 30) -> str:
    filled = round(width * value / total) if total else 0
    return "█" * filled + "·" * (width - filled)


def render_memory(memory: MemoryReport, sweep: list[DegreeFit], console) -> None:
    from rich.table import Table
    from rich.text import Text

    from ..core.units import human_bytes

    where = f"TP {memory.tp}" + (f" x FSDP {memory.dp}" if memory.dp > 1 else "")
    title = (
        f"Memory per rank, one training step ({where}, batch {memory.batch}, seq {memory.seq}, "
        f"{memory.dtype}, optimizer {memory.optimizer})"
    )
    table = Table(title=title, title_justify="left")
    for column, justify in (("category", "left"), ("at peak", "right"), ("share", "left")):
        table.add_column(column, justify=justify)
    peak = memory.per_rank_peak_bytes
    for name in CATEGORIES:
        held = memory.categories.get(name, 0)
        table.add_row(Text(name), Text(human_bytes(held)), Text(_bar(held, peak), style=_COLORS[name]))
    table.add_row(Text("peak", style="bold"), Text(human_bytes(peak), style="bold"), Text(f"at {memory.peak_module}"))
    console.print(table)
    if memory.reuse is not None:
        console.print(f"blocks: {memory.reuse.describe()}; --no-reuse simulates them all")
    if memory.limit_bytes is not None:
        verdict = "[green]fits[/green]" if memory.fits else "[red]does not fit[/red]"
        console.print(f"limit {human_bytes(memory.limit_bytes)} per rank: {verdict} ({100 * peak / memory.limit_bytes:.0f}% of it)")
    if len(sweep) > 1 or (sweep and sweep[0].tp != memory.tp):
        table = Table(title="TP degrees of the plan's mesh.sizes", title_justify="left")
        for column, justify in (("tp", "right"), ("world", "right"), ("peak per rank", "right"), ("fits", "left")):
            table.add_column(column, justify=justify)
        for row in sweep:
            fits = "-" if row.fits is None else ("[green]yes[/green]" if row.fits else "[red]no[/red]")
            shown = human_bytes(row.per_rank_peak_bytes) if row.per_rank_peak_bytes is not None else (row.problem or "failed")
            table.add_row(str(row.tp), str(row.tp * row.dp), shown, fits)
        console.print(table)
