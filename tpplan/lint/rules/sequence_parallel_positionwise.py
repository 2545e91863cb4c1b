"""TP302: sequence_parallel on a module not known to compute each position on its own."""

from __future__ import annotations

import re

from ..facts import nested_parameters
from ..registry import Finding, LintRule
from ..text import rule_ref

# Class names of position-wise modules in torch and HuggingFace (LlamaRMSNorm,
# GELUActivation, ...). GroupNorm and BatchNorm are not: they pool over positions.
_POSITIONWISE_NAME = re.compile(r"(RMSNorm|LayerNorm|Dropout|Activation|Identity)$")


def positionwise(module) -> bool:
    from torch import nn

    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, nn.Identity, nn.Linear, nn.Embedding, nn.modules.dropout._DropoutNd)):
        return True
    if type(module).__module__ == "torch.nn.modules.activation" and not isinstance(
        module, (nn.MultiheadAttention, nn.Softmax, nn.LogSoftmax, nn.Softmin, nn.Softmax2d, nn.GLU)
    ):
        return True
    return bool(_POSITIONWISE_NAME.search(type(module).__name__))


def check(ctx):
    for fqn, rule in ctx.matched.items():
        if not rule.spec.semantics.sequence_shards:
            continue
        module = ctx.modules[fqn]
        if positionwise(module) or nested_parameters(module):
            continue  # nested parameters are TP301's
        yield Finding(ctx.at(rule), (
            f"sequence_parallel runs '{fqn or '<root>'}' ({type(module).__name__}) on one sequence shard per rank "
            f"({rule_ref(rule)}), which is only right if it computes each position on its own (norms, dropout, "
            "activations); tpplan cannot tell that of this class: if it mixes positions (attention, convolutions, "
            "shifts), gather the sequence before it (prepare_module_input: shard(1) -> replicate)"
        ))


RULE = LintRule(
    code="TP302",
    name="sequence-parallel-positionwise",
    severity="warning",
    summary="sequence_parallel on a module that may mix positions.",
    what="""
        Checks that each module under `sequence_parallel` is one tpplan knows to
        be position-wise: norms (LayerNorm, RMSNorm and classes named like
        them), dropout, activations, Identity, Linear and Embedding.
    """,
    why="""
        Under sequence parallelism each rank runs the module on its own slice of
        the sequence. A module that looks at other positions (attention, a
        convolution over time, a token shift) silently computes something else:
        no shape changes and no error, just wrong outputs at every shard border.
    """,
    model="tpplan.models.rule_examples:shift_mlp",
    failing="""
        version: 1
        rules:
          embed: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
          norm: sequence_parallel
          shift: sequence_parallel
          up: {style: colwise, input_layouts: shard(1)}
          down: {style: rowwise, output_layouts: shard(1), use_local_output: false}
    """,
    passing="""
        version: 1
        rules:
          embed: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}
          norm: {style: sequence_parallel, use_local_output: true}
          shift:
            style: prepare_module_input
            input_layouts: shard(1)
            desired_input_layouts: replicate
            use_local_output: true
          up: colwise
          down: rowwise
    """,
    check=check,
)
