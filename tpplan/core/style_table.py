"""The style table: every style a plan can name, one spec class each. No torch here.

Each spec class holds its options (pydantic fields, named and defaulted as
torch's constructor) and a `semantics` class attribute, a `StyleSemantics`
(style_model.py): its torch class and its layout contract (contract.py), per
mesh axis the placements of the parameters, each input's and output's source and
destination layouts (fixed, or an option's with torch's default) and what
backward does to each gradient. A rule's own contract is the table's filled from
its options (`StyleSpec.contract()`). A spec class also has methods for the facts
that depend on the options or the module (`param_placements`, `needs_parent`,
...), and a `cross_field` tuple, the rules between its options as data
(cross_field.py: the loader's TP105 checks and the JSON Schema's conditions are
both read from it). Everything else reads them and never branches on a style's
name (tests/test_contract.py and tests/test_style_table.py change an entry and see the
compiled style and the lint follow): `sharding.compile` (the torch class, and
the layouts a rule leaves out), `Plan.apply`, the lint's layout flow
(`lint/flow.py`), facts (`lint/facts.py`) and rules (parameter placements, which
modules a style applies to, which inputs it takes), import-hf
(`schema.rule_spec`), and the shard math of checkpoints and memory (through the
DTensors the styles make: `StyleSpec.own_placements`). For example, colwise:

    class ColwiseSpec(_LinearOptions):
        style: Literal["colwise"]
        semantics = StyleSemantics(
            torch_class="torch.distributed.tensor.parallel:ColwiseParallel",
            contract=tp(
                state={  # module kind -> {parameter name, or "*" for any other: placement}
                    "Linear": {"weight": _SHARD0, "bias": _SHARD0, "*": _SHARD0},
                    "Embedding": {"weight": _SHARD1, "*": _SHARD1},
                },
                # arrives as input_layouts says (torch's default replicate), computed on whole, gradient summed
                inputs=(Port(src=Option("input_layouts", _REPLICATE), dst=_REPLICATE, grad="sum"),),
                rest="dropped",  # torch hands on the first positional input only
                outputs=(Port(src=_LAST_DIM, dst=Option("output_layouts", _LAST_DIM)),),
                body="sharded",  # the module runs on DTensor parameters
            ),
        )

This module holds torch's six styles and no_parallel; expert_styles.py holds
expert_tp, expert_parallel and local_params (SPEC §2a). Adding a style is one
spec class (its options and its contract, plus its tests) added to `STYLE_SPECS` below, and, if it shards a
new kind of module, an entry in `style_model.MODULE_KINDS` (a class, or a
predicate for modules recognised by their parameters, as fused experts are).

No `from __future__ import annotations` here: pydantic would compile every
field's annotation string at start-up.
"""

from typing import Annotated, Any, Literal, Union

from pydantic import Field

from .contract import ANY, SUBTREE, Option, Port, tp
from .cross_field import Allowed, Excludes, Given
from .placements import PlacementSpec, parse_placement
from .style_model import (
    INPUT_PORTS,
    OUTPUT_PORTS,
    _LAST_DIM,
    _PARTIAL,
    _REPLICATE,
    _SHARD0,
    _SHARD1,
    _TORCH_TP,
    Layout,
    StyleSemantics,
    StyleSpec,
    _InputOptions,
    _LinearOptions,
    _OutputOptions,
)
from .expert_styles import ExpertParallelSpec, ExpertTPSpec, LocalParamsSpec, SumOutputGradSpec




class ColwiseSpec(_LinearOptions):
    """Shard a Linear's weight by output features (an Embedding's by embedding dim; a
    transformers Conv1D's, stored [in, out], and stacked expert Linears' [E, out, in] on their dim 1)."""

    style: Literal["colwise"]
    heads: Union[Annotated[int, Field(ge=1)], Literal["auto"], None] = Field(
        None,
        description="The output is whole heads (a GQA k_proj/v_proj): their count, or auto (out_features / the parent's "
        "head_dim). When the TP degree is a multiple of the count above it, rank r holds head r // (tp / heads), "
        "replicated, with summed gradients, and the attention's KV-group count becomes the local ratio.",
    )
    packed: Union[Annotated[int, Field(ge=2)], Annotated[list[Annotated[int, Field(ge=1)]], Field(min_length=2)], None] = Field(
        None,
        description="The output is several kinds packed side by side (a fused qkv_proj [q | k | v] split after the "
        "Linear, a fused gate_up_proj): their count N for N equal blocks (weight and bias packed_shard(0, N): each "
        "rank holds its slice of every block, so its local output is [q_r | k_r | v_r]), or the blocks' sizes in "
        "output features for unequal ones (a GQA [q | k | v]: weight and bias replicated, each rank computes its "
        "slice of every block, gradients summed).",
    )
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:ColwiseParallel",
        contract=tp(
            state={
                "Linear": {"weight": _SHARD0, "bias": _SHARD0, "*": _SHARD0},
                "Embedding": {"weight": _SHARD1, "*": _SHARD1},
                "Conv1D": {"weight": _SHARD1, "bias": _SHARD0, "*": _SHARD1},  # weight [in, out]
                "StackedLinears": {"weight": _SHARD1, "*": _SHARD1},  # weight [E, out, in]
            },
            # computes on its input whole: every rank's use adds to its gradient (siblings sharing it each pay: TP340)
            inputs=(Port(src=Option("input_layouts", _REPLICATE), dst=_REPLICATE, grad="sum"),),
            rest="dropped",
            outputs=(Port(src=_LAST_DIM, dst=Option("output_layouts", _LAST_DIM)),),  # output features split
            body="sharded",
        ),
        kind_classes={kind: "tpplan.sharding.kinds:KindColwiseParallel" for kind in ("Conv1D", "StackedLinears")},
    )
    cross_field = (
        # with heads, the output is handed on as the module leaves it: the contract's output source
        Allowed("output_layouts", (semantics.contract.tp.outputs[0].src,), Given("heads"),
                "colwise with 'heads' hands on local head slices: drop output_layouts (or use shard(-1))"),
        Excludes("packed", "heads",
                 "colwise takes 'packed' or 'heads', not both: a packed projection's blocks are split per rank already"),
        Excludes("packed", "output_layouts",
                 "colwise with 'packed' hands on each rank's slice of every block: drop output_layouts", at="output_layouts"),
    )

    def torch_class(self, kind: str | None = None) -> str:
        if self.packed is not None:  # each rank its slice of every packed block (tpplan/sharding/packed.py)
            return "tpplan.sharding.packed:PackedColwiseParallel"
        # whole heads, replicated above their count (tpplan/sharding/kv_heads.py)
        return "tpplan.sharding.kv_heads:HeadsColwiseParallel" if self.heads is not None else super().torch_class(kind)

    def packed_blocks(self, size: int):
        if self.packed is None:
            return None
        return tuple(self.packed) if isinstance(self.packed, list) else (size // self.packed,) * self.packed

    def torch_options(self) -> dict[str, Any]:
        options = super().torch_options()
        packed = options.pop("packed")
        if packed is not None:
            options.pop("heads")
            options.pop("output_layouts")
            options["packed"] = tuple(packed) if isinstance(packed, list) else packed
            return options
        heads = options.pop("heads")
        if heads is not None:
            options.pop("output_layouts")
            options["heads"] = None if heads == "auto" else heads
        return options

    def needs_parent(self) -> bool:
        return self.heads is not None  # the attention module's KV-group count becomes the local ratio


class RowwiseSpec(_LinearOptions):
    """Shard a Linear's weight by input features (an Embedding's by vocabulary; a
    transformers Conv1D's, stored [in, out], on its dim 0; stacked expert Linears' [E, out, in] on dim 2)."""

    style: Literal["rowwise"]
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:RowwiseParallel",
        contract=tp(
            state={
                "Linear": {"weight": _SHARD1, "bias": _REPLICATE, "*": _SHARD1},
                "Embedding": {"weight": _SHARD0, "*": _SHARD0},
                "Conv1D": {"weight": _SHARD0, "bias": _REPLICATE, "*": _SHARD0},  # weight [in, out]
                "StackedLinears": {"weight": PlacementSpec("shard", 2), "*": PlacementSpec("shard", 2)},  # weight [E, out, in]
            },
            # torch's default is shard(-1), even on an Embedding (which computes on its token ids whole)
            inputs=(Port(src=Option("input_layouts", _LAST_DIM), dst=_LAST_DIM),),
            rest="dropped",
            outputs=(Port(src=_PARTIAL, dst=Option("output_layouts", _REPLICATE)),),  # partial sums, reduced
            body="sharded",
        ),
        kind_classes={kind: "tpplan.sharding.kinds:KindRowwiseParallel" for kind in ("Conv1D", "StackedLinears")},
    )


_SEQUENCE = Option("sequence_dim", _SHARD1, as_dim=True)


class SequenceParallelSpec(StyleSpec):
    """Replicate the module's parameters and run it on a sequence-sharded input."""

    style: Literal["sequence_parallel"]
    sequence_dim: int = 1
    use_local_output: bool = False
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:SequenceParallel",
        contract=tp(
            state={ANY: {SUBTREE: _REPLICATE}},
            inputs=(Port(src=_SEQUENCE, dst=_SEQUENCE),),  # one sequence shard per rank
            rest="dropped",
            outputs=(Port(src=_SEQUENCE, dst=_SEQUENCE),),
            body="sharded",
        ),
        flat_params=True,
    )


class PrepareModuleInputSpec(_InputOptions):
    """Annotate and redistribute the module's inputs."""

    style: Literal["prepare_module_input"]
    use_local_output: bool = False
    semantics = StyleSemantics(torch_class=f"{_TORCH_TP}:PrepareModuleInput", contract=tp(inputs=INPUT_PORTS))


class PrepareModuleOutputSpec(_OutputOptions):
    """Annotate and redistribute the module's outputs."""

    style: Literal["prepare_module_output"]
    use_local_output: bool = True
    semantics = StyleSemantics(torch_class=f"{_TORCH_TP}:PrepareModuleOutput", contract=tp(outputs=OUTPUT_PORTS))


class PrepareModuleInputOutputSpec(_InputOptions, _OutputOptions):
    """Both of the above on one module."""

    style: Literal["prepare_module_input_output"]
    use_local_input: bool = False
    use_local_output: bool = True
    semantics = StyleSemantics(
        torch_class=f"{_TORCH_TP}:PrepareModuleInputOutput", contract=tp(inputs=INPUT_PORTS, outputs=OUTPUT_PORTS)
    )

    def inputs_local(self) -> bool:
        return self.use_local_input

    def local_option(self) -> str:
        return "use_local_input"  # the inputs' (its outputs are local by default)


def _layout_default(text: str) -> Any:
    # The JSON Schema shows the default as the plan would spell it (pydantic alone
    # would dump the PlacementSpec dataclass as an object).
    return Field(parse_placement(text), json_schema_extra={"default": text})


class NoParallelSpec(StyleSpec):
    """Replicate the module's parameters and buffers; redistribute its first input and output."""

    style: Literal["no_parallel"]
    input_layout: Layout = _layout_default("replicate")
    output_layout: Layout = _layout_default("replicate")
    desired_input_layout: Layout = _layout_default("replicate")
    use_local_output: bool = True
    semantics = StyleSemantics(
        torch_class="tpplan.sharding.styles:NoParallel",
        contract=tp(
            state={ANY: {SUBTREE: _REPLICATE}},
            inputs=(Port(src=Option("input_layout", _REPLICATE), dst=Option("desired_input_layout", _REPLICATE)),),
            rest="passed",
            outputs=(Port(src=_REPLICATE, dst=Option("output_layout", _REPLICATE)),),
            body="sharded",
        ),
    )


STYLE_SPECS: dict[str, type[StyleSpec]] = {
    cls.model_fields["style"].annotation.__args__[0]: cls
    for cls in (
        ColwiseSpec,
        RowwiseSpec,
        SequenceParallelSpec,
        PrepareModuleInputSpec,
        PrepareModuleOutputSpec,
        PrepareModuleInputOutputSpec,
        NoParallelSpec,
        ExpertTPSpec,
        ExpertParallelSpec,
        LocalParamsSpec,
        SumOutputGradSpec,
    )
}
STYLE_NAMES = tuple(STYLE_SPECS)
