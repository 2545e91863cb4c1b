"""`tpplan fit`'s result as text: the cost model's assumptions, the counts, the top
layouts (peak beside Megatron's formula, the step split into compute, exposed
communication and bubble), and the rejected layouts grouped by why."""

from __future__ import annotations

from collections import defaultdict

SHOWN_PER_REASON = 3  # rejected layouts printed per kind of reason (--format json lists every one)


def render_fit(result, console, written: str | None = None) -> None:
    from rich.table import Table

    from ..core.units import human_bytes

    options = result.options
    counts = result.counts()
    console.print(f"[bold]tpplan fit[/bold] {options.model} on {options.world} GPUs × {human_bytes(options.memory_bytes)} "
                  f"({options.gpus_per_node} per node), seq {options.seq}, global batch {options.global_batch}, "
                  f"{options.dtype}, {options.optimizer}: {result.seconds:.1f} s")
    console.print("cost model: " + _assumptions(result.assumptions), markup=False, highlight=False)
    console.print(f"{counts['considered']} layouts: {counts['rejected_by_search']} outside the search's rules, "
                  f"{counts['rejected_by_checks']} rejected by the plan's checks, "
                  f"{counts['rejected_by_memory']} by memory, {counts['ranked_out']} ranked out by their bound, "
                  f"{counts['simulated']} simulated, {counts['fitting']} fit")
    if result.ranked:
        table = Table(title=f"Top {min(options.top, len(result.ranked))} layouts", title_justify="left")
        for column in ("#", "layout", "peak", "Megatron", "step", "compute", "comm", "bubble", "tok/s/GPU"):
            table.add_column(column, justify="left" if column == "layout" else "right")
        for index, ranked in enumerate(result.ranked[:options.top], 1):
            step = ranked.step
            megatron = "—" if ranked.megatron_peak_bytes is None else (
                f"{human_bytes(ranked.megatron_peak_bytes)} ({(ranked.megatron_peak_bytes - ranked.peak_bytes) / ranked.peak_bytes:+.0%})")
            table.add_row(str(index), ranked.layout.describe(), human_bytes(ranked.peak_bytes), megatron, f"{step.total:.4g} s",
                          f"{step.compute:.4g}", f"{step.comm:.4g}", f"{step.bubble:.4g}", f"{ranked.tokens_per_second_per_gpu:,.0f}")
        console.print(table)
    else:
        console.print("[red]no layout fits[/red]")
    groups: dict[tuple[str, str], list] = defaultdict(list)
    for rejected in result.rejected:
        groups[(rejected.kind, rejected.code or "")].append(rejected)
    for (kind, code), members in groups.items():
        console.print(f"rejected ({kind}{' ' + code if code else ''}): {len(members)}", style="dim" if kind == "ranked out" else None)
        for rejected in members[:SHOWN_PER_REASON]:
            console.print(f"  {rejected.layout.describe()}: {rejected.reason}", markup=False, highlight=False)
        if len(members) > SHOWN_PER_REASON:
            console.print(f"  and {len(members) - SHOWN_PER_REASON} more (--format json lists each)")
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    if written:
        rules = f", extending the TP rules tpplan init inferred and proved ({result.rules_written_to(written)})" if result.rules else ""
        console.print(f"wrote {written}{rules}: `tpplan apply --dry-run --plan {written} --model {options.model}` plans its step",
                      markup=False, highlight=False)


def _assumptions(found: dict) -> str:
    """The cost model's figures in units (JSON keeps them raw)."""
    from ..core.units import human_bytes

    gpu = (f"{found['name']}: {found['peak_flops'] / 1e12:g} TFLOP/s × efficiency {found['efficiency']:g}, "
           f"{human_bytes(found['memory_bytes'])}, {found['gpus_per_node']} per node; inside a node "
           f"{found['intra_bandwidth'] / 1e9:g} GB/s, α {found['intra_latency'] * 1e6:g} µs; across nodes "
           f"{found['inter_bandwidth'] / 1e9:g} GB/s, α {found['inter_latency'] * 1e6:g} µs")
    return "; ".join([gpu, *(f"{key}: {found[key]}" for key in ("collectives", "overlap", "bubble"))])
