"""Located application: the plan applied to a model, and the model run, with a
failure of the user's model or plan turned into a problem at the rule that caused
it (TP501 while sharding, TP502 in the forward or backward, TP507 where torch
itself has no DTensor rule for an op the plan's DTensors reach): torch's errors,
the model's, and the `StyleInputError`s tpplan's styles raise for input they cannot
take. Any other exception raised in tpplan's own code is a tpplan bug: it escapes
unchanged, for the CLI to show as one."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.placements import placements_text
from ..core.plan import Plan, Rule
from ..core.problems import PlanError, Problem, StyleInputError, error, raised_by_tpplan, reason
from ..sharding.apply import ModuleShardingError, apply_experts, apply_plan
from .comm import CommFailure, comm_problem, is_comm_failure
from .layouts import local_shapes

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh



@dataclass(frozen=True)
class Sharded:
    """Which rule gave each module its style: {fqn: rule}, and its report fields;
    `under` the module the rules' paths start from (`Plan.module_tree`)."""

    rules: dict[str, Rule]
    under: str = ""

    @property
    def note(self) -> str | None:
        """What the report says when the rules applied under peft's wrapper."""
        return f"the model is peft's PeftModel: the plan's rules apply to the model it wraps, at '{self.under}'" if self.under else None

    @property
    def modules(self) -> dict[str, str]:
        return {fqn: rule.spec.style for fqn, rule in self.rules.items()}

    @property
    def rule_of(self) -> dict[str, str]:
        return {fqn: rule.pattern for fqn, rule in self.rules.items()}

    @property
    def rule_where(self) -> dict[str, str]:
        return {rule.pattern: rule.where for rule in self.rules.values()}


def shard_with_progress(plan: Plan, model: "nn.Module", mesh: "DeviceMesh", event: Callable[[str], None]) -> Sharded:
    """`apply_located`, then a version 2 plan's context parallelism and experts over ep
    (after the TP rules, in torchtitan's order), with a progress event per module.
    Context parallelism on this CPU mesh needs `device_rules.context_parallel_rules()`
    around the call and the step (the memory plan's)."""
    from ..sharding.context_parallel import apply_context_parallel

    rules = apply_located(plan, model, mesh, lambda done, total, fqn: event(f"sharding {done}/{total}: {fqn or '<root>'}"))
    apply_context_parallel(plan, model, mesh)
    experts = _located(plan, lambda: apply_experts(plan, model, mesh, lambda done, total, fqn: event(f"experts over ep {done}/{total}: {fqn}")))
    return Sharded({**rules, **experts}, plan.module_tree(model)[1])


def unpromised_tp_note(plan: Plan, tp: int) -> list[str]:
    """A note when `tp` is not among the plan's mesh.sizes (none when it lists none)."""
    if plan.mesh_sizes and tp not in plan.mesh_sizes:
        return [f"TP {tp} is not among the degrees the plan promises (mesh.sizes {list(plan.mesh_sizes)})"]
    return []


def apply_located(plan: Plan, model: "nn.Module", mesh: "DeviceMesh", on_module: Callable[[int, int, str], None] | None = None) -> dict[str, Rule]:
    """The applier's `apply_plan` (sharding/apply.py), with a module that cannot be
    sharded a TP501 problem at its rule and a failed collective while sharding a
    TP504 (`CommFailure`); progress reported as `on_module(done, total, fqn)`.
    Returns {fqn: rule}."""
    return _located(plan, lambda: apply_plan(plan, model, mesh, on_module))


def _located(plan: Plan, apply: Callable[[], dict]) -> dict:
    try:
        return apply()
    except ModuleShardingError as failed:
        if is_comm_failure(failed.error):
            raise CommFailure(comm_problem(plan, f"sharding '{failed.fqn}'", failed.error)) from None
        raise PlanError(failed.problems) from None  # the problem at the rule is the whole story: torch's traceback off


class FailureLocator:
    """Keeps the stack of modules whose forward is running, so that an exception
    in a forward is reported at the module it happened in and the rule that
    sharded it (or its children), with the shapes involved."""

    def __init__(self, plan: Plan, model: "nn.Module", rules: dict[str, Rule], tp: int):
        self.plan, self.model, self.rules, self.tp = plan, model, rules, tp
        self.stack: list[tuple[str, str]] = []  # (fqn, input shapes)
        self.dtensor_from: str | None = None  # the last planned module whose output was a DTensor

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
        self.dtensor_from = None
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
            if name in self.rules and _holds_dtensor(output):
                self.dtensor_from = name

        return hook

    def problem(self, exc: BaseException) -> Problem:
        op = no_rule_op(exc)
        if op is not None:
            return self._no_rule_problem(op)
        if not self.stack:
            return error("TP502", f"the backward (or the loss) fails at TP {self.tp}: {reason(exc)}", self.plan.file)
        site, shapes = self.stack[-1]
        module = self.model.get_submodule(site)
        message = (
            f"the forward of '{site or '<root>'}' ({type(module).__name__}, input {shapes or 'none'}) "
            f"fails at TP {self.tp}: {reason(exc)}"
        )
        if isinstance(exc, StyleInputError) and site in self.rules:
            # The style's own hook raised: its rule is the one at fault, no guessing.
            rule = self.rules[site]
            return rule.problem("TP502", f"{message} ({rule.spec.style}, rule '{rule.pattern}')")
        rule, evidence = self._blame(site)
        if rule is None:
            return error("TP502", message + "; no rule of the plan shards this module or its children", self.plan.file)
        return rule.problem("TP502", f"{message}; {evidence}")

    def _no_rule_problem(self, op: str) -> Problem:
        """TP507: torch's limit, not the plan's; located at the rule whose DTensor
        output reached the op (the last planned module that returned one)."""
        where = f"in the forward of '{self.stack[-1][0] or '<root>'}'" if self.stack else "in the backward"
        message = (
            f"torch has no DTensor rule for {op} on cuda (nor on the simulating CPU), reached {where} at TP {self.tp}: "
            "the plan runs into a limit of torch, not a mistake of its own"
        )
        hint = "hand the module plain tensors before the op (use_local_output: true on the rule, or a prepare_module_input rule with use_local_output: true)"
        rule = self.rules.get(self.dtensor_from) if self.dtensor_from is not None else None
        if rule is None:
            return error("TP507", f"{message}; {hint}", self.plan.file)
        return rule.problem("TP507", f"{message}; DTensor inputs reach it from rule '{rule.pattern}' ({rule.spec.style}, {rule.where}); {hint}")

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
            shapes = local_shapes(param, self.tp)
            text = f"{fqn}.{key} {tuple(param.shape)} into {shapes[0]} on rank 0 ({placements_text(param.placements)})"
            uneven = False
            for placement in param.placements:
                length = param.shape[placement.dim] if isinstance(placement, Shard) else 0
                if length % self.tp:
                    uneven = True
                    text += f", not divisible: dim {placement.dim} is {length}, {length} % {self.tp} = {length % self.tp}"
            found.append((text, uneven))
        return found


_NO_RULE = re.compile(r"Operator (\S+?)(?:\.default)? does not have a sharding strategy registered")


def no_rule_op(exc: BaseException) -> str | None:
    """`aten.X` when `exc` is DTensor's "no sharding strategy" error for it."""
    found = _NO_RULE.search(str(exc)) if isinstance(exc, NotImplementedError) else None
    return found.group(1) if found else None


def _holds_dtensor(output: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(output, (tuple, list)):
        return any(_holds_dtensor(item) for item in output)
    return isinstance(output, DTensor)


def _within(fqn: str, ancestor: str) -> bool:
    return ancestor == "" or fqn == ancestor or fqn.startswith(ancestor + ".")


def _arg_shapes(args: tuple) -> str:
    import torch

    return ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor))


def run_located(locator: FailureLocator, fn: Callable[[], Any]) -> Any:
    """`fn()`, with a failure in the model's forward or backward turned into a
    located TP502 problem (and a failed collective into TP504). The traceback torch logs
    for a failing fake kernel (DTensor propagates shapes on fake tensors even with real
    values: a rowwise shard of 43 of 128 features) is off: the failure is reported here."""
    from ..core.quiet import loggers_quiet

    with locator.tracking(), loggers_quiet("torch._subclasses.fake_tensor"):
        try:
            return fn()
        except Exception as exc:  # anything the user's model or torch raises becomes a located problem
            if raised_by_tpplan(exc):
                raise  # tpplan's own code (the hooks, the loss): a bug, shown as one
            if is_comm_failure(exc):
                raise CommFailure(comm_problem(locator.plan, "the forward or backward", exc)) from None
            raise PlanError([locator.problem(exc)]) from exc  # the cause kept: a caller may quote torch's own words
