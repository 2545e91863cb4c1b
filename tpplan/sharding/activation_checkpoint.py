"""Activation checkpointing from a version 2 plan's `checkpointing` section (SPEC §7),
applied after the TP rules and before FSDP2, in torchtitan's order.

torch's composable `checkpoint` on each module the globs match: the module's forward
activations are freed and recomputed in backward, and its parameter names stay as
they were (a checkpoint, `--check`'s comparison and FSDP2 see the same module tree).
`mode: selective` is torch's op-level SAC (`create_selective_checkpoint_contexts`),
with torchtitan's policy: keep the outputs of matmuls, attention and the
collectives (what is costly to recompute, or would communicate again), recompute
the rest (norms, activations, elementwise ops).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..core.problems import PlanError
from ..core.sections import claim_section

if TYPE_CHECKING:
    from torch import nn


def _saved_ops() -> set:
    import torch

    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
    return {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.linear.default,
            aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_flash_attention_for_cpu.default, aten._scaled_dot_product_cudnn_attention.default,
            c10d.reduce_scatter_tensor.default, c10d.all_gather_into_tensor.default, c10d.all_reduce.default}


def _selective_context():
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def apply_activation_checkpointing(plan: Any, model: "nn.Module") -> list[str]:
    """Checkpoint the modules the plan's `checkpointing.modules` match (a glob matching
    none is TP200 at the glob, a module two globs match TP201); returns their fqns, none without the section."""
    from torch.distributed._composable import checkpoint

    spec = plan.spec.checkpointing if plan.version == 2 else None
    if spec is None:
        return []
    tree, under = plan.module_tree(model)
    claimed, problems = claim_section(plan, tree, under, "checkpointing.modules")
    if problems:  # what `validate --model` reports: TP200/TP201 at the glob
        raise PlanError(problems)
    fqns = list(claimed)
    kwargs = {"context_fn": _selective_context} if spec.mode == "selective" else {}
    for fqn in fqns:
        checkpoint(model.get_submodule(fqn) if fqn else model, **kwargs)
    return fqns
