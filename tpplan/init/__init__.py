"""`tpplan init`: infer a plan from a model's traced data flow, prove it, write it.

    dataflow.py  where each projection's output goes (one traced forward)
    infer.py     the rules that follow from it, in groups that stand or fall together
    gradsum.py   sum_output_grad for a whole projection whose tail meets a pair's heads (MLA)
    prove.py     the lint's edits, the lint, the dry run's --check at every degree; gathers a
                 pair that fails, drops what still fails
    render.py    YAML with globs over repeated layers and one comment per group
    compare.py   the same figures for another plan (transformers' own, or --compare)
    within.py    keeps to the model's own plan where sharding more would cost backward collectives

`infer_plan(model, tp=[2, 4])` is the Python entry; `init(...)` the CLI's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from ..core.plan import Plan
    from .infer import Proposal, Unplanned
    from .prove import Proven


@dataclass
class Inferred:
    text: str  # the plan's YAML
    proven: "Proven"
    unplanned: list  # Unplanned: modules with parameters left whole, and why
    checked: bool  # whether --check ran with real values (else shapes and collectives only)
    compare: dict = field(default_factory=dict)  # name -> {degree: figures} of another plan
    ok: bool = True  # False only for `--from` when the fixed plan still fails

    @property
    def plan(self) -> "Plan":
        from ..core.loader import load_plan

        return load_plan(text=self.text, file="<init>")

    def to_json(self) -> dict:
        return {
            "plan": self.text,
            "degrees": {str(d): r.to_json() for d, r in self.proven.results.items()},
            "compare": {name: {str(d): r.to_json() for d, r in figures.items()} for name, figures in self.compare.items()},
            "warnings": list(self.proven.warnings),
            "lint_warnings": [p.to_dict() for p in self.proven.lint_warnings],
            "dropped": [{"rule": d.rule, "why": d.why} for d in self.proven.dropped],
            "unplanned": [{"module": u.fqn, "why": u.why} for u in self.unplanned],
            "checked": self.checked,
        }


def infer_plan(model: "nn.Module | Callable[[], nn.Module]", tp: Sequence[int] | None = None, sp: bool = False, *,
               ep: bool = False, loss_parallel: bool = False, inputs: str | None = None, shard_more: bool = False) -> "Plan":
    """A proven plan for `model` (a module, or a factory that builds one: a factory lets
    the check rebuild it; a module is copied). `tp`: the degrees (default: those in 2..8
    that divide the sizes of all the model can shard, infer.default_degrees). A model with its own plan (transformers' tp_plan): where
    sharding more than it would cost backward collectives, what it leaves whole stays whole
    unless `shard_more` (within.py). Its YAML, as `tpplan init` writes it, is `plan.text`."""
    return run_init(model, tp=tp, sp=sp, ep=ep, loss_parallel=loss_parallel, inputs=inputs, shard_more=shard_more).plan


def run_init(model: "nn.Module | Callable[[], nn.Module]", *, ref: str | None = None, tp: Sequence[int] | None = None,
             sp: bool = False, ep: bool = False, loss_parallel: bool = False, inputs: str | None = None,
             output: str | None = None, compare: dict[str, str] | None = None, auto_compare: bool = False,
             shard_more: bool = False, on_event: Callable[[str], None] | None = None) -> Inferred:
    """Infer, prove and render. `model`: a module or its factory; `ref`: how to name it (MOD:FN).
    `compare`: {name: plan text} of plans to dry-run beside it; `auto_compare`: also transformers'
    own TP plan of an HF model that has one. Where sharding all that is proven would run more
    backward collectives than that plan, what it leaves whole stays whole, unless `shard_more`
    (within.py). Raises PlanError (TP500: the model does not build; TP329: its forward cannot
    be traced)."""
    from torch import nn

    from ..core.schema_file import schema_comment
    from ..simulation.ladder import values_allowed
    from ..simulation.modelref import build_model
    from .compare import TRANSFORMERS, figures, plan_file
    from .prove import Target, plan_text, prove

    event = on_event or (lambda text: None)
    if isinstance(model, nn.Module):
        instance = model
        ref = ref or type(model).__name__
        factory = lambda: copy.deepcopy(instance)  # noqa: E731
        meta = instance
    else:
        factory = model
        ref = ref or getattr(model, "__qualname__", "model")
        event("building the model on the meta device")
        meta = build_model(ref, "meta", factory)
    event("tracing the forward")
    proposal = proposal_for(meta, ref, inputs, sp=sp, ep=ep, loss_parallel=loss_parallel)
    shipped = _shipped_plan(meta)
    checked = values_allowed(meta) and not (isinstance(model, nn.Module) and _on_meta(model))
    target = Target(meta, ref, factory, inputs, check=checked)
    name = f"{type(meta).__name__}-init" + ("-sp" if sp else "")
    degrees_text = "every degree of mesh.sizes"
    header = [schema_comment(output), f"# Inferred by tpplan init from the traced data flow of {ref} ({type(meta).__name__});",
              f"# proven with the lint and apply --dry-run{' --check' if checked else ''} at {degrees_text}."]
    description = f"Tensor parallelism inferred by tpplan init for {type(meta).__name__}" + (" with sequence parallelism" if sp else "") + "."
    proven, _ = prove(target, proposal, tp, name=name, description=description, header=header, on_event=event)
    figured: dict = {}  # label -> its figures at proven.degrees
    if shipped is not None and not shard_more:
        from .within import costlier, sharded_modules, within

        figured[TRANSFORMERS] = theirs = figures(target, shipped, proven.degrees, event, file=plan_file(TRANSFORMERS))
        why = costlier(proven.results, theirs)
        if why is not None:  # keep to the shipped plan's trade: what it leaves whole stays whole
            event(f"keeping to transformers' plan: {why}")
            proposal = within(proposal, sharded_modules(shipped, meta), "transformers' plan", why)
            proven, _ = prove(target, proposal, tp, name=name, description=description, header=header, on_event=event)
            figured.clear()
    unplanned = [u for u in proposal.unplanned if u.fqn not in proven.rules]  # the lint's edits planned some
    footer = _footer(proven, unplanned, checked)
    text = plan_text(proven.rules, [n for n, _ in meta.named_modules()], proven.degrees, proposal, name, description, header)
    text = text + "".join(f"{line}\n" for line in footer)
    inferred = Inferred(text, proven, unplanned, checked)
    compare = dict(compare or {})
    if auto_compare and shipped is not None:
        compare[TRANSFORMERS] = shipped
    for label, compared in compare.items():
        inferred.compare[label] = figured.get(label) or figures(target, compared, proven.degrees, event, file=plan_file(label))
    return inferred


def proposal_for(meta: "nn.Module", ref: str, inputs: str | None, *, sp: bool = False, ep: bool = False,
                 loss_parallel: bool = False) -> "Proposal":
    """The groups of rules the traced data flow of `meta` proposes (infer.propose). Raises
    PlanError TP329 when its forward cannot be traced."""
    from ..core.loader import load_plan
    from ..core.problems import PlanError, error
    from ..lint.context import LintContext
    from .dataflow import analyze
    from .infer import propose

    ctx = LintContext(load_plan(text="version: 1\nrules: {}\n", file="<init>"), meta, [2], inputs=inputs)
    if ctx.trace is None:
        raise PlanError([error("TP329", f"cannot infer a plan: the forward of {type(meta).__name__} cannot be traced ({ctx.trace_error})", ref)])
    flow = analyze(ctx.trace, ctx.modules)
    return propose(meta, flow, sp=sp, ep=ep, loss_parallel=loss_parallel, stream_modules=flow.stream)


def _shipped_plan(meta: "nn.Module") -> str | None:
    """transformers' own TP plan of an HF model that has one, as tpplan YAML."""
    if not getattr(getattr(meta, "config", None), "base_model_tp_plan", None):
        return None
    from .compare import transformers_plan

    return transformers_plan(meta)


def _on_meta(model: "nn.Module") -> bool:
    return any(t.device.type == "meta" for t in (*model.parameters(), *model.buffers()))


def _footer(proven: "Proven", unplanned: list, checked: bool) -> list[str]:
    from ..core.globs import generalize

    lines = []
    if not checked:
        lines.append("# Not checked with values (above the values limit, or a meta model): shapes and collectives only.")
    if proven.dropped:
        lines.append("# Dropped (they failed; those modules stay whole):")
        lines += list(dict.fromkeys(f"#   {d.rule}: {_one_line(d.why)}" for d in proven.dropped))
    whole: dict[tuple[str, str], None] = {}
    for u in unplanned:
        whole.setdefault((generalize(u.fqn), u.why), None)
    if whole:
        lines.append("# Left whole on every rank:")
        lines += [f"#   {fqn or '(the model itself)'}: {why}" for fqn, why in whole]
    return lines


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
