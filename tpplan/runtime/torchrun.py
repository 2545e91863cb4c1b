"""Applying a plan for real: located application, parameter layouts, and the
`torchrun` side of `tpplan apply` (process group, mesh, plan consensus, one
forward and backward, `--check`, `--steps`).

Everything that can go wrong is data until the edge: the model and plan become
`Problem`s (located at the rule that caused them), a bad command line a
`UsageError`; the CLI prints them and picks the exit code.

    torchrun --nproc-per-node 2 -m tpplan apply --plan plans/llama_tp_sp.yaml \\
        --model tpplan.models.llama:tiny --check
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ..render.apply_report import ApplyReport, CheckResult, ParamLayout, StepsResult
from .training import TrainOptions
from .modelref import ModelRefError, build_model, make_inputs, module_structure, structure_hash
from ..core.plan import Plan, Rule
from ..core.problems import PlanError, Problem, error

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

# Codes of the problems found while applying and running a plan (see `tpplan rules`).
RULE_DOCS = {
    "TP500": "The model (or inputs) factory named by --model / --inputs raised, or returned something else than an nn.Module (or tensors).",
    "TP501": "Applying a rule's style to a module raised (e.g. colwise on a module that is not a Linear or Embedding).",
    "TP502": "The forward or backward of the parallelized model fails at this TP degree, typically a shape that the degree does not divide (heads, sequence).",
    "TP503": "The ranks of a torchrun job disagree before sharding: different plans, different models, or errors on some ranks only.",
    "TP504": "A collective failed or timed out (--timeout): another rank died, hung or never started.",
    "TP505": "--check: the outputs or gradients of the parallelized model differ from the single-device reference.",
}

DEFAULT_TIMEOUT_S = 300.0
BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


class UsageError(ValueError):
    """The command line cannot be run as given (exit 2)."""


@dataclass(frozen=True)
class ApplyOptions:
    plan: str
    model: str
    tp: int | None = None
    check: bool = False
    steps: int = 0
    inputs: str | None = None
    device: str = "auto"
    timeout: float = DEFAULT_TIMEOUT_S
    seed: int = 0
    train: TrainOptions = TrainOptions()  # memory planning (dry run), FSDP2 and the optimizer of --steps


# -- located application ---------------------------------------------------------


def first_line(exc: BaseException) -> str:
    """The exception's first line; prefixed with its class when that is not a builtin
    one, whose name says more than its message (DataDependentOutputException: aten.x)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    if lines and type(exc).__module__ != "builtins":
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


_COMM_FAILURE = re.compile(
    r"connection (closed|reset|refused)|timed out|timeout|monitoredbarrier|nccl|hccl|gloo|broken pipe|socket",
    re.IGNORECASE,
)


def is_comm_failure(exc: BaseException) -> bool:
    """A failed collective (peer died, timeout), as opposed to an error of the model or plan.
    Never under the fake process group: its collectives cannot fail."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_backend() == "fake":
        return False
    return isinstance(exc, getattr(dist, "DistError", ())) or bool(_COMM_FAILURE.search(str(exc)))


class CommFailure(Exception):
    """A collective failed on this rank; carries the TP504 problem."""

    def __init__(self, problem: Problem):
        self.problem = problem
        super().__init__(str(problem))


def shard_recorded(plan: Plan, model: "nn.Module", mesh: "DeviceMesh", report: ApplyReport, event: Callable[[str], None]) -> dict[str, Rule]:
    """`apply_plan` with a progress event per module, recording in `report` which
    rule gave each module its style and the parameters' resulting layouts."""
    rules = apply_plan(plan, model, mesh, lambda done, total, fqn: event(f"sharding {done}/{total}: {fqn or '<root>'}"))
    report.modules = {fqn: rule.spec.style for fqn, rule in rules.items()}
    report.rule_of = {fqn: rule.pattern for fqn, rule in rules.items()}
    report.rule_where = {rule.pattern: rule.where for rule in rules.values()}
    report.params = param_layouts(model, report.tp)
    return rules


def unpromised_tp_note(plan: Plan, tp: int) -> list[str]:
    """A note when `tp` is not among the plan's mesh.sizes (none when it lists none)."""
    if plan.mesh_sizes and tp not in plan.mesh_sizes:
        return [f"TP {tp} is not among the degrees the plan promises (mesh.sizes {list(plan.mesh_sizes)})"]
    return []


def _module_shapes(module: "nn.Module") -> str:
    shapes = [f"{key} {tuple(p.shape)}" for key, p in module.named_parameters(recurse=False)]
    return f", {', '.join(shapes)}" if shapes else ""


def apply_plan(plan: Plan, model: "nn.Module", mesh: "DeviceMesh", on_module: Callable[[int, int, str], None] | None = None) -> dict[str, Rule]:
    """`plan.apply(model, mesh)`, with a failure inside torch turned into a problem
    that names the module and the rule (file:line) that sharded it, and progress
    reported as `on_module(done, total, fqn)`. Returns {fqn: rule}."""
    rules = plan.match(model)
    tp_size = plan.tp_mesh(mesh).size()  # before the try: a mesh without the plan's axis is our bug, not a module's
    order = list(reversed(rules))  # Plan.apply's order: descendants first
    done: list[str] = []

    def applied(fqn: str) -> None:
        done.append(fqn)
        if on_module is not None:
            on_module(len(done), len(order), fqn)

    try:
        plan.apply(model, mesh, on_module=applied)
    except PlanError:
        raise
    except Exception as exc:  # torch raises anything from deep inside; it becomes a located problem
        if len(done) == len(order):
            raise  # not from a style (the modules are all done): a bug, shown as one
        fqn = order[len(done)]  # Plan.apply reports each module once it is parallelized
        if is_comm_failure(exc):
            raise CommFailure(comm_problem(plan, f"sharding '{fqn}'", exc)) from None
        rule, module = rules[fqn], model.get_submodule(fqn)
        raise PlanError([rule.problem(
            "TP501",
            f"{rule.spec.style} cannot shard '{fqn or '<root>'}' ({type(module).__name__}{_module_shapes(module)}) "
            f"at TP {tp_size}: {first_line(exc)}",
        )]) from None
    return rules


def comm_problem(plan: Plan, doing: str, exc: BaseException) -> Problem:
    return error(
        "TP504",
        f"{doing} failed in a collective: {first_line(exc)}; another rank probably died, hung or timed out "
        "(see its output; --timeout bounds the wait)",
        plan.file,
    )


# -- parameter layouts -------------------------------------------------------------


def _local_shapes(param: "torch.Tensor", tp: int) -> tuple[tuple[int, ...], ...]:
    """What each rank of the (1-D) TP mesh holds of `param`, as torch chunks shards."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return (tuple(param.shape),) * tp
    if param.device_mesh.ndim != 1:
        raise AssertionError("plans shard over one mesh axis; parameters live on the 1-D TP mesh")
    size = param.device_mesh.size()
    shapes = []
    for rank in range(size):
        shape = list(param.shape)
        for placement in param.placements:
            if isinstance(placement, Shard):
                dim = placement.dim % len(shape)
                shape[dim] = Shard.local_shard_size_and_offset(shape[dim], size, rank)[0]
        shapes.append(tuple(shape))
    return tuple(shapes)


def placement_text(placement: Any) -> str:
    """A torch placement in the plan's own spelling: shard(0), replicate, partial(sum)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if isinstance(placement, Shard):
        return f"shard({placement.dim})"
    if isinstance(placement, Replicate):
        return "replicate"
    if isinstance(placement, Partial):
        return f"partial({placement.reduce_op})"
    return str(placement)


def param_layouts(model: "nn.Module", tp: int) -> list[ParamLayout]:
    from torch.distributed.tensor import DTensor

    layouts = []
    for name, param in model.named_parameters():
        placements = ", ".join(map(placement_text, param.placements)) if isinstance(param, DTensor) else "-"
        layouts.append(ParamLayout(
            name=name,
            dtype=str(param.dtype).removeprefix("torch."),
            global_shape=tuple(param.shape),
            local_shapes=_local_shapes(param, tp),
            placements=placements,
            element_size=param.element_size(),
        ))
    return layouts


# -- failures in forward and backward, located -------------------------------------


class FailureLocator:
    """Keeps the stack of modules whose forward is running, so that an exception
    in a forward is reported at the module it happened in and the rule that
    sharded it (or its children), with the shapes involved."""

    def __init__(self, plan: Plan, model: "nn.Module", rules: dict[str, Rule], tp: int):
        self.plan, self.model, self.rules, self.tp = plan, model, rules, tp
        self.stack: list[tuple[str, str]] = []  # (fqn, input shapes)

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        # Per-module hooks, the entry hook prepended and the exit hook appended: they
        # wrap the hooks parallelize_module installed, so a failing input or output
        # redistribution is blamed on its module, not the parent.
        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(self._enter(name), prepend=True))
            handles.append(module.register_forward_hook(self._exit(name)))
        self.stack.clear()
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _enter(self, name: str):
        def hook(module, args):
            self.stack.append((name, _arg_shapes(args)))

        return hook

    def _exit(self, name: str):
        def hook(module, args, output):
            if self.stack and self.stack[-1][0] == name:
                self.stack.pop()

        return hook

    def problem(self, exc: BaseException) -> Problem:
        if not self.stack:
            return error("TP502", f"the backward (or the loss) fails at TP {self.tp}: {first_line(exc)}", self.plan.file)
        site, shapes = self.stack[-1]
        module = self.model.get_submodule(site)
        rule, evidence = self._blame(site)
        message = (
            f"the forward of '{site or '<root>'}' ({type(module).__name__}, input {shapes or 'none'}) "
            f"fails at TP {self.tp}: {first_line(exc)}"
        )
        if rule is None:
            return error("TP502", message + "; no rule of the plan shards this module or its children", self.plan.file)
        return rule.problem("TP502", f"{message}; {evidence}")

    def _blame(self, site: str) -> tuple[Rule | None, str]:
        """The rule most likely at fault, and the shapes that show it: an uneven shard
        inside `site` first, then the rule of `site`, of a child, of an ancestor."""
        inside = [(fqn, rule) for fqn, rule in self.rules.items() if _within(fqn, site)]
        for fqn, rule in inside:
            for text, uneven in self._shards(fqn):
                if uneven:
                    return rule, f"rule '{rule.pattern}' ({rule.spec.style}, {rule.where}) shards {text}"
        if inside:
            fqn, rule = next(((f, r) for f, r in inside if f == site), inside[0])
        else:
            ancestors = [(fqn, rule) for fqn, rule in self.rules.items() if _within(site, fqn)]
            if not ancestors:
                return None, ""
            fqn, rule = max(ancestors, key=lambda item: len(item[0]))
        shards = [text for text, _ in self._shards(fqn)]
        shown = f" and shards {'; '.join(shards[:2])}" if shards else ""
        return rule, f"rule '{rule.pattern}' ({rule.spec.style}, {rule.where}) applies to '{fqn or '<root>'}'{shown}"

    def _shards(self, fqn: str) -> list[tuple[str, bool]]:
        """(description, uneven) of each DTensor parameter of the module `fqn`."""
        from torch.distributed.tensor import DTensor, Shard

        found = []
        for key, param in self.model.get_submodule(fqn).named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                continue
            shapes = _local_shapes(param, self.tp)
            text = f"{fqn}.{key} {tuple(param.shape)} into {shapes[0]} on rank 0 ({', '.join(map(placement_text, param.placements))})"
            uneven = False
            for placement in param.placements:
                length = param.shape[placement.dim] if isinstance(placement, Shard) else 0
                if length % self.tp:
                    uneven = True
                    text += f", not divisible: dim {placement.dim} is {length}, {length} % {self.tp} = {length % self.tp}"
            found.append((text, uneven))
        return found


def _within(fqn: str, ancestor: str) -> bool:
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


def _arg_shapes(args: tuple) -> str:
    import torch

    return ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))


def run_located(locator: FailureLocator, fn: Callable[[], Any]) -> Any:
    """`fn()`, with a failure in the model's forward or backward turned into a
    located TP502 problem (and a failed collective into TP504)."""
    with locator.tracking():
        try:
            return fn()
        except Exception as exc:  # anything the user's model or torch raises becomes a located problem
            if is_comm_failure(exc):
                raise CommFailure(comm_problem(locator.plan, "the forward or backward", exc)) from None
            raise PlanError([locator.problem(exc)]) from None


# -- devices, process group, mesh --------------------------------------------------


def torchrun_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the variables torchrun sets."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UsageError(
            f"tpplan apply runs under torchrun ({', '.join(missing)} not set): "
            "torchrun --nproc-per-node N -m tpplan apply ..., or add --dry-run --tp N to simulate N ranks in this process"
        )
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    except ValueError:
        raise UsageError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them)") from None


def pick_device(choice: str) -> str:
    """The device type for `--device` (auto: cuda, then npu, then cpu)."""
    import torch

    if choice not in ("auto", *BACKENDS):
        raise UsageError(f"--device must be auto, cpu, cuda or npu, not {choice!r}")
    npu = _npu_available()
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "npu" if npu else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    if choice == "npu" and not npu:
        raise UsageError("--device npu needs torch_npu installed and an Ascend NPU visible")
    return choice


def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  registers torch.npu and the hccl backend
    except ImportError:
        return False
    import torch

    return bool(getattr(torch, "npu", None) and torch.npu.is_available())


def rank_device(device_type: str, local_rank: int) -> "torch.device":
    import torch

    if device_type == "cpu":
        return torch.device("cpu")
    getattr(torch, device_type).set_device(local_rank)
    return torch.device(device_type, local_rank)


def init_process_group(device: "torch.device", timeout: float) -> str:
    """Initialise the default group from torchrun's environment; returns the backend."""
    import torch.distributed as dist

    backend = BACKENDS[device.type]
    kwargs: dict[str, Any] = {"backend": backend, "timeout": timedelta(seconds=timeout)}
    if device.type == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: a bad device fails here, not in the first collective
    dist.init_process_group(**kwargs)
    return backend


def fsdp_tp(world_size: int, options: ApplyOptions) -> int | None:
    """The TP degree under torchrun with --fsdp N: world / N unless --tp says (and agrees)."""
    fsdp = options.train.fsdp
    if fsdp is None:
        return options.tp
    if options.tp is None and world_size % fsdp:
        raise UsageError(f"--fsdp ({fsdp}) must divide the world size ({world_size})")
    tp = options.tp if options.tp is not None else world_size // fsdp
    if fsdp * tp != world_size:
        raise UsageError(f"--fsdp ({fsdp}) x --tp ({tp}) must be the world size ({world_size})")
    return tp


def mesh_shape(world_size: int, tp: int | None, axis: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """1-D mesh of the world, or 2-D (dp, tp) when --tp is smaller than the world."""
    tp = world_size if tp is None else tp
    if tp < 1 or tp > world_size or world_size % tp:
        raise UsageError(f"--tp ({tp}) must divide the world size ({world_size})")
    if tp == world_size:
        return (tp,), (axis,)
    if axis == "dp":
        raise UsageError("the plan's mesh.axis is 'dp', the name of the data-parallel dim of a 2-D mesh: rename it (e.g. 'tp')")
    return (world_size // tp, tp), ("dp", axis)


def _synchronize(device: "torch.device") -> None:
    import torch

    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


# -- plan consensus ----------------------------------------------------------------


def plan_summary(plan: Plan) -> dict:
    return {
        "file": plan.file,
        "fingerprint": plan.fingerprint(),
        "settings": plan.spec.model_dump(mode="json", exclude={"rules", "name", "description"}),
        "rules": [
            {"pattern": r.pattern, "spec": r.spec.model_dump(mode="json", exclude_defaults=True), "line": r.line, "column": r.column}
            for r in plan.rules
        ],
    }


def rank_state(rank: int, plan: Plan | None, structure: list | None, problems: list[Problem], usage: str | None) -> dict:
    """What a rank tells the others before any sharding (plain data: it is pickled)."""
    return {
        "rank": rank,
        "host": socket.gethostname(),
        "plan": plan_summary(plan) if plan is not None else None,
        "structure": structure,
        "structure_hash": structure_hash(structure) if structure is not None else None,
        "problems": [p.to_dict() for p in problems],
        "usage": usage,
    }


def _groups(states: list[dict], key: Callable[[dict], Any]) -> list[tuple[Any, list[int]]]:
    """Ranks grouped by `key(state)`, rank 0's group first."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for state in states:
        value = key(state)
        groups.setdefault(repr(value), (value, []))[1].append(state["rank"])
    return list(groups.values())


def disagreements(states: list[dict]) -> tuple[list[str], list[Problem]]:
    """(usage errors, problems) that stop every rank before sharding: errors any
    rank had, and any difference in plan or model between ranks."""
    hosts = {s["rank"]: s["host"] for s in states}

    def ranks_text(ranks: list[int]) -> str:
        text = ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
        # Across nodes, plan files are per-node copies: the host is the clue.
        if len(set(hosts.values())) > 1:
            text += " on " + ", ".join(sorted({hosts[r] for r in ranks}))
        return text

    usage_groups = _groups(states, lambda s: s["usage"])
    everywhere = len(usage_groups) == 1  # the same on every rank: naming them adds nothing
    usage = [text if everywhere else f"{ranks_text(ranks)}: {text}" for text, ranks in usage_groups if text]
    if usage:
        return usage, []
    problems: list[Problem] = []
    groups = _groups(states, lambda s: s["problems"])
    for found, ranks in groups:
        for p in found:
            prefix = f"on {ranks_text(ranks)}: " if len(groups) > 1 else ""
            problems.append(Problem(p["code"], p["severity"], prefix + p["message"], p["file"], p["line"], p["column"]))
    if problems:
        return [], problems

    by_rank = {s["rank"]: s for s in states}
    (_, base_ranks), *others = _groups(states, lambda s: s["plan"]["fingerprint"])
    base = by_rank[base_ranks[0]]["plan"]
    for _, ranks in others:
        other = by_rank[ranks[0]]["plan"]
        differences, line, column = _plan_differences(base, other, ranks_text(base_ranks), ranks_text(ranks))
        problems.append(error(
            "TP503",
            f"the ranks hold different plans: {ranks_text(base_ranks)} {base['file']} (fingerprint {base['fingerprint']}), "
            f"{ranks_text(ranks)} {other['file']} (fingerprint {other['fingerprint']}): {'; '.join(_at_most(differences, 4))}; "
            "every rank must load the same plan",
            base["file"],
            line,
            column,
        ))
    (_, base_ranks), *others = _groups(states, lambda s: s["structure_hash"])
    for _, ranks in others:
        differences = _structure_differences(
            by_rank[base_ranks[0]]["structure"], by_rank[ranks[0]]["structure"], ranks_text(base_ranks), ranks_text(ranks)
        )
        problems.append(error(
            "TP503",
            f"the ranks built different models: {'; '.join(_at_most(differences, 4))}; the factory must build the same model on every rank",
            base["file"],
        ))
    return [], problems


def _plan_differences(a: dict, b: dict, a_ranks: str, b_ranks: str) -> tuple[list[str], int, int]:
    """What differs between two plan summaries, and where (in `a`) the first rule that differs is."""
    found = []
    for key in sorted(set(a["settings"]) | set(b["settings"])):
        if a["settings"].get(key) != b["settings"].get(key):
            found.append(f"{key} is {_yaml_value(a['settings'].get(key))} on {a_ranks} but {_yaml_value(b['settings'].get(key))} on {b_ranks}")
    a_rules, b_rules = {r["pattern"]: r for r in a["rules"]}, {r["pattern"]: r for r in b["rules"]}
    first: tuple[int, int] | None = None
    for pattern, rule in a_rules.items():
        if pattern not in b_rules:
            found.append(f"rule '{pattern}' only on {a_ranks}")
        elif b_rules[pattern]["spec"] != rule["spec"]:
            found.append(f"rule '{pattern}' is {_spec_text(rule['spec'])} on {a_ranks} but {_spec_text(b_rules[pattern]['spec'])} on {b_ranks}")
        else:
            continue
        first = first or (rule["line"], rule["column"])
    found += [f"rule '{pattern}' only on {b_ranks}" for pattern in b_rules if pattern not in a_rules]
    if not found and list(a_rules) != list(b_rules):
        found.append(f"the rules are in a different order on {b_ranks}")
    return found or ["they differ"], *(first or (1, 1))


def _spec_text(spec: dict) -> str:
    """As the plan would spell it: `{style: rowwise, output_layouts: shard(1)}`."""
    options = {k: v for k, v in spec.items() if k != "style"}
    if not options:
        return spec["style"]
    return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in {"style": spec["style"], **options}.items()) + "}"


def _yaml_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(map(_yaml_value, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _structure_differences(a: list, b: list, a_ranks: str, b_ranks: str) -> list[str]:
    """Modules missing or of another class first (the likely cause), then parameter shapes."""
    a_modules, b_modules = {m[0]: m for m in a}, {m[0]: m for m in b}
    modules, params = [], []
    for name, (_, kind, own) in a_modules.items():
        other = b_modules.get(name)
        shown = name or "<root>"
        if other is None:
            modules.append(f"module '{shown}' ({kind}) only on {a_ranks}")
        elif other[1] != kind:
            modules.append(f"module '{shown}' is {kind} on {a_ranks} but {other[1]} on {b_ranks}")
        elif other[2] != own:
            params.append(f"'{shown}' has {_param_text(own)} on {a_ranks} but {_param_text(other[2])} on {b_ranks}")
    modules += [f"module '{name}' ({m[1]}) only on {b_ranks}" for name, m in b_modules.items() if name not in a_modules]
    return modules + params


def _at_most(found: list[str], n: int) -> list[str]:
    return found[:n] + ([f"and {len(found) - n} more"] if len(found) > n else [])


def _param_text(params: list) -> str:
    return ", ".join(f"{key} {tuple(shape)} {dtype}" for key, shape, dtype in params) or "none"


def gather_states(state: dict, group: Any, timeout: float) -> list[dict]:
    """Every rank's state, or a CommFailure naming the ranks that did not arrive."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    try:
        if dist.get_backend(group) == "gloo":
            # Names the ranks that never arrive instead of one anonymous timeout.
            dist.monitored_barrier(group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
        states: list[Any] = [None] * world
        dist.all_gather_object(states, state, group=group)
    except RuntimeError as exc:
        raise CommFailure(error(
            "TP504",
            f"rank {state['rank']}: plan consensus failed within {timeout:g} s: {first_line(exc)}; "
            "a rank that dies or hangs before it loads the plan and builds the model stops all others",
            state["plan"]["file"] if state["plan"] else "<plan>",
        )) from None
    return states


# -- the torchrun run ---------------------------------------------------------------


@dataclass
class _Rank:
    rank: int
    world: int
    device: "torch.device"
    backend: str
    control: Any  # gloo group for object collectives (consensus, results)


def run_torchrun(options: ApplyOptions, on_event: Callable[[str], None] | None = None) -> ApplyReport:
    """`tpplan apply` on this rank of a torchrun job; every rank returns the same
    report verdict (rank 0's numbers). Raises UsageError for command-line errors.
    The process group is destroyed on every path."""
    import torch.distributed as dist

    rank, world, local_rank = torchrun_env()
    device = rank_device(pick_device(options.device), local_rank)
    try:
        backend = init_process_group(device, options.timeout)
    except (RuntimeError, ValueError) as exc:  # rendezvous or backend failure: nothing to tear down
        report = ApplyReport(mode="torchrun", plan_file=options.plan, model=options.model, world_size=world, device=device.type)
        report.problems = [error("TP504", f"rank {rank}: initialising the process group failed: {first_line(exc)}", options.plan)]
        return report
    try:
        control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=timedelta(seconds=options.timeout))
        ctx = _Rank(rank, world, device, backend, control)
        return _run(ctx, options, on_event or (lambda text: None))
    finally:
        dist.destroy_process_group()


def _run(ctx: _Rank, options: ApplyOptions, event: Callable[[str], None]) -> ApplyReport:
    import torch

    from ..core.loader import load_plan

    report = ApplyReport(mode="torchrun", plan_file=options.plan, model=options.model, world_size=ctx.world, device=ctx.device.type, backend=ctx.backend)
    plan = model = structure = shape = names = None
    problems: list[Problem] = []
    usage = None
    try:
        plan = load_plan(options.plan)
        report.plan_name = plan.name
        shape, names = mesh_shape(ctx.world, fsdp_tp(ctx.world, options), plan.mesh_axis)
        event("building the model")
        torch.manual_seed(options.seed)  # the same weights on every rank, even with src_data_rank: null
        model = build_model(options.model, ctx.device)
        structure = module_structure(model)
        plan.match(model)
    except PlanError as exc:
        problems = exc.problems
    except (UsageError, ModelRefError) as exc:
        usage = str(exc)

    event("comparing plans across ranks")
    try:
        states = gather_states(rank_state(ctx.rank, plan, structure, problems, usage), ctx.control, options.timeout)
    except CommFailure as exc:
        report.problems = [exc.problem]
        return report
    usage_errors, report.problems = disagreements(states)
    if usage_errors:
        raise UsageError("\n".join(usage_errors))
    if report.problems:
        return report

    assert plan is not None and model is not None
    try:
        _apply_and_run(ctx, options, plan, model, shape, names, report, event)
    except PlanError as exc:
        report.problems = exc.problems
    except CommFailure as exc:
        report.problems = [exc.problem]
    return report


def _apply_and_run(ctx: _Rank, options: ApplyOptions, plan: Plan, model: "nn.Module", shape, names, report: ApplyReport, event) -> None:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from .simulate import forward_backward

    mesh = init_device_mesh(ctx.device.type, shape, mesh_dim_names=names)
    report.tp = shape[-1]
    report.dp = shape[0] if len(shape) == 2 else 1
    report.notes += unpromised_tp_note(plan, report.tp)
    torch.manual_seed(options.seed + 1)  # the same inputs on every rank: TP ranks must see one batch
    inputs = make_inputs(options.inputs, model, ctx.device)
    reference = copy.deepcopy(model) if options.check else None

    rules = shard_recorded(plan, model, mesh, report, event)
    data_parallel = bool(options.train.fsdp) and report.dp > 1
    if data_parallel:
        from .fsdp import shard_data_parallel

        event(f"FSDP2 over dp {report.dp}")
        shard_data_parallel(model, mesh)
        report.notes.append(f"FSDP2 (fully_shard per block and root) over the dp dim of {report.dp}, after the plan")
    locator = FailureLocator(plan, model, rules, report.tp)

    event("forward and backward")
    output, report.comms = run_located(locator, lambda: forward_backward(model, inputs))
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    # The counted pass above doubles as warm-up; time a clean one.
    _synchronize(ctx.device)
    start = time.perf_counter()
    run_located(locator, lambda: _forward_backward(model, inputs))
    _synchronize(ctx.device)
    report.step_time_s = time.perf_counter() - start

    if reference is not None:
        event("checking against a single device")
        try:
            local = compare_with_reference(model, reference, inputs, output, grads)
        except Exception as exc:  # the single-device run of the user's model, or gathering the weights
            if is_comm_failure(exc):
                raise CommFailure(comm_problem(plan, "gathering the weights for --check", exc)) from None
            raise PlanError([error("TP502", f"--check: the single-device reference run fails: {first_line(exc)}", plan.file)]) from None
        report.check = _merge_checks(_gather(ctx, local, plan, "comparing the check results"))
        if not report.check.passed:
            report.problems.append(error("TP505", f"--check failed: {report.check.problems[0]}", plan.file))
    if options.steps:
        from .training import OPTIMIZER_NAMES, compare_training, train_steps

        name = options.train.optimizer_name
        event(f"{options.steps} {OPTIMIZER_NAMES[name]} steps")
        losses, times = run_located(locator, lambda: train_steps(
            model, inputs, options.steps, name, plan.loss_parallel, options.seed, lambda: _synchronize(ctx.device)
        ))
        report.steps = StepsResult(losses, times, OPTIMIZER_NAMES[name])
        if reference is not None:
            event(f"checking {options.steps} steps against a single device")
            trained = _merge_checks(_gather(ctx, compare_training(model, reference, inputs, losses, name, options.seed), plan, "comparing the training"))
            if not trained.passed:
                report.problems.append(error("TP505", f"--check --steps {options.steps} failed: {trained.problems[0]}", plan.file))
            report.check = CheckResult(report.check.passed and trained.passed, max(report.check.max_abs_diff, trained.max_abs_diff), report.check.problems + trained.problems)

    # The per-rank bytes come from the layouts (shard sizes as torch chunks them);
    # every real rank checks that it holds what its TP coordinate predicts
    # (under FSDP2 it holds a dp shard of that: the memory planner's figure).
    if data_parallel:
        return
    held = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    predicted = report.rank_bytes[ctx.rank % report.tp]  # mesh ranks are row-major: tp is the fastest dim
    assert held == predicted, f"rank {ctx.rank} holds {held} parameter bytes, its layout says {predicted}"


def _local(t: "torch.Tensor") -> "torch.Tensor":
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _forward_backward(model: "nn.Module", inputs: tuple) -> None:
    from .simulate import scalar_loss

    scalar_loss(model(*inputs)).backward()


def _gather(ctx: _Rank, value: Any, plan: Plan, doing: str) -> list[Any]:
    import torch.distributed as dist

    values: list[Any] = [None] * ctx.world
    try:
        dist.all_gather_object(values, value, group=ctx.control)
    except RuntimeError as exc:
        raise CommFailure(comm_problem(plan, doing, exc)) from None
    return values


# -- --check and --steps -------------------------------------------------------------


def _full(t: "torch.Tensor") -> "torch.Tensor":
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def compare_with_reference(model: "nn.Module", reference: "nn.Module", inputs: tuple, output: Any, grads: dict) -> CheckResult:
    """This rank's outputs and gradients (`grads`: {name: grad} of the sharded run)
    against a single-device run of `reference` loaded with the sharded model's
    weights gathered to full tensors. Tolerances as simulate.check_parity's."""
    import torch

    from .simulate import allowed_diff, max_abs_diff, output_tensors, scalar_loss, tolerance

    with torch.no_grad():
        for name, param in model.named_parameters():
            reference.get_parameter(name).copy_(_full(param))
        for name, buffer in model.named_buffers():
            reference.get_buffer(name).copy_(_full(buffer))
    ref_output = reference(*inputs)
    scalar_loss(ref_output).backward()

    problems: list[str] = []
    got_outputs, want_outputs = output_tensors(output), output_tensors(ref_output)
    if len(got_outputs) != len(want_outputs):
        problems.append(f"the output has {len(got_outputs)} tensors, the single-device one {len(want_outputs)}")
    pairs = [(f"output {i}", got, want) for i, (got, want) in enumerate(zip(got_outputs, want_outputs))]
    pairs += [(f"{name} grad", grads.get(name), param.grad) for name, param in reference.named_parameters()]
    worst = 0.0
    for what, got, want in pairs:
        if got is None or want is None:
            if (got is None) != (want is None):
                problems.append(f"{what} is {'missing' if got is None else 'unexpected'}")
            continue
        got = _full(got)
        if got.shape != want.shape:
            problems.append(f"{what}: shape {tuple(got.shape)}, single device {tuple(want.shape)}")
            worst = math.inf
            continue
        diff, limit = max_abs_diff(got, want), allowed_diff(want, *tolerance(want.dtype))
        if not diff <= limit:  # also catches NaN
            problems.append(f"{what} differs by up to {diff:.3g} (allowed {limit:.3g})")
        worst = math.inf if math.isnan(diff) else max(worst, diff)
    return CheckResult(passed=not problems, max_abs_diff=worst, problems=problems)


def _merge_checks(results: list[CheckResult]) -> CheckResult:
    problems = [f"rank {rank}: {text}" for rank, result in enumerate(results) for text in result.problems]
    return CheckResult(
        passed=all(r.passed for r in results),
        max_abs_diff=max(r.max_abs_diff for r in results),
        problems=_at_most(problems, 10),
    )


def sgd_steps(model: "nn.Module", inputs: tuple, steps: int, device: "torch.device", seed: int) -> StepsResult:
    """`steps` SGD steps (lr 1e-2) towards fixed random targets (`training.train_steps`)."""
    from .training import train_steps

    losses, times = train_steps(model, inputs, steps, "sgd", seed=seed, synchronize=lambda: _synchronize(device), lr=1e-2)
    return StepsResult(losses=losses, step_times_s=times)
