"""The memory plan of `apply --dry-run` as text: a bar per category at the peak,
the verdict against --memory-limit, and the table of TP degrees that fit."""

from __future__ import annotations

from ..memory.memory_report import CATEGORIES, DegreeFit, MemoryReport

_COLORS = {"parameters": "blue", "gradients": "magenta", "optimizer": "yellow", "activations": "green", "temporaries": "red"}


def _bar(value: int, total: int, width: int = 30) -> str:
    filled = round(width * value / total) if total else 0
    return "█" * filled + "·" * (width - filled)


def render_memory(memory: MemoryReport, sweep: list[DegreeFit], console, mesh: dict[str, int] | None = None, ranks: list | None = None) -> None:
    """The worst rank's memory (`memory`), then with several simulated positions
    (`ranks`: memory_dryrun.RankPlan) a row each, and the degrees of `sweep`."""
    from rich.table import Table
    from rich.text import Text

    from ..core.units import human_bytes
    from ..core.axes_spec import DP_AXES

    where = f"TP {memory.tp}" + (f" x FSDP {memory.dp}" if memory.dp > 1 else "")
    if mesh and any(dim in mesh for dim in (*DP_AXES, "pp")):  # a version 2 plan's named axes
        where = " x ".join(f"{dim} {size}" for dim, size in mesh.items())
    if ranks and len(ranks) > 1:
        where += f"; the highest of {len(ranks)} positions"
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
    if ranks and len(ranks) > 1:
        _render_ranks(ranks, console)
    if memory.limit_bytes is not None:
        verdict = "[green]fits[/green]" if memory.fits else "[red]does not fit[/red]"
        console.print(f"limit {human_bytes(memory.limit_bytes)} per rank: {verdict} ({100 * peak / memory.limit_bytes:.0f}% of it)")
        for rank in ranks or ():
            if rank.over_limit_bytes:
                console.print(Text(f"  {_where(rank)}: {human_bytes(rank.memory.per_rank_peak_bytes)}, "
                                   f"{human_bytes(rank.over_limit_bytes)} ({rank.over_limit_bytes} bytes) over the limit"), style="red")
    if len(sweep) > 1 or (sweep and sweep[0].tp != memory.tp):
        table = Table(title="TP degrees of the plan's mesh.sizes", title_justify="left")
        for column, justify in (("tp", "right"), ("world", "right"), ("peak per rank", "right"), ("fits", "left")):
            table.add_column(column, justify=justify)
        for row in sweep:
            fits = "-" if row.fits is None else ("[green]yes[/green]" if row.fits else "[red]no[/red]")
            shown = human_bytes(row.per_rank_peak_bytes) if row.per_rank_peak_bytes is not None else (row.problem or "failed")
            table.add_row(str(row.tp), str(row.tp * row.dp), shown, fits)
        console.print(table)


def _where(rank) -> str:
    from ..simulation.positions import ranks_text

    position = " · ".join(f"{dim} {index}" for dim, index in rank.position.items())
    return f"{position} (rank{'s' if len(rank.ranks) > 1 else ''} {ranks_text(rank.ranks)})"


def _render_ranks(ranks: list, console) -> None:
    """A row per simulated position: its ranks and its peak by category."""
    from rich.table import Table
    from rich.text import Text

    from ..core.units import human_bytes

    table = Table(title="Memory per simulated position (each stands for the ranks listed)", title_justify="left")
    for column, justify in (("position", "left"), *((name, "right") for name in CATEGORIES), ("peak", "right"), ("at", "left")):
        table.add_column(column, justify=justify)
    for rank in ranks:
        memory = rank.memory
        table.add_row(Text(_where(rank)), *(Text(human_bytes(memory.categories.get(name, 0))) for name in CATEGORIES),
                      Text(human_bytes(memory.per_rank_peak_bytes)), Text(memory.peak_module))
    console.print(table)
