"""A version 2 plan's sections against the model (SPEC §7's located checks that need
it), run by `validate --model` beside strict resolution: the globs of every section
match modules, once each (TP200, TP201: core/sections.py; an experts rule's modules
claimed by no TP rule, TP201), `mesh.ep` divides the
experts of each module an `experts` rule matches (TP127), each `context_parallel`
module calls an attention with a CP rule (TP128, from the traced forward), and the
`fsdp.units` nest innermost first (TP129), the pipeline's stages cut the model
between the blocks of its module list, each module with parameters in one stage, in
order (TP154-TP157, core/stages.py).

Like resolution, these always run (`--select` chooses among the TP3xx rules only).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.degrees import divisors_text
from ..core.expert_styles import expert_count, not_experts
from ..core.problems import Problem, error, sort_problems
from ..core.sections import claim_section, claimed_twice, fsdp_units
from ..sharding.pipeline import stage_problems_of

if TYPE_CHECKING:
    from .context import LintContext
    from .trace import Trace

# The op context parallelism shards: torch's context_parallel has CP rules for
# F.scaled_dot_product_attention's flash, efficient and cudnn CUDA kernels only.
CP_ATTENTION = "scaled_dot_product_attention"


def section_problems(ctx: "LintContext") -> list[Problem]:
    """Every check of a version 2 plan's sections against `ctx.model` (none for version 1)."""
    plan = ctx.plan
    if plan.version != 2:
        return []
    tree, under = plan.module_tree(ctx.modules)
    problems: list[Problem] = []
    experts, found = claim_section(plan, tree, under, "experts")
    problems += found + _expert_counts(ctx, experts) + claimed_twice(ctx.matched, experts)
    attention, found = claim_section(plan, tree, under, "context_parallel.modules")
    problems += found + _cp_attention(ctx, attention)
    if plan.fsdp is not None:
        problems += fsdp_units(plan, tree, under)[1]
    problems += claim_section(plan, tree, under, "checkpointing.modules")[1]
    if plan.pipeline is not None:
        problems += stage_problems_of(plan, ctx.model)[2]
    return sort_problems(problems)


def _expert_counts(ctx: "LintContext", claimed: dict) -> list[Problem]:
    """TP127: each module an experts rule matches holds stacked experts, and an
    expert_parallel rule's modules hold a number of them that mesh.ep divides
    (`uneven_experts`)."""
    problems, counts = [], {}
    no_experts: set[str] = set()  # the rules already reported on a module without experts: once each
    for fqn, entry in claimed.items():
        module = ctx.modules[fqn]
        count = expert_count(module)
        if count is not None:
            counts[fqn] = count
        elif entry.pattern not in no_experts:
            exc = not_experts(entry.spec.style, module)  # its text ends with the fix
            problems.append(entry.problem("TP127", f"experts rule '{entry.pattern}' on '{fqn or '<root>'}': {exc}"))
            no_experts.add(entry.pattern)
    return problems + uneven_experts(ctx.plan, claimed, counts, ctx.plan.mesh.sizes["ep"])


def uneven_experts(plan: Any, claimed: dict, counts: dict[str, int], ep: int) -> list[Problem]:
    """TP127 at mesh.ep for the modules of an expert_parallel rule (`claimed`: {fqn: its
    experts rule}) whose expert count (`counts`) `ep` does not divide: each ep rank holds
    E / ep whole experts. `tpplan fit` asks it at each ep it weighs."""
    uneven: dict[tuple[int, str], list[str]] = {}  # (E, the rule's pattern) -> the modules
    for fqn, count in counts.items():
        if claimed[fqn].spec.semantics.experts == "whole" and count % ep:
            uneven.setdefault((count, claimed[fqn].pattern), []).append(fqn)
    problems = []
    for (count, pattern), fqns in uneven.items():
        entry = claimed[fqns[0]]
        more = f" (and {len(fqns) - 1} more)" if len(fqns) > 1 else ""
        problems.append(error("TP127", (
            f"mesh.ep: {ep} does not divide the {count} experts of '{fqns[0]}'{more} (experts rule '{pattern}', line "
            f"{entry.line}): {entry.spec.style} gives each ep rank {count} / ep whole experts; make ep one of "
            f"{divisors_text(count)}"), plan.file, *plan.source.locate(("mesh", "ep"))))
    return problems


def attention_callers(trace: "Trace") -> set[str]:
    """The modules whose forward (their own code or a submodule's) calls CP_ATTENTION."""
    from .trace import Call, Op, Return

    open_calls: list[str] = []
    callers: set[str] = set()
    for event in trace.events:
        if isinstance(event, Call):
            open_calls.append(event.fqn)
        elif isinstance(event, Return):
            open_calls.pop()
        elif isinstance(event, Op) and event.name == CP_ATTENTION:
            callers.update(open_calls)
    return callers


def _cp_attention(ctx: "LintContext", claimed: dict) -> list[Problem]:
    """TP128: each context_parallel module's forward calls F.scaled_dot_product_attention.
    Without a trace (TP329 says why) nothing is claimed either way."""
    if not claimed or ctx.trace is None:
        return []
    callers = attention_callers(ctx.trace)
    missing: dict[int, list[str]] = {}
    for fqn, entry in claimed.items():
        if fqn not in callers:
            missing.setdefault(entry.index, []).append(fqn)
    problems = []
    for fqns in missing.values():
        entry = claimed[fqns[0]]
        shown = ", ".join(repr(f or "<root>") for f in fqns[:3]) + (f" and {len(fqns) - 3} more" if len(fqns) > 3 else "")
        problems.append(entry.problem("TP128", (
            f"context_parallel.modules: '{entry.pattern}' matches {shown}, whose forward calls no "
            "torch.nn.functional.scaled_dot_product_attention: CP without a supported attention (torch's "
            "context_parallel shards the sequence through SDPA's flash, efficient and cudnn kernels only; an eager "
            "attention of matmul and softmax has no CP rule); name the attention modules, or make them call SDPA "
            "(transformers: attn_implementation='sdpa')")))
    return problems
