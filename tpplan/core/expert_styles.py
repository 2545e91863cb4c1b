"""tpplan's styles beyond torch's (SPEC §2a), as entries of the style table:
expert_tp and expert_parallel on fused 3-D expert modules, local_params for
a module whose parameters are replicated inside a sharded region, and
sum_output_grad for a whole module whose output every rank's shard uses. No torch here;
the styles themselves are in sharding/experts.py, sharding/params.py and
sharding/grad_sum.py.

No `from __future__ import annotations` here: pydantic would compile every
field's annotation string at start-up.
"""

from typing import Literal, Optional

from pydantic import Field, model_validator

from .style_model import (
    _REPLICATE,
    _SHARD0,
    Layout,
    StyleSemantics,
    StyleSpec,
    _InputOptions,
)



class _ExpertOptions(StyleSpec):
    input_layouts: Layout | None = Field(None, description="Layout of the hidden states; default replicate.")
    output_layouts: Layout | None = Field(
        None, description="The partial output is reduced to it: replicate (all-reduce, default) or shard(D) (reduce-scatter)."
    )
    use_local_output: bool = True

    def declared_input(self):
        return (self.input_layouts, False) if self.input_layouts is not None else (_REPLICATE, True)

    def natural_output(self):
        return self.output_layouts or _REPLICATE


# The experts' hidden states, token indices and routing weights are all handed on
# (first_tensor); parameter placements depend on the module's layout and the
# options: tpplan.sharding.experts.expert_placements, read by lint/facts.py.
_EXPERT_SEMANTICS = dict(runs_module=True, inputs="first_tensor", outputs="first", input_option="input_layouts")


class ExpertTPSpec(_ExpertOptions):
    """Shard every expert of a fused 3-D expert module (transformers' `experts`) on its
    intermediate dim; the partial output is reduced to `output_layouts`."""

    style: Literal["expert_tp"]
    params: dict[str, Layout] | None = Field(
        None,
        description="Placement per own parameter, over the defaults: gate_up_proj packed_shard(1, 2) "
        "([E, 2I, H]; shard(2) for gpt-oss's interleaved [E, H, 2I]), down_proj shard(2) ([E, H, I]; "
        "shard(1) transposed), gate_up_proj_bias like its gate/up dim, down_proj_bias replicate.",
    )
    semantics = StyleSemantics(torch_class="tpplan.sharding.experts:ExpertTensorParallel", **_EXPERT_SEMANTICS)


class ExpertParallelSpec(_ExpertOptions):
    """Whole experts per rank: shard(0) of the expert dim of every fused expert parameter."""

    style: Literal["expert_parallel"]
    dispatch: Literal["all_reduce", "all_to_all"] = Field(
        "all_reduce",
        description="all_reduce: tokens replicated, each rank runs its experts on every token "
        "(weight 0 where not routed), one all-reduce sums the ranks' outputs. all_to_all: tokens "
        "sharded over the mesh (sequence parallelism; the experts get the rank's local [T, H] tokens): "
        "each token travels to the rank holding its expert and back, torchtitan-style "
        "(forward 3 all-to-alls: counts, tokens, results; backward 2); input_layouts and "
        "output_layouts are then shard(0), the token dim, and the output is the same local tokens.",
    )
    semantics = StyleSemantics(torch_class="tpplan.sharding.experts:ExpertParallel", **_EXPERT_SEMANTICS)

    @model_validator(mode="after")
    def _token_shard_layouts(self):
        if self.dispatch == "all_to_all":
            for name in ("input_layouts", "output_layouts"):
                layout = getattr(self, name)
                if layout is not None and str(layout) != "shard(0)":
                    raise ValueError(f"with dispatch all_to_all, {name} must be shard(0) (the token dim of the experts' [T, H] input), not {layout}")
        return self

    def declared_input(self):
        if self.dispatch == "all_to_all" and self.input_layouts is None:
            return _SHARD0, True
        return super().declared_input()

    def output_follows_input(self) -> bool:
        return self.dispatch == "all_to_all"

    def natural_output(self):
        if self.dispatch == "all_to_all":
            return self.output_layouts or _SHARD0
        return super().natural_output()


class LocalParamsSpec(_InputOptions):
    """A module inside a sharded region that computes on local tensors: its own parameters
    laid out by `params` (default replicate, the gradient summed over the mesh, as
    transformers' replicated_with_grad_allreduce); input layouts as prepare_module_input."""

    style: Literal["local_params"]
    params: dict[str, Layout] | None = Field(
        None, description="Placement per own parameter (default replicate, gradient summed over the mesh)."
    )
    use_local_output: bool = False
    # Its module's ops are followed by the lint (runs_module False), on local tensors.
    semantics = StyleSemantics(torch_class="tpplan.sharding.params:LocalParams", inputs="layouts")


class SumOutputGradSpec(StyleSpec):
    """A module left whole on every rank whose output (or its last `last` features) every
    rank's shard uses whole: in backward, the gradient of that part is summed over the mesh,
    as transformers' mla_kv_a_proj does for the rotary key slice of an MLA kv_a_proj_with_mqa
    (the rest goes through a colwise kv_b_proj, which sums its input's gradient itself)."""

    style: Literal["sum_output_grad"]
    last: Optional[int] = Field(
        None, ge=1, description="How many of the output's last features get their gradient summed; default all of them."
    )
    # Forward is the module's own (its parameters stay plain): the lint follows its ops.
    semantics = StyleSemantics(torch_class="tpplan.sharding.grad_sum:SumOutputGrad", sums_output_grad=True)
