"""The text rendering of an apply report (`runtime.report.ApplyReport`): rich
tables of modules and styles, parameters, memory and collectives."""

from __future__ import annotations

from ..core.globs import generalize
from ..core.units import human_bytes
from ..runtime.report import ApplyReport
from ..simulation.layouts import ParamLayout


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"


def _runs(values: list[int]) -> list[tuple[int, int, int]]:
    """(first index, last index, value) of each run of equal values: eight equal
    ranks print as one row."""
    runs: list[tuple[int, int, int]] = []
    for i, value in enumerate(values):
        if runs and runs[-1][2] == value:
            runs[-1] = (runs[-1][0], i, value)
        else:
            runs.append((i, i, value))
    return runs


def _mesh_text(mesh: dict[str, int]) -> str:
    return " × ".join(f"{axis} {size}" for axis, size in mesh.items())


def render_text(report: ApplyReport, console) -> None:
    """Print the report as rich tables on `console` (problems are the caller's to print)."""
    from rich.table import Table
    from rich.text import Text

    def row(table: Table, *cells: str) -> None:
        # Text, not markup: globs such as 'blocks.[0-3]' would read as rich markup.
        table.add_row(*(Text(cell) for cell in cells))

    if report.mode == "dry-run" and report.mesh is not None and not report.params:  # runtime/checkpoint_layout.py
        where = f"world {report.world_size} ({_mesh_text(report.mesh)}), checked from the checkpoint's headers, no rank simulated"
    elif report.mode == "dry-run":
        where = f"{report.world_size} simulated ranks (fake process group, {report.device} tensors)"
    else:
        where = (
            f"world {report.world_size}" + (f" = dp {report.dp} x tp {report.tp}" if report.dp > 1 else "") + f", {report.backend} on {report.device}"
        )
    console.print(Text.assemble(("tpplan apply", "bold"), f" {report.plan_name or report.plan_file} on {report.model}: {where}"))
    for note in report.notes:
        console.print(Text(f"note: {note}"))

    if report.modules:
        table = Table(title="Modules and styles", title_justify="left")
        for column in ("rule", "style", "modules", "where"):
            table.add_column(column, justify="right" if column == "modules" else "left")
        by_rule: dict[str, list[str]] = {}
        for fqn, pattern in report.rule_of.items():
            by_rule.setdefault(pattern, []).append(fqn)
        for pattern, fqns in by_rule.items():
            shown = fqns[0] or "<root>"
            count = f"{len(fqns)}" if len(fqns) > 1 else shown
            row(table, pattern or '""', report.modules[fqns[0]], count, report.rule_where.get(pattern, ""))
        console.print(table)

    if report.params:
        table = Table(title=f"Parameters at TP {report.tp}", title_justify="left")
        for column, justify in (("parameter", "left"), ("count", "right"), ("global", "left"), ("per rank", "left"), ("placement", "left"), ("on rank 0", "right")):
            table.add_column(column, justify=justify)
        groups: dict[tuple, list[ParamLayout]] = {}
        for p in report.params:
            # layers.12.attention.wq.weight -> layers.*.attention.wq.weight: repeated blocks
            # collapse into one row, so a 32-layer model prints like a 2-layer one.
            groups.setdefault((generalize(p.name), p.global_shape, p.local_shapes, p.placements, p.dtype), []).append(p)
        for (family, global_shape, local_shapes, placements, _), members in groups.items():
            local = " | ".join(_shape(s) for s in local_shapes) + " (uneven)" if members[0].uneven else _shape(local_shapes[0])
            row(table, family, str(len(members)), _shape(global_shape), local, placements, human_bytes(sum(m.rank_bytes(0) for m in members)))
        console.print(table)
        table = Table(title="Parameter memory", title_justify="left")
        for column in ("ranks", "bytes", "size"):
            table.add_column(column, justify="left" if column == "ranks" else "right")
        for first, last, held in _runs(report.rank_bytes):
            ranks = f"{first}" if first == last else f"{first}-{last}"
            row(table, f"rank {ranks}" if first == last else f"ranks {ranks}", str(held), human_bytes(held))
        row(table, "all (unsharded)", str(report.total_bytes), human_bytes(report.total_bytes))
        console.print(table)

    if report.comms_by_axis is not None and len(report.comms_by_axis) > 1:
        _render_axes(report, console)
    elif report.comms is not None:
        sizes = report.comm_bytes  # with memory planning: bytes per rank beside the counts
        table = Table(title="Collectives" + (" per rank, one training step" if sizes else ""), title_justify="left")
        columns = (("forward pass", "forward bytes", "backward pass", "backward bytes") if sizes else ("forward pass", "backward pass"))
        for column, justify in (("op", "left"), *((c, "right") for c in columns)):
            table.add_column(column, justify=justify)
        ops = sorted(set(report.comms["forward"]) | set(report.comms["backward"]))
        for op in ops:
            cells = [op]
            for phase in ("forward", "backward"):
                cells.append(str(report.comms[phase].get(op, 0)))
                if sizes:
                    cells.append(human_bytes(sizes[phase].get(op, 0)))
            row(table, *cells)
        if not ops:
            row(table, "(none)", *("0" for _ in columns))
        console.print(table)

    if report.memory is not None:
        from .memory import render_memory

        render_memory(report.memory, report.memory_sweep, console, report.mesh, report.ranks)
    if report.pipeline is not None and "bubble" in report.pipeline:
        _render_pipeline(report.pipeline, console)

    if report.step_time_s is not None:
        console.print(f"step time (forward + backward): {report.step_time_s * 1e3:.2f} ms")
    if report.steps is not None:
        losses = report.steps.losses
        console.print(
            f"{len(losses)} {report.steps.optimizer} steps: loss {losses[0]:.6g} -> {losses[-1]:.6g}, "
            f"median step {report.steps.median_step_s * 1e3:.2f} ms"
        )
    if report.checkpoint is not None:
        _render_checkpoint(report, console)
    if report.saved is not None:
        console.print(Text(f"saved: {report.saved['path']} ({report.saved['format']})"))
    if report.check is not None:
        verdict = "[green]passed[/green]" if report.check.passed else "[red]FAILED[/red]"
        console.print(f"check against a single device: {verdict}, max |diff| {report.check.max_abs_diff:.3g}")
        for line in report.check.problems:
            console.print(f"  {line}", markup=False)


def _render_pipeline(pipeline: dict, console) -> None:
    """A pipeline's dry run (SPEC §8): each stage, its pp rank's peak and the microbatches it holds."""
    from rich.table import Table
    from rich.text import Text

    table = Table(title=f"Pipeline: {pipeline['schedule']}, {pipeline['microbatches']} microbatches per step, "
                        f"bubble {pipeline['bubble']:.1%} of the step", title_justify="left")
    for column, justify in (("stage", "right"), ("pp", "right"), ("modules", "left"), ("rank's peak", "right"),
                            ("at", "left"), ("activations / microbatch", "right"), ("in flight", "right"), ("p2p / microbatch", "right")):
        table.add_column(column, justify=justify)
    for stage in pipeline["stages"]:
        modules = stage["modules"]
        shown = ", ".join(modules) if len(modules) <= 3 else f"{modules[0]} … {modules[-1]} ({len(modules)})"
        cells = (str(stage["stage"]), str(stage["pp_rank"]), shown, human_bytes(stage["per_rank_peak_bytes"]), stage["peak_action"],
                 human_bytes(stage["activations"]), str(stage["in_flight"]), human_bytes(stage["p2p_bytes"]))
        table.add_row(*map(Text, cells))
    console.print(table)


def _render_axes(report: ApplyReport, console) -> None:
    """SPEC §7's collectives per axis, one short table each (the worst rank's, as the memory)."""
    from rich.table import Table
    from rich.text import Text

    assert report.comms_by_axis is not None and report.mesh is not None
    for axis, phases in report.comms_by_axis.items():
        size = report.mesh.get(axis)
        table = Table(title=f"Collectives over {axis}" + (f" ({size} ranks)" if size else "") + " per rank, one training step",
                      title_justify="left")
        for column, justify in (("op", "left"), ("forward", "right"), ("forward bytes", "right"), ("backward", "right"), ("backward bytes", "right")):
            table.add_column(column, justify=justify)
        ops = sorted(set(phases["forward"]) | set(phases["backward"]))
        for op in ops:
            cells = [op]
            for phase in ("forward", "backward"):
                found = phases[phase].get(op, {"count": 0, "bytes": 0})
                cells += [str(found["count"]), human_bytes(found["bytes"])]
            table.add_row(*(Text(cell) for cell in cells))
        if not ops:
            table.add_row(Text("(none)"), *(Text(c) for c in ("0", "0 B", "0", "0 B")))
        console.print(table)


def _render_checkpoint(report: ApplyReport, console) -> None:
    from rich.text import Text

    c = report.checkpoint
    verb = "would load" if report.mode == "dry-run" else "loaded"
    console.print(Text(
        f"checkpoint {c['path']} ({c['format']}, {c['files']} files, {human_bytes(c['checkpoint_bytes'])}, "
        f"{'/'.join(c['dtypes']) or '-'}): {verb} {c['loaded']} of its {c['tensors']} tensors"
    ))
    for first, last, read in _runs(list(c["rank_read_bytes"])):
        ranks = f"rank {first}" if first == last else f"ranks {first}-{last}"
        console.print(Text(f"  {ranks} read{'s' if first == last else ''} {human_bytes(read)} ({read} bytes)"))
    for key, label in (("missing", "missing"), ("allowed_missing", "missing, allowed (initialised)"), ("unexpected", "unexpected")):
        if c.get(key):
            shown = ", ".join(c[key][:8]) + (f" (and {len(c[key]) - 8} more)" if len(c[key]) > 8 else "")
            console.print(Text(f"  {label}: {shown}"))
    if (c.get("layout") or {}).get("saved") is not None:  # a checkpoint that records its layout (checkpoint/layout.py)
        loads = not any(p.code.startswith("TP6") and p.severity == "error" for p in report.problems)
        console.print(Text(f"  {_layout_verdict(c['layout'], loads, planned=report.mode == 'dry-run')}"))


def _describe(mesh: dict[str, int]) -> str:
    """'dp_shard 2 × tp 2'; 'one device' for an empty mesh; axes of size 1 left out."""
    shown = [f"{axis} {size}" for axis, size in mesh.items() if size != 1]
    return " × ".join(shown) or "one device"


def _layout_verdict(layout: dict, loads: bool, planned: bool) -> str:
    """One line for the text report: the layout the checkpoint records it was saved
    under, and whether it loads (`planned`: the dry run's question) or loaded under the target."""
    plan = layout["saved"]["plan"]
    where = _describe(layout["saved"]["mesh"])
    by = f" by {plan['name'] or plan['file']}" if plan else ""
    target = _describe(layout["target"])
    if not loads:
        return f"saved under {where}{by}: it does not load under {target} (the problems below say why)"
    if not planned:
        return f"saved under {where}{by}: loaded under {target}" + (" (DCP resharded it)" if layout["reshards"] else "")
    how = "DCP reshards every tensor" if layout["reshards"] else "the same layout"
    state = ", the optimizer state's too" if layout["optimizer"] else ""
    return f"saved under {where}{by}: loads under {target} ({how}{state})"
