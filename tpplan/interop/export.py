"""A plan as another framework's parallelism config (SPEC §7, Interop): torchtitan
0.3's `[parallelism]`/`[training]` TOML, transformers 5.25's `DistributedConfig`
(its sizes and glob plans, in transformers' own style strings) or accelerate
1.16's `ParallelismConfig` keyword arguments.

What the target has no field for is a TP140 warning located at the plan's key,
never dropped; a size the target needs and the plan leaves to the world (`-1`,
an open or several-degree `tp`) is TP141, fixed by `world=` / `tp=`. No torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable

from ..core.aliases import TRANSFORMERS_STYLES
from ..core.axes_spec import WORLD_AXES
from ..core.problems import Problem, error, warning
from ..core.yamltext import yaml_flow
from . import frameworks as fw

NOT_EXPRESSED, SIZE_UNKNOWN = "TP140", "TP141"


@dataclass
class Exported:
    """One plan as `target`'s config: `config` the data, `text` as the framework reads it
    (JSON, or TOML for torchtitan); `problems` what it could not say (TP140) or size (TP141)."""

    target: str
    config: dict[str, Any] = field(default_factory=dict)
    text: str = ""
    problems: list[Problem] = field(default_factory=list)

    @property
    def not_expressed(self) -> list[Problem]:
        return [p for p in self.problems if p.code == NOT_EXPRESSED]


class _Notes:
    """The problems of one export, each located at the plan key it is about."""

    def __init__(self, plan: Any, target: str):
        self.plan, self.target, self.problems = plan, target, []

    def _at(self, key: tuple[str, ...]) -> tuple[int, int]:
        return self.plan.source.locate(key, key=True) if self.plan.source is not None else (1, 1)

    def lost(self, key: tuple[str, ...], why: str) -> None:
        self.problems.append(warning(NOT_EXPRESSED, f"{'.'.join(key)}: not expressed in {self.target}: {why}", self.plan.file, *self._at(key)))

    def lost_rule(self, rule: Any, section: str, why: str) -> None:
        self.problems.append(warning(NOT_EXPRESSED, f"{section}.{rule.pattern}: not expressed in {self.target}: {why}", rule.file, rule.line, rule.column))

    def unsized(self, key: tuple[str, ...], why: str) -> None:
        self.problems.append(error(SIZE_UNKNOWN, f"{'.'.join(key)}: {why}", self.plan.file, *self._at(key)))


def export_plan(plan: Any, target: str, *, world: int | None = None, tp: int | None = None) -> Exported:
    """`plan` (version 1: the TP axis alone; version 2: every axis) as `target`'s config.
    `world` resolves a `-1` axis, `tp` picks one of several promised TP degrees."""
    if target not in fw.TARGETS:
        raise ValueError(f"unknown export target {target!r}: one of {', '.join(fw.TARGETS)}")
    notes = _Notes(plan, target)
    sizes = _sizes(plan, notes, world, tp, keep_rest=fw.TORCHTITAN_REST_AXIS if target == "torchtitan" else None)
    exported = Exported(target)
    if sizes is not None:
        exported.config = _WRITERS[target](plan, sizes, notes)
        if plan.loss_parallel:
            notes.lost(("loss_parallel",), "a hint for the trainer's loss, which this config does not carry")
        exported.text = _toml(exported.config) if target == "torchtitan" else json.dumps(exported.config, indent=2) + "\n"
    exported.problems = notes.problems
    return exported


# -- sizes -------------------------------------------------------------------------------------


def _sizes(plan: Any, notes: _Notes, world: int | None, tp: int | None, keep_rest: str | None) -> dict[str, int] | None:
    """{axis: size}; -1 kept on `keep_rest` (the axis the target itself sizes from the world)."""
    mesh = plan.mesh
    tp_key = ("mesh", "sizes") if plan.version == 1 else ("mesh", "tp")
    degrees = mesh.tp_degrees
    if tp is not None and degrees and tp not in degrees:
        notes.unsized(tp_key, f"the plan promises TP {', '.join(map(str, degrees))}, not {tp}: pick one of these")
        return None
    if tp is None and degrees and len(degrees) > 1:
        notes.unsized(tp_key, f"the plan promises TP {', '.join(map(str, degrees))}; a config holds one degree: pick it with --tp")
        return None
    if world is not None:
        try:
            resolved = mesh.resolve(world, tp)
        except ValueError as exc:
            notes.unsized(("mesh",), f"{exc} (--world {world})")
            return None
        if tp is not None and resolved["tp"] != tp:
            notes.unsized(tp_key, f"at --world {world} the plan's TP degree is {resolved['tp']}, not --tp {tp}")
            return None
        return resolved
    options = list(mesh.candidates())
    sizes = next((c for c in options if c["tp"] == tp), options[0])
    if tp is not None and mesh.rest_axis == "tp":  # tp open (version 1 without mesh.sizes, or tp left out): --tp gives it
        sizes = {**sizes, "tp": tp}
    if tp is not None and sizes["tp"] != tp:
        notes.unsized(tp_key, f"the plan's TP degree is {sizes['tp']} (tp left out while another axis is -1), not {tp}: set mesh.tp")
        return None
    rest = next((axis for axis in WORLD_AXES if sizes[axis] is None), None)
    if rest is None:
        return sizes
    if rest == keep_rest:
        return {**sizes, rest: -1}
    if rest == "tp":
        notes.unsized(tp_key, "the TP degree is left to the world: give it with --tp N (or the world with --world N)")
    else:
        notes.unsized(("mesh", rest), f"-1 takes the rest of the world, which {notes.target} needs as a number: give the world with --world N")
    return None


def _lost_axes(sizes: dict[str, int], axes: tuple[str, ...], notes: _Notes, why: str) -> None:
    for axis in axes:
        if sizes[axis] != 1:
            notes.lost(("mesh", axis), f"{axis} {sizes[axis]}: {why}")


def _common_losses(plan: Any, notes: _Notes, keys: tuple[str, ...], why: str) -> None:
    for key in keys:
        if getattr(plan, key, None) is not None:
            notes.lost((key,), why)


# -- transformers ------------------------------------------------------------------------------


@cache
def transformers_specs() -> dict[str, Any]:
    """transformers' style string -> the StyleSpec it means (core.aliases' one table, validated
    as plan rules, so a rule and an entry compare as the loader reads them)."""
    from ..core.schema import PlanSpec

    return dict(PlanSpec.model_validate({"version": 1, "rules": dict(TRANSFORMERS_STYLES)}).rules)


def transformers_style(spec: Any) -> str | None:
    """The first transformers string whose entry is `spec`, or None."""
    return next((name for name, entry in transformers_specs().items() if entry == spec), None)


def transformers_keys(pattern: str) -> list[str] | None:
    """A tpplan glob as transformers plan keys: `{a,b}` alternatives spelled out, `*` only as a
    whole segment (transformers' `*` is the layer number). None where no key list says it."""
    keys = _expand_braces(pattern)
    if keys is None or not pattern:
        return None
    for key in keys:
        if any(segment != "*" and any(c in segment for c in "*?[]{}") for segment in key.split(".")):
            return None
    return keys


def _expand_braces(pattern: str) -> list[str] | None:
    start = pattern.find("{")
    if start < 0:
        return [pattern]
    end = pattern.find("}", start)
    if end < 0 or "{" in pattern[start + 1 : end]:
        return None
    heads = [pattern[:start] + choice for choice in pattern[start + 1 : end].split(",")]
    tails = _expand_braces(pattern[end + 1 :])
    return None if tails is None else [head + tail for head in heads for tail in tails]


def _transformers(plan: Any, sizes: dict[str, int], notes: _Notes) -> dict[str, Any]:
    config: dict[str, Any] = {field: sizes[axis] for axis, field in fw.TRANSFORMERS_SIZES.items()}
    _lost_axes(sizes, ("cp",), notes, "transformers has no context parallelism")
    if sizes["ep"] > 1 and (sizes["ep"] % sizes["tp"] or (sizes["dp_shard"] * sizes["tp"]) % sizes["ep"]):
        notes.lost(("mesh", "ep"), f"transformers takes an ep_size that is a multiple of tp_size ({sizes['tp']}) and "
                   f"divides fsdp_size·tp_size ({sizes['dp_shard'] * sizes['tp']}); {sizes['ep']} is not, and DistributedConfig refuses it")
    if sizes["pp"] > 1 and sizes["dp_replicate"] * sizes["dp_shard"] > 1:
        notes.lost(("mesh", "pp"), "transformers refuses FSDP with pipeline parallelism (DistributedConfig raises)")
    tp_plan: dict[str, str] = {}
    for rule in plan.rules:
        style = transformers_style(rule.spec)
        keys = transformers_keys(rule.pattern)
        if style is None:
            near = "; ".join(f"'{name}' is {yaml_flow(TRANSFORMERS_STYLES[name])}" for name, entry in transformers_specs().items()
                             if entry.style == rule.spec.style)
            notes.lost_rule(rule, "rules", f"{rule.spec.style} with these options has no transformers tp_plan string"
                            + (f" ({near})" if near else ""))
        elif keys is None:
            notes.lost_rule(rule, "rules", "transformers' plan keys are module names with '*' for a layer number; this glob is no list of those")
        else:
            tp_plan.update(dict.fromkeys(keys, style))
    config["tp_plan"] = tp_plan
    config.update(_transformers_experts(plan, notes))
    config.update(_transformers_fsdp(plan, sizes, notes))
    _common_losses(plan, notes, ("context_parallel",), "transformers has no context parallelism")
    _common_losses(plan, notes, ("pipeline",), "DistributedConfig has pp_size alone: transformers splits the layers evenly with no schedule or microbatches")
    _common_losses(plan, notes, ("checkpointing",), "DistributedConfig has no activation checkpointing (the model's gradient_checkpointing_enable does it)")
    _common_losses(plan, notes, ("training",), "DistributedConfig holds no training step (TrainingArguments does)")
    return config


def _transformers_experts(plan: Any, notes: _Notes) -> dict[str, Any]:
    if not plan.experts:
        return {}
    from ..core.schema import PlanSpec

    ep_plan: dict[str, str] = {}
    implementations: set[str] = set()
    for pattern, spec in plan.experts.items():
        dispatch = getattr(spec, "dispatch", None)
        whole = PlanSpec.model_validate({"version": 1, "rules": {"x": {"style": "expert_parallel", "dispatch": dispatch or "all_reduce"}}}).rules["x"]
        keys = transformers_keys(pattern)
        if spec != whole:
            notes.lost(("experts", pattern), f"{spec.style} with these options: transformers' ep_plan takes whole experts "
                       f"({fw.TRANSFORMERS_EP_DISPATCH}, expert_parallel with no other option)")
        elif keys is None:
            notes.lost(("experts", pattern), "transformers' plan keys are module names with '*' for a layer number; this glob is no list of those")
        else:
            ep_plan.update(dict.fromkeys(keys, fw.TRANSFORMERS_EP_DISPATCH))
            implementations.add(dispatch)
    out: dict[str, Any] = {"ep_plan": ep_plan}
    if len(implementations) > 1:
        notes.lost(("experts",), f"dispatches {' and '.join(sorted(implementations))}: transformers has one ep_implementation for every experts module")
    elif implementations:
        out["ep_implementation"] = implementations.pop()
    return out


# tpplan's units without fsdp.units, which transformers has no key list for
_DEFAULT_UNITS = ("tpplan's default fully_shard units (each block of the largest ModuleList, then the root) are no list of "
                  "keys: transformers shards the model's own base_model_fsdp_plan units instead; list the units in fsdp.units")


def _transformers_fsdp(plan: Any, sizes: dict[str, int], notes: _Notes) -> dict[str, Any]:
    fsdp = plan.fsdp
    if fsdp is None:
        if sizes["dp_replicate"] * sizes["dp_shard"] > 1:
            notes.lost(("mesh", "dp_shard"), _DEFAULT_UNITS)
        return {}
    out: dict[str, Any] = {"fsdp_cpu_offload": fsdp.offload}
    reshard = fsdp.reshard_after_forward
    if not isinstance(reshard, bool):
        notes.lost(("fsdp", "reshard_after_forward"), f"{reshard}: transformers' fsdp_plan frees a unit's full weight or keeps it (true or false), no group size")
    units = [unit for unit in fsdp.units or () if unit != ""]
    fsdp_plan: dict[str, str] = {}
    for unit in units:
        keys = transformers_keys(unit)
        if keys is None:
            notes.lost(("fsdp", "units"), f"{unit!r}: transformers' plan keys are module names with '*' for a layer number")
        else:
            fsdp_plan.update(dict.fromkeys(keys, fw.TRANSFORMERS_FSDP_STYLES[reshard if isinstance(reshard, bool) else True]))
    if fsdp_plan:
        out["fsdp_plan"] = fsdp_plan
    elif fsdp.units is None:
        notes.lost(("fsdp",), _DEFAULT_UNITS)
    elif not units:
        notes.lost(("fsdp", "units"), "the root alone: transformers shards the model's own base_model_fsdp_plan units then")
    precision = fsdp.mixed_precision.model_dump(exclude_none=True) if fsdp.mixed_precision is not None else {}
    out["fsdp_mixed_precision"] = precision == fw.TRANSFORMERS_MIXED_PRECISION
    if precision and not out["fsdp_mixed_precision"]:
        wanted = ", ".join(f"{key}: {value}" for key, value in fw.TRANSFORMERS_MIXED_PRECISION.items())
        notes.lost(("fsdp", "mixed_precision"), f"transformers' fsdp_mixed_precision is {{{wanted}}} or nothing")
    return out


# -- accelerate --------------------------------------------------------------------------------


def _accelerate(plan: Any, sizes: dict[str, int], notes: _Notes) -> dict[str, Any]:
    config: dict[str, Any] = {field: sizes[axis] for axis, field in fw.ACCELERATE_SIZES.items()}
    _lost_axes(sizes, ("pp",), notes, "accelerate has no pipeline parallelism")
    _lost_axes(sizes, ("ep",), notes, "accelerate has no expert parallelism")
    if sizes["dp_replicate"] > 1 and sizes["dp_shard"] == 1 and (sizes["tp"] > 1 or sizes["cp"] > 1):
        notes.lost(("mesh", "dp_replicate"), "accelerate does not compose pure replication (dp_shard 1) with tp or cp: make dp_shard > 1")
    context = plan.context_parallel
    if sizes["cp"] > 1:
        config["cp_backend"] = fw.ACCELERATE_CP_BACKEND
        config["cp_handler"] = {"cp_comm_strategy": context.rotate if context is not None else fw.ACCELERATE_CP_STRATEGIES[0]}
    if context is not None:
        notes.lost(("context_parallel", "modules"), "accelerate's context parallelism wraps the whole model's attention, not chosen modules")
        if context.buffers:
            notes.lost(("context_parallel", "buffers"), "accelerate shards the batch's tensors it is given, not named model buffers")
    if plan.rules:
        notes.lost(("rules",), f"accelerate's ParallelismConfig holds tp_size alone; its TP plan is the model's tp_plan "
                   f"(transformers: `tpplan export --to transformers` writes it)")
    _common_losses(plan, notes, ("experts",), "accelerate has no expert parallelism")
    _common_losses(plan, notes, ("fsdp", "checkpointing"), "ParallelismConfig holds sizes; accelerate's FullyShardedDataParallelPlugin takes these")
    _common_losses(plan, notes, ("pipeline",), "accelerate 1.16 has no pipeline parallelism")
    _common_losses(plan, notes, ("training",), "ParallelismConfig holds no training step")
    return config


# -- torchtitan --------------------------------------------------------------------------------


def _torchtitan(plan: Any, sizes: dict[str, int], notes: _Notes) -> dict[str, Any]:
    parallelism: dict[str, Any] = {field: sizes[axis] for axis, field in fw.TORCHTITAN_SIZES.items()}
    training: dict[str, Any] = {}
    if plan.rules:
        notes.lost(("rules",), "torchtitan's TP plan is Python code (each model's parallelize.py), not config")
    if plan.experts:
        notes.lost(("experts",), "torchtitan's expert plan is Python code (each model's parallelize.py), not config")
    context = plan.context_parallel
    if context is not None:
        balancer = fw.TORCHTITAN_LOAD_BALANCERS.get(context.load_balance)
        if balancer is None:
            notes.lost(("context_parallel", "load_balance"), f"{context.load_balance}: torchtitan's 'no balancer' is Python None, which TOML cannot write")
        else:
            parallelism["context_parallel_load_balancer"] = balancer
        notes.lost(("context_parallel", "modules"), "torchtitan applies context parallelism to each model's attention in code, not to chosen modules")
        if context.rotate != "allgather":
            notes.lost(("context_parallel", "rotate"), f"{context.rotate}: torchtitan 0.3 has no rotate method field")
        if context.buffers:
            notes.lost(("context_parallel", "buffers"), "torchtitan names the sequence-sharded buffers in code")
    fsdp = plan.fsdp
    if fsdp is not None:
        reshard = fsdp.reshard_after_forward
        if isinstance(reshard, bool):
            parallelism["fsdp_reshard_after_forward"] = fw.TORCHTITAN_RESHARD[reshard]
        else:
            notes.lost(("fsdp", "reshard_after_forward"), f"{reshard}: torchtitan's policy is always, never or default, no group size")
        if fsdp.units is not None:  # without them, tpplan's units are torchtitan's: each block, then the root
            notes.lost(("fsdp", "units"), "torchtitan chooses its fully_shard units in code (each block, then the root)")
        if fsdp.offload:
            training[fw.TORCHTITAN_OFFLOAD] = True
        if fsdp.mixed_precision is not None:
            for key, value in fsdp.mixed_precision.model_dump(exclude_none=True).items():
                _torchtitan_dtype(training, fw.TORCHTITAN_MIXED_PRECISION.get(key), value, ("fsdp", "mixed_precision", key), notes)
    if plan.training is not None:
        for key, value in plan.training.model_dump(exclude_none=True).items():
            name = fw.TORCHTITAN_TRAINING.get(key)
            if name is None:
                notes.lost(("training", key), f"{value}: torchtitan's optimizer is its [optimizer] table's name, which this export does not write")
            elif key == "dtype":
                _torchtitan_dtype(training, name, value, ("training", key), notes)
            else:
                training[name] = value
    _common_losses(plan, notes, ("checkpointing",), "torchtitan 0.3's activation checkpointing is a Python policy class (ActivationCheckpointing.Config), not a [parallelism] field")
    if (pipe := plan.pipeline) is not None:
        _torchtitan_pipeline(pipe, parallelism, notes)
    config = {"parallelism": parallelism}
    if training:
        config["training"] = training
    return config


def _torchtitan_pipeline(pipe: Any, parallelism: dict[str, Any], notes: _Notes) -> None:
    """The pipeline section as torchtitan's [parallelism] fields: the schedule, the layers
    per stage or each stage's module names, the microbatch size; what it has no field for, lost."""
    parallelism["pipeline_parallel_schedule"] = pipe.schedule
    if pipe.layers_per_stage is not None:
        parallelism["pipeline_parallel_layers_per_stage"] = pipe.layers_per_stage
    else:
        parallelism["module_fqns_per_model_part"] = pipe.stages
    if pipe.microbatch_size is not None:
        parallelism["pipeline_parallel_microbatch_size"] = pipe.microbatch_size
    elif pipe.microbatches is not None:
        notes.lost(("pipeline", "microbatches"), f"{pipe.microbatches}: torchtitan sizes microbatches (pipeline_parallel_microbatch_size), not their count")
    if pipe.virtual_stages != 1 and pipe.layers_per_stage is None:
        notes.lost(("pipeline", "virtual_stages"), "torchtitan derives the stages per rank from its module lists and the schedule")


def _torchtitan_dtype(training: dict[str, Any], name: str | None, value: str, key: tuple[str, ...], notes: _Notes) -> None:
    choices = fw.TORCHTITAN_DTYPE_CHOICES.get(name or "", ())
    if value not in choices:
        if name is None:
            notes.lost(key, f"{value}: torchtitan has no such mixed-precision field")
        else:
            notes.lost(key, f"{value}: torchtitan's {name} takes {' or '.join(fw.TORCHTITAN_DTYPES[c] for c in choices)}")
        return
    training[name] = fw.TORCHTITAN_DTYPES[value]


def _toml(config: dict[str, dict[str, Any]]) -> str:
    """Tables of scalars as TOML (json's string and number spellings are TOML's)."""
    lines = []
    for table, values in config.items():
        lines += ["" if lines else None, f"[{table}]"]
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    return "\n".join(line for line in lines if line is not None) + "\n"


_WRITERS: dict[str, Callable[[Any, dict[str, int], _Notes], dict[str, Any]]] = {
    "transformers": _transformers,
    "accelerate": _accelerate,
    "torchtitan": _torchtitan,
}
