"""The named mesh of a plan (every axis, SPEC §7) and the plan-only checks of its
sizes: what the axes and sections must satisfy together, each located at the key
to change, with the numbers and the fix. No pydantic, no torch: `validate` runs
these on plans alone.

The loader reports the errors it can decide without a world size (`load_problems`);
`validate --world N` adds the product of the axes and the checks that needed the
`-1` axis resolved (`world_problems`); `section_warnings` names sections whose axis
has degree 1. `unapplied` says what of a plan this tpplan does not apply yet.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import TYPE_CHECKING, Any

from .axes_spec import AXES, DP_AXES, MULTI_STAGE_SCHEDULES, REST, SECTIONS, V_SCHEDULES, WORLD_AXES
from .degrees import divisors_text
from .problems import Problem, error, warning

if TYPE_CHECKING:  # plan.py imports this module: a plan here is any object with .spec, .source, .file
    from .yamlsource import SourceMap


@dataclass(frozen=True)
class NamedMesh:
    """The axes a plan declares: {axis: size} with -1 for the rest of the world and
    tp None when the plan leaves it open (version 1 without mesh.sizes), and the TP
    degrees the plan promises (version 1's mesh.sizes, version 2's list `tp`)."""

    sizes: dict[str, int | None]
    tp_degrees: tuple[int, ...] | None

    @classmethod
    def of(cls, spec: Any) -> "NamedMesh":
        mesh = spec.mesh
        if spec.version == 1:  # the TP axis only; its degree comes from the run
            return cls({**dict.fromkeys(AXES, 1), "tp": None}, tuple(mesh.sizes) if mesh.sizes else None)
        sizes: dict[str, int | None] = {axis: getattr(mesh, axis) for axis in AXES}
        tp = sizes["tp"]
        if isinstance(tp, list):
            return cls({**sizes, "tp": None}, tuple(tp))
        return cls(sizes, (tp,) if tp is not None and tp != REST else None)

    @property
    def rest_axis(self) -> str | None:
        """The axis that takes world / (product of the others): the one at -1, else an open tp."""
        rest = [axis for axis in WORLD_AXES if self.sizes[axis] == REST]
        if rest:
            return rest[0]
        return "tp" if self.sizes["tp"] is None and self.tp_degrees is None else None

    def candidates(self) -> Iterator[dict[str, int | None]]:
        """The sizes once tp is a single degree: one mapping per promised degree (the
        rest axis still None where it needs the world)."""
        rest = self.rest_axis
        for tp in self.tp_degrees or (None,):
            sizes = dict(self.sizes)
            sizes["tp"] = tp if tp is not None else (None if rest == "tp" else 1)
            if rest is not None:
                sizes[rest] = None
            yield sizes

    def resolve(self, world: int, tp: int | None = None) -> dict[str, int]:
        """{axis: size} for a world of `world` ranks (at TP degree `tp` where the plan
        promises several); ValueError where the sizes do not make that world."""
        options = list(self.candidates())
        sizes = next((c for c in options if tp is None or c["tp"] == tp), options[0])
        if tp is not None and sizes["tp"] is None and self.rest_axis != "tp":
            sizes = {**sizes, "tp": tp}
        rest = next((axis for axis in WORLD_AXES if sizes[axis] is None), None)
        known = prod(size for axis, size in sizes.items() if axis in WORLD_AXES and size is not None)
        if rest is not None:
            if world % known:
                raise ValueError(f"{rest} -1 takes world / {known}: {world} / {known} is not a whole number")
            sizes[rest] = world // known
        elif known != world:
            raise ValueError(f"the axes multiply to {known}, not the world size {world}")
        return sizes  # type: ignore[return-value]


def _product_text(sizes: dict[str, int | None]) -> str:
    shown = [f"{axis} {sizes[axis]}" for axis in WORLD_AXES if sizes[axis] not in (1, None)]
    return " × ".join(shown) or "every axis 1"


# -- the checks on sizes ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Check:
    """One divisibility check: the axes it reads, the key it is located at, and the
    function that says what is wrong (None when the sizes are right)."""

    uses: tuple[str, ...]
    key: tuple[str, ...]
    code: str
    find: Any  # (spec, sizes) -> message or None


def _ep(spec: Any, s: dict[str, int]) -> str | None:
    ep, shard = s["ep"], s["dp_shard"] * s["cp"] * s["tp"]
    if shard % ep == 0:
        return None
    return (f"mesh.ep: {ep} does not divide dp_shard·cp·tp = {s['dp_shard']}·{s['cp']}·{s['tp']} = {shard}: "
            f"expert parallelism borrows its ranks from these axes; make ep one of {divisors_text(shard)}, or raise dp_shard")


def _global_batch(spec: Any, s: dict[str, int]) -> str | None:
    batch, dp = spec.training.global_batch, s["dp_replicate"] * s["dp_shard"]
    if batch is None or batch % dp == 0:
        return None
    lower, upper = batch // dp * dp, (batch // dp + 1) * dp
    near = f"{lower} or {upper}" if lower else str(upper)
    return (f"training.global_batch: {batch} sequences do not split evenly over dp_replicate·dp_shard = "
            f"{s['dp_replicate']}·{s['dp_shard']} = {dp} data-parallel ranks: make it a multiple of {dp} ({near})")


def _seq(spec: Any, s: dict[str, int]) -> str | None:
    seq, cp = spec.training.seq, s["cp"]
    headtail = spec.context_parallel is None or spec.context_parallel.load_balance == "headtail"
    chunks = 2 * cp if headtail and cp > 1 else cp
    if seq is None or seq % chunks == 0:
        return None
    by = f"2·cp = 2·{cp} = {chunks} (load_balance: headtail gives each cp rank a head and a tail chunk)" if chunks != cp else f"cp = {cp}"
    upper = (seq // chunks + 1) * chunks
    return f"training.seq: {seq} is not divisible by {by}: make it a multiple of {chunks} (e.g. {upper})"


def _reshard(spec: Any, s: dict[str, int]) -> str | None:
    group = spec.fsdp.reshard_after_forward
    if isinstance(group, bool) or s["dp_shard"] % group == 0:
        return None
    return (f"fsdp.reshard_after_forward: {group} does not divide dp_shard = {s['dp_shard']}: the parameters are "
            f"resharded to groups of {group} ranks within the dp_shard group; give a divisor of {s['dp_shard']}, or true")


def _stage_count(spec: Any, s: dict[str, int]) -> str | None:
    stages, pp, virtual = spec.pipeline.stages, s["pp"], spec.pipeline.virtual_stages
    if stages is None or len(stages) == pp * virtual:
        return None
    return (f"pipeline.stages: {len(stages)} stages, but pp·virtual_stages = {pp}·{virtual} = {pp * virtual}: each of the "
            f"pp ranks runs virtual_stages stages; give {pp * virtual} stages, or set mesh.pp to "
            + (f"{len(stages) // virtual}" if len(stages) % virtual == 0 else f"a divisor of {len(stages)} with virtual_stages to match"))


def _schedule(spec: Any, s: dict[str, int]) -> str | None:
    pipe = spec.pipeline
    name, virtual = pipe.schedule, pipe.virtual_stages
    if name in V_SCHEDULES and virtual != 2:
        return (f"pipeline.schedule: {name} runs exactly 2 stages per rank (stage r and 2·pp − 1 − r, in a V), but "
                f"virtual_stages is {virtual}: set virtual_stages: 2")
    if name not in MULTI_STAGE_SCHEDULES and virtual != 1:
        return (f"pipeline.schedule: {name} runs one stage per rank, but virtual_stages is {virtual}: set virtual_stages: 1, "
                "or take an interleaved schedule (Interleaved1F1B, InterleavedZeroBubble, LoopedBFS)")
    return None


def _microbatches(spec: Any, s: dict[str, int]) -> str | None:
    pipe, pp = spec.pipeline, s["pp"]
    m = pipe.microbatches
    if m is None:
        return None
    if pipe.schedule == "1F1B" and m < pp:
        return (f"pipeline.microbatches: 1F1B needs at least as many microbatches as pipeline ranks (pp = {pp}), "
                f"not {m}: with fewer, a rank waits with nothing to run; give {pp} or more")
    if pipe.schedule in MULTI_STAGE_SCHEDULES and m % pp:
        return (f"pipeline.microbatches: {pipe.schedule} sends the microbatches round the pp ranks in groups of pp = {pp}, "
                f"and {m} is not a multiple of it: give {(m // pp + 1) * pp}" + (f" or {m // pp * pp}" if m > pp else ""))
    return None


def _local_batch(spec: Any, s: dict[str, int]) -> str | None:
    pipe, batch, dp = spec.pipeline, spec.training.global_batch, s["dp_replicate"] * s["dp_shard"]
    if batch is None or batch % dp:
        return None  # TP123's
    local = batch // dp
    if pipe.microbatches is not None and local % pipe.microbatches:
        return (f"pipeline.microbatches: each data-parallel rank's batch of {local} sequences (training.global_batch {batch} "
                f"/ dp_replicate·dp_shard {dp}) does not split into {pipe.microbatches} microbatches: "
                f"give a divisor of {local}, or change the batch")
    if pipe.microbatch_size is not None and local % pipe.microbatch_size:
        return (f"pipeline.microbatch_size: each data-parallel rank's batch of {local} sequences (training.global_batch {batch} "
                f"/ dp_replicate·dp_shard {dp}) is not a whole number of microbatches of {pipe.microbatch_size}: "
                f"give a divisor of {local}")
    return None


def _checks(spec: Any) -> list[_Check]:
    checks = [_Check(("dp_shard", "cp", "tp", "ep"), ("mesh", "ep"), "TP122", _ep)]
    if spec.pipeline is not None:
        checks += [
            _Check(("pp",), ("pipeline", "stages"), "TP150", _stage_count),
            _Check((), ("pipeline", "schedule"), "TP151", _schedule),
            _Check(("pp",), ("pipeline", "microbatches"), "TP152", _microbatches),
        ]
        if spec.training is not None:
            key = ("pipeline", "microbatches" if spec.pipeline.microbatches is not None else "microbatch_size")
            checks.append(_Check(DP_AXES, key, "TP153", _local_batch))
    if spec.training is not None:
        checks += [
            _Check(DP_AXES, ("training", "global_batch"), "TP123", _global_batch),
            _Check(("cp",), ("training", "seq"), "TP124", _seq),
        ]
    if spec.fsdp is not None:
        checks.append(_Check(("dp_shard",), ("fsdp", "reshard_after_forward"), "TP125", _reshard))
    return checks


def _run_checks(spec: Any, source: "SourceMap", mesh: NamedMesh, sized: list[dict[str, int | None]], *, after_world: bool) -> list[Problem]:
    """The checks whose axes are all known in `sized` (before the world: those not reading
    the rest axis; after it: only those that do, the others were reported already)."""
    problems: dict[str, Problem] = {}
    rest = mesh.rest_axis
    for check in _checks(spec):
        if (rest in check.uses) != after_world:
            continue
        for sizes in sized:
            if any(sizes[axis] is None for axis in check.uses):
                continue
            message = check.find(spec, sizes)
            if message is not None:
                problems.setdefault(message, error(check.code, message, source.file, *source.locate(check.key)))
    return list(problems.values())


def sized_problems(spec: Any, sizes: dict[str, int]) -> list[tuple[str, str]]:
    """(code, message) of each check `spec`'s sections fail at the resolved `sizes`, unlocated:
    `tpplan fit` asks this of every layout of a world (a plan per layout would be parsed
    thousands of times)."""
    return [(check.code, message) for check in _checks(spec) if (message := check.find(spec, sizes)) is not None]


def load_problems(spec: Any, source: "SourceMap") -> list[Problem]:
    """The errors of a version 2 plan's sizes that need no world size."""
    mesh = NamedMesh.of(spec)
    rests = [axis for axis in WORLD_AXES if mesh.sizes[axis] == REST]
    if len(rests) > 1:
        names = f"{', '.join(rests[:-1])} and {rests[-1]} are {'both' if len(rests) == 2 else 'all'}"
        return [error("TP120", f"mesh: {names} -1: at most one axis takes the rest of the world; give the others their sizes",
                      source.file, *source.locate(("mesh", rests[1])))]
    return _run_checks(spec, source, mesh, list(mesh.candidates()), after_world=False)


def world_problems(plan: Any, world: int) -> list[Problem]:
    """The product of a version 2 plan's axes against `world` ranks (the `-1` axis resolved
    to a whole number), then the checks that read the resolved axis."""
    if plan.version != 2:
        return []
    spec, source, mesh = plan.spec, plan.source, plan.mesh
    rest = mesh.rest_axis
    fits, misses = [], []
    for sizes in mesh.candidates():
        known = prod(size for axis, size in sizes.items() if axis in WORLD_AXES and size is not None)
        if rest is None:
            (fits if known == world else misses).append((sizes, f"{_product_text(sizes)} = {known}"))
        elif world % known == 0:
            fits.append(({**sizes, rest: world // known}, ""))
        else:
            misses.append((sizes, f"{world} / ({_product_text(sizes)}) = {world / known:g}"))
    if fits:
        return _run_checks(spec, source, mesh, [sizes for sizes, _ in fits], after_world=True) if rest else []
    if rest is None:
        found = "; ".join(text for _, text in misses)
        message = (f"mesh: {found}, not the world size {world}: the axes pp·dp_replicate·dp_shard·cp·tp multiply to the "
                   "number of ranks; change a size, or set one axis to -1 to take the rest")
        return [error("TP121", message, source.file, *source.locate(("mesh",), key=True))]
    found = "; ".join(text for _, text in misses)
    message = (f"mesh.{rest}: -1 takes world / (the other axes), and {found} is not a whole number: "
               f"make the other axes' product divide {world}")
    at = ("mesh", rest) if mesh.sizes[rest] == REST else ("mesh",)
    return [error("TP121", message, source.file, *source.locate(at, key=at == ("mesh",)))]


def section_warnings(plan: Any) -> list[Problem]:
    """A section whose axis has degree 1 in the plan does nothing there: likely a size forgotten."""
    if plan.version != 2:
        return []
    spec, sizes, source = plan.spec, plan.mesh.sizes, plan.source
    found = []
    if spec.experts and sizes["ep"] == 1:
        found.append(("experts", "mesh.ep is 1, so these rules place no expert on another rank: set mesh.ep, or remove the section"))
    if spec.context_parallel is not None and sizes["cp"] == 1:
        found.append(("context_parallel", "mesh.cp is 1, so no sequence is split: set mesh.cp, or remove the section"))
    if spec.fsdp is not None and sizes["dp_replicate"] == 1 and sizes["dp_shard"] == 1:
        found.append(("fsdp", "mesh.dp_replicate and mesh.dp_shard are 1, so FSDP shards nothing: set mesh.dp_shard, or remove the section"))
    return [warning("TP126", f"{key}: {text}", source.file, *source.locate((key,), key=True)) for key, text in found]


# -- what is applied ---------------------------------------------------------------------------


# What each runner applies of a version 2 plan: torchrun and `Plan.apply` apply the experts
# over ep, activation checkpointing and FSDP2/HSDP after the TP rules (sharding/); torchrun
# also the pipeline (runtime/pipelined.py: a stage per pp rank, torch's PipelineStage), and
# `Plan.apply` context parallelism after the TP rules, on CUDA (torchrun's batches are not
# cut on the sequence yet; off CUDA it is TP131); the dry run simulates the data axes,
# cp, ep, checkpointing and FSDP2 on fake tensors (runtime/dry_world.py), one rank per
# distinct position, and the pipeline stage by stage (memory/pipeline_dryrun.py).
_EVERYWHERE = ("tp", "dp_replicate", "dp_shard", "fsdp", "checkpointing", "ep", "experts")
# `training` describes the step, not the layout: the dry run plans it, torchrun sizes its inputs by it, and
# Plan.apply has nothing to do with it (the trainer sizes its own batches)
APPLIED = {"torchrun": (*_EVERYWHERE, "pp", "pipeline", "training"), "api": (*_EVERYWHERE, "cp", "context_parallel", "training"),
           "dry-run": ("tp", "dp_replicate", "dp_shard", "cp", "ep", "fsdp", "checkpointing", "context_parallel", "experts",
                       "pp", "pipeline", "training")}
_DOES = {"torchrun": "This tpplan applies", "api": "Plan.apply applies", "dry-run": "The dry run simulates"}


def unapplied(plan: Any, by: str = "torchrun") -> list[tuple[str, ...]]:
    """The keys of a version 2 plan that this tpplan checks but `by` (a key of APPLIED)
    does not apply yet: an axis not 1, or a section, beyond what it applies."""
    if plan.version != 2:
        return []
    applied = APPLIED[by]
    axes = [("mesh", axis) for axis in AXES if axis not in applied and plan.mesh.sizes[axis] != 1]
    return axes + [(key,) for key in SECTIONS if key not in applied and getattr(plan.spec, key) is not None]


def mesh_dims(plan: Any, world: int, tp: int | None = None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The device mesh a plan runs on over `world` ranks, outermost first, tp the fastest
    dim: version 2's pp above 1, its data axes above 1 (dp_replicate, dp_shard), cp above 1, then tp; version 1's
    tp alone, or (dp, tp) below the world (--fsdp's shorthand). ValueError where the
    sizes do not make the world."""
    if plan.version == 2:
        sizes = plan.mesh.resolve(world, tp)
        hsdp = sizes["dp_replicate"] > 1  # FSDP2's HSDP takes a 2-D mesh: dp_shard kept even at 1
        dims = [("pp", sizes["pp"])] if plan.mesh.sizes["pp"] != 1 or plan.spec.pipeline is not None else []
        dims += [(axis, sizes[axis]) for axis in DP_AXES if plan.mesh.sizes[axis] != 1 or hsdp]
        dims += [("cp", sizes["cp"])] if plan.mesh.sizes["cp"] != 1 else []
        dims.append((plan.mesh_axis, sizes["tp"]))
        return tuple(size for _, size in dims), tuple(name for name, _ in dims)
    tp = world if tp is None else tp
    if tp < 1 or tp > world or world % tp:
        raise ValueError(f"tp {tp} does not divide the world size ({world})")
    return tp_dims(world, tp, plan.mesh_axis)


def tp_dims(world: int, tp: int, axis: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """A version 1 plan's mesh: the TP axis alone, or (dp, tp) with --fsdp's data-parallel
    dim when tp is below the world (tp dividing it)."""
    return ((tp,), (axis,)) if tp == world else ((world // tp, tp), ("dp", axis))


def _keys_text(keys: tuple[str, ...]) -> str:
    return ", ".join("mesh.tp and rules" if key == "tp" else f"mesh.{key}" if key in AXES else key for key in keys)


class NotAppliedError(ValueError):
    """A version 2 plan sets axes or sections whose runtime does not exist yet: applying
    only its TP rules would silently ignore them. `.problem` is located at the first."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def refuse_unapplied(plan: Any, by: str = "torchrun") -> None:
    """NotAppliedError where `plan` says more than `by` applies, has an experts rule
    that the ep axis does not carry (`experts_unapplied`), or a pipeline with experts
    (`pipeline_unapplied`)."""
    keys = unapplied(plan, by)
    if not keys:
        if by in APPLIED and "experts" in APPLIED[by] and (problem := experts_unapplied(plan)) is not None:
            raise NotAppliedError(problem)
        if by in APPLIED and "pipeline" in APPLIED[by] and (problem := pipeline_unapplied(plan) or pipeline_missing(plan)):
            raise NotAppliedError(problem)
        return
    names = ", ".join(".".join(key) for key in keys)
    message = (f"not applied yet: {names}. {_DOES[by]} a version 2 plan's {_keys_text(APPLIED[by])} only "
               "(`tpplan validate` checks the rest); remove these to apply the others alone")
    if by != "torchrun" and all(key[-1] in APPLIED["torchrun"] for key in keys):
        message += f"; under torchrun, `tpplan apply` applies {_keys_text(APPLIED['torchrun'])}"
        if by == "api" and ("pipeline",) in keys:
            message += "; in Python, `plan.pipeline_stages(model, mesh)` gives this rank's stages of a pipeline"
    elif by == "torchrun" and all(key[-1] in APPLIED["api"] for key in keys):
        message += ("; `Plan.apply` applies context parallelism on CUDA, with the training loop cutting each batch "
                    "(sharding/context_parallel.py's shard_sequence)")
    at = plan.source.locate(keys[0], key=True) if plan.source is not None else (1, 1)
    raise NotAppliedError(error("TP130", message, plan.file, *at))


def pipeline_unapplied(plan: Any) -> Problem | None:
    """TP130 at the experts or context_parallel section of a version 2 plan with a
    pipeline: each stage takes the TP rules, activation checkpointing and FSDP2 (HSDP);
    experts over ep and context parallelism inside a stage are not applied yet."""
    if plan.version != 2 or plan.spec.pipeline is None:
        return None
    beside = next((key for key in ("experts", "context_parallel") if getattr(plan.spec, key)), None)
    if beside is None:
        return None
    what = {"experts": "experts over ep", "context_parallel": "context parallelism"}[beside]
    at = plan.source.locate((beside,), key=True) if plan.source is not None else (1, 1)
    return error("TP130", f"not applied yet: {beside.replace('_', ' ')} with a pipeline. Each stage takes the TP rules, "
                          f"checkpointing and FSDP2 (HSDP), not yet {what}: remove the "
                          f"pipeline or the {beside} section to apply the other", plan.file, *at)


def pipeline_missing(plan: Any) -> Problem | None:
    """TP130 at mesh.pp of a version 2 plan whose pp is above 1 with no pipeline section:
    nothing says what each pp rank runs, and running the whole model on each would
    silently be data parallelism without its gradient reduction."""
    if plan.version != 2 or plan.spec.pipeline is not None or plan.mesh.sizes["pp"] == 1:
        return None
    at = plan.source.locate(("mesh", "pp"), key=True) if plan.source is not None else (1, 1)
    return error("TP130", f"mesh.pp is {plan.mesh.sizes['pp']} but the plan has no pipeline section: nothing says which "
                          "stage each pp rank runs; add a pipeline section (its stages, schedule and microbatches) or "
                          "set mesh.pp to 1", plan.file, *at)


# What the ep axis carries of an experts rule: whole experts per ep rank, the tokens (sharded
# over the data axes) sent to them and back. dispatch all_reduce and expert_tp need the tokens
# replicated over their mesh, which ranks borrowed from dp_shard do not hold.
EP_STYLE = ("expert_parallel", "all_to_all")


def experts_unapplied(plan: Any) -> Problem | None:
    """TP130 at the first experts rule of a version 2 plan that is not expert_parallel with
    dispatch all_to_all: the one way experts are applied over the ep axis."""
    for pattern, rule in (getattr(plan.spec, "experts", None) or {}).items() if plan.version == 2 else ():
        if (rule.style, getattr(rule, "dispatch", None)) == EP_STYLE:
            continue
        what = f"{rule.style} with dispatch {rule.dispatch}" if rule.style == "expert_parallel" else rule.style
        message = (f"not applied yet: experts rule '{pattern}' is {what}. Over the ep axis this tpplan applies expert_parallel "
                   "with dispatch: all_to_all (the tokens sharded over the data axes travel to their experts' ranks and back, "
                   "as torchtitan); expert_tp and dispatch all_reduce need the tokens replicated over their mesh: give them "
                   "as a TP rule under `rules` (over tp), or write {style: expert_parallel, dispatch: all_to_all}")
        at = plan.source.locate(("experts", pattern), key=True) if plan.source is not None else (1, 1)
        return error("TP130", message, plan.file, *at)
    return None
