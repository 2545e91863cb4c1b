"""A loaded plan: its rules, strict resolution against a model, and application.

Importing this module does not import torch; resolving against a model or
applying does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from .globs import Glob, ModuleTree
from .problems import PlanError, Problem, error
from .sections import SectionGlob, claim, claim_section, claimed_twice

if TYPE_CHECKING:
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh

    # annotations only: `tpplan rules` need not import pydantic
    from .axes import NamedMesh
    from .schema import PlanSpec, StyleSpec
    from ..sharding.styles import ParallelStyle
    from .yamlsource import SourceMap


# Where peft's PeftModel holds the model it wraps (PeftModel.base_model is a
# LoraModel, whose `model` it is).
PEFT_PREFIX = "base_model.model"


@dataclass(frozen=True)
class Rule:
    pattern: str
    spec: StyleSpec
    glob: Glob
    file: str
    line: int
    column: int

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def problem(self, code: str, message: str) -> Problem:
        return error(code, message, self.file, self.line, self.column)


class Plan:
    def __init__(self, spec: PlanSpec, rules: list[Rule], file: str, source: "SourceMap | None" = None):
        self.spec = spec
        self.rules = rules  # with `extends`, inherited rules keep their own file and line
        self.file = file
        self.source = source  # where each key of `file` is, for problems about the plan as a whole
        self.text: str | None = None  # the YAML it was loaded from (load_plan sets it)

    name = property(lambda self: self.spec.name)
    description = property(lambda self: self.spec.description)
    version = property(lambda self: self.spec.version)
    src_data_rank = property(lambda self: self.spec.src_data_rank)
    loss_parallel = property(lambda self: self.spec.loss_parallel)

    @property
    def mesh(self) -> "NamedMesh":
        """Every axis of the plan by name (a version 1 plan: tp alone, every other axis 1)."""
        from .axes import NamedMesh

        return NamedMesh.of(self.spec)

    @property
    def mesh_axis(self) -> str:
        """The mesh dim the TP rules shard over (version 2 names it tp)."""
        return self.spec.mesh.axis if self.version == 1 else "tp"

    @property
    def mesh_sizes(self) -> list[int] | None:
        """The TP degrees the plan promises (version 1's mesh.sizes, version 2's mesh.tp), or None."""
        degrees = self.mesh.tp_degrees
        return list(degrees) if degrees else None

    # version 2's sections (None where the plan has none, and in every version 1 plan)
    pipeline = property(lambda self: getattr(self.spec, "pipeline", None))
    experts = property(lambda self: getattr(self.spec, "experts", None))
    context_parallel = property(lambda self: getattr(self.spec, "context_parallel", None))
    fsdp = property(lambda self: getattr(self.spec, "fsdp", None))
    checkpointing = property(lambda self: getattr(self.spec, "checkpointing", None))
    training = property(lambda self: getattr(self.spec, "training", None))

    def __repr__(self) -> str:
        return f"Plan({self.name or self.file!r}, {len(self.rules)} rules)"

    def fingerprint(self) -> str:
        """Hash of what the plan means (not how it is written): equal plans, equal hashes."""
        import hashlib  # only the runtime needs it: keep plan-only start-up lean
        import json

        # Rule order is not part of the meaning: rules are resolved and applied in
        # module order, so sort_keys may reorder them.
        meaning = self.spec.model_dump(mode="json", exclude={"name", "description"})
        return hashlib.sha256(json.dumps(meaning, sort_keys=True).encode()).hexdigest()[:16]

    def match(self, model_or_names: "nn.Module | Iterable[str]") -> dict[str, Rule]:
        """{concrete module path: the rule that claims it}, in module order.

        Strict: a rule matching no module, or a module matched by two rules, is
        a PlanError (torch would warn and skip, or fail deep inside).
        """
        claimed, problems = self.claim(model_or_names)
        if problems:
            raise PlanError(problems)
        return claimed

    def match_experts(self, model_or_names: "nn.Module | Iterable[str]") -> dict[str, "SectionGlob"]:
        """{concrete module path: the `experts` rule that claims it}, in module order (none
        without the section). Strict as `match`: a glob matching nothing is TP200, a module
        two experts rules match, or that a TP rule matches too, TP201 (a PlanError)."""
        if self.version != 2 or not self.spec.experts:
            return {}
        tree, under = self.module_tree(model_or_names)
        claimed, problems = claim_section(self, tree, under, "experts")
        problems += claimed_twice(self.match(model_or_names), claimed)
        if problems:
            raise PlanError(problems)
        return claimed

    def claim(self, model_or_names: "nn.Module | Iterable[str]") -> tuple[dict[str, Rule], list[Problem]]:
        """What `match` resolves, without raising: {module path: the first rule that
        matches it}, in module order, and the problems (TP200, TP201), sorted. The
        model checks run on the claimed modules even when there are problems."""
        tree, under = self.module_tree(model_or_names)
        return claim(tree, self.rules, under)

    def module_tree(self, model_or_names: "nn.Module | Iterable[str]") -> tuple[ModuleTree, str]:
        """The model's module paths as a tree, and the module the rules' paths start
        from: "" (the model itself), or `PEFT_PREFIX` for peft's PeftModel (its one
        child `base_model`, the wrapped model at `base_model.model`) when no rule
        starts with `base_model`: a plan written for the model inside applies to the
        PeftModel as it is (claimed paths are the PeftModel's, prefix included)."""
        names = model_or_names
        if hasattr(model_or_names, "named_modules"):
            names = (name for name, _ in model_or_names.named_modules())
        tree = ModuleTree(names)
        top = tree.root.children
        peft = set(top) == {"base_model"} and "model" in top["base_model"].children
        written_for_it = any(rule.glob.segments[:1] and rule.glob.segments[0].text == "base_model" for rule in self.rules)
        return tree, PEFT_PREFIX if peft and not written_for_it else ""

    def resolve(self, model: "nn.Module") -> dict[str, "ParallelStyle"]:
        """{concrete module path: a fresh ParallelStyle}, in module order."""
        from ..sharding.apply import resolve

        return resolve(self, model)

    def tp_mesh(self, mesh: "DeviceMesh") -> "DeviceMesh":
        """The 1-D mesh the plan shards over: `mesh` itself, or its `mesh.axis` dimension."""
        if mesh.ndim == 1:
            return mesh
        names = mesh.mesh_dim_names or ()
        if self.mesh_axis not in names:
            raise ValueError(
                f"the plan shards over mesh axis '{self.mesh_axis}' but the {mesh.ndim}-D mesh has dims "
                f"{tuple(names)}: name one dim '{self.mesh_axis}' (init_device_mesh(..., mesh_dim_names=...)) "
                "or set mesh.axis in the plan"
            )
        return mesh[self.mesh_axis]

    def pipeline_stages(self, model: "nn.Module", mesh: "DeviceMesh") -> list["nn.Module"]:
        """A version 2 plan with a `pipeline`: this rank's stages of `model` over `mesh`
        (`build_mesh`, pp outermost), for torch's `PipelineStage` and schedule. The TP rules
        and activation checkpointing apply to `model`, which is then cut into the stages
        this pp rank runs (one, or several for interleaved and V schedules), each keeping
        the model's parameter names (a DCP checkpoint reshards across PP degrees) and
        running its forward with the other stages' modules removed, FSDP2 on each over
        the mesh's data dims. The last stage is `model` itself. In the order of
        `stage_ids(mesh)`; `save_checkpoint` and `load_checkpoint` take the list.
        (sharding/pipeline.py)"""
        from ..sharding.pipeline import apply_pipeline
        from .axes import refuse_unapplied

        if self.pipeline is None:
            raise ValueError("the plan has no pipeline section: apply it with plan.apply(model, mesh)")
        refuse_unapplied(self, "torchrun")
        return apply_pipeline(self, model, mesh)

    def stage_ids(self, mesh: "DeviceMesh") -> list[int]:
        """The indices of the pipeline stages this rank runs on `mesh` (`build_mesh`), in
        the order `pipeline_stages` returns them (for torch's `PipelineStage`)."""
        from .stages import rank_stages

        if self.pipeline is None:
            raise ValueError("the plan has no pipeline section")
        pipe = self.spec.pipeline
        return rank_stages(mesh["pp"].get_local_rank(), mesh["pp"].size(), pipe.virtual_stages, pipe.schedule)

    def apply(self, model: "nn.Module", mesh: "DeviceMesh", on_module: "Callable[[str], None] | None" = None) -> "nn.Module":
        """Parallelize `model` in place over the plan's mesh axis; returns it.

        Tied parameters stay tied (one parameter, whole gradient); tied parameters
        that the plan lays out differently are a PlanError (TP210), and so is a
        module its rule's style cannot shard (TP501, a `ModuleShardingError`
        naming the rule, the module and torch's error). `on_module(fqn)` is called
        after each module is parallelized (progress). The work is sharding/apply.py's
        `apply_plan`, the one applier, which the runtime calls too.

        With a mesh that has data-parallel dims (`build_mesh`: dp_replicate,
        dp_shard), FSDP2 (HSDP with dp_replicate) follows the TP rules, on the plan's
        `fsdp` units and policies (sharding/data_parallel.py), after activation
        checkpointing of the `checkpointing` section's modules (torchtitan's order).
        The `experts` rules apply after the TP rules, over the ep dim of the mesh's expert
        view (FSDP2 then shards the experts over efsdp). With a `cp` dim, context
        parallelism follows the TP rules on CUDA (sharding/context_parallel.py: shard each
        batch with its `shard_sequence`; on another device a PlanError, TP131, before
        anything is applied). A version 2 plan that sets axes or sections not applied yet
        (pp, training) is refused (axes.NotAppliedError, a ValueError located
        at the first): applying the rest alone would ignore them.
        """
        from ..sharding.apply import apply_every_axis
        from .axes import refuse_unapplied

        refuse_unapplied(self, "api")
        apply_every_axis(self, model, mesh, None if on_module is None else lambda done, total, fqn: on_module(fqn))
        return model

    def build_mesh(self, world: int, device_type: str = "cpu", tp: int | None = None) -> "DeviceMesh":
        """The named device mesh this plan runs on over `world` ranks (in a process group
        of that size): a version 2 plan's data axes above 1, then tp, the fastest;
        ValueError where its sizes do not make the world (`tpplan validate --world N`
        says where). With `experts` rules, the expert view (dp_replicate, efsdp, ep:
        ep borrowed from dp_shard·cp·tp, as torchtitan) is unflattened from the same
        ranks now and found again by `apply` (sharding/expert_mesh.py)."""
        from ..sharding.apply import build_mesh

        return build_mesh(self, world, device_type, tp)
