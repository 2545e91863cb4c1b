"""Pydantic models of plan version 2's sections (SPEC §7): the named mesh and the
sections of the axes beyond TP. The TP rules and the settings both versions share
are schema.py's; what the sizes must satisfy together (products, divisibility) is
axes.py's located checks, which pydantic cannot locate at the key that is wrong.

No `from __future__ import annotations` (see schema.py).
"""

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field, WithJsonSchema, model_validator

from .style_model import _Strict

# The named axes, outermost first (torchtitan's order). `ep` borrows its ranks from
# dp_shard·cp·tp and is no factor of the world; the others multiply to it.
AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
WORLD_AXES = AXES[:-1]
DP_AXES = ("dp_replicate", "dp_shard")  # the data-parallel axes, outermost first (HSDP's two)
REST = -1  # "the rest of the world": world / (product of the other axes)

TORCH_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # the spellings of apply's --dtype: torch's names
DTYPES = tuple(TORCH_DTYPES)
OPTIMIZERS = ("adamw", "sgd", "none")  # the spellings of apply's --optimizer
EXPERT_STYLES = ("expert_parallel", "expert_tp")  # the styles an `experts:` rule may name

_SIZE_SCHEMA = {"type": "integer", "minimum": REST, "not": {"const": 0}}
_GLOBS_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1}]}


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _axis_size(value: Any) -> Any:
    if not _whole(value) or value == 0 or value < REST:
        raise ValueError(f"an axis size is a whole number >= 1, or -1 for the rest of the world, not {value!r}")
    return value


def _ep_size(value: Any) -> Any:
    if not _whole(value) or value < 1:
        raise ValueError(f"ep is a whole number >= 1 (its ranks are borrowed from dp_shard·cp·tp, so it cannot be -1), not {value!r}")
    return value


def _tp_size(value: Any) -> Any:
    if isinstance(value, list):
        if not value or not all(_whole(v) and v >= 1 for v in value):
            raise ValueError(f"a list of TP degrees holds whole numbers >= 1 (the degrees the plan promises), not {value!r}")
        return value
    return _axis_size(value)


def _globs(value: Any) -> Any:
    if value == []:
        raise ValueError("name at least one module-path glob (a glob, or a list of them)")
    return [value] if isinstance(value, str) else value


def _reshard(value: Any) -> Any:
    if isinstance(value, bool) or (_whole(value) and value >= 2):
        return value
    raise ValueError(f"reshard_after_forward is true, false or a whole number >= 2 (the group to reshard to), not {value!r}")


AxisSize = Annotated[int, BeforeValidator(_axis_size), WithJsonSchema(_SIZE_SCHEMA)]
Globs = Annotated[list[str], BeforeValidator(_globs), WithJsonSchema(_GLOBS_SCHEMA)]
DType = Literal[DTYPES]


class NamedMeshSpec(_Strict):
    pp: AxisSize = Field(1, description="Pipeline stages (applied by a later tpplan: SPEC §8).")
    dp_replicate: AxisSize = Field(1, description="HSDP replicas (1: plain FSDP).")
    dp_shard: AxisSize = Field(1, description="FSDP shards.")
    cp: AxisSize = Field(1, description="Context (sequence) parallel degree.")
    tp: Annotated[int | list[int] | None, BeforeValidator(_tp_size), WithJsonSchema(
        {"anyOf": [_SIZE_SCHEMA, {"type": "array", "items": {"type": "integer", "minimum": 1}, "minItems": 1}]}
    )] = Field(
        None,
        description="Tensor parallel degree; a list = the degrees the plan promises (as version 1's mesh.sizes); "
        "unset: the rest of the world when no other axis is -1, else 1.",
    )
    ep: Annotated[int, BeforeValidator(_ep_size), WithJsonSchema({"type": "integer", "minimum": 1})] = Field(
        1, description="Expert parallel degree: ranks borrowed from dp_shard·cp·tp (efsdp = dp_shard·cp·tp / ep)."
    )


class ContextParallelSpec(_Strict):
    modules: Globs = Field(description="Module-path globs of the attention modules context parallelism runs in.")
    rotate: Literal["allgather", "alltoall"] = Field("allgather", description="How the KV shards travel between the cp ranks.")
    load_balance: Literal["headtail", "none"] = Field(
        "headtail", description="headtail: each rank holds a head and a tail chunk of the sequence (2·cp chunks)."
    )
    buffers: dict[str, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict, description="Model buffers sharded on the sequence: name -> its sequence dim."
    )


class MixedPrecisionSpec(_Strict):
    param_dtype: DType | None = Field(None, description="The dtype parameters are gathered and computed in.")
    reduce_dtype: DType | None = Field(None, description="The dtype gradients are reduced in.")
    output_dtype: DType | None = Field(None, description="The dtype of the units' outputs.")


class FSDPSpec(_Strict):
    units: Globs | None = Field(None, description='fully_shard units, innermost first; "" is the root (always last). Default: each block of the largest ModuleList, then the root.')
    reshard_after_forward: Annotated[bool | int, BeforeValidator(_reshard), WithJsonSchema(
        {"anyOf": [{"type": "boolean"}, {"type": "integer", "minimum": 2}]}
    )] = Field(True, description="true, false, or an int: the group size (dividing dp_shard) to reshard to after forward.")
    mixed_precision: MixedPrecisionSpec | None = Field(None, description="FSDP2's MixedPrecisionPolicy.")
    offload: bool = Field(False, description="Offload parameters and gradients to the CPU.")


class CheckpointingSpec(_Strict):
    modules: Globs = Field(description="Module-path globs of the modules whose activations are recomputed.")
    mode: Literal["full", "selective"] = Field("full", description="full, or selective (torch's op-level SAC policy).")


class TrainingSpec(_Strict):
    global_batch: Annotated[int, Field(ge=1)] | None = Field(None, description="Sequences per step, over all data-parallel ranks.")
    seq: Annotated[int, Field(ge=1)] | None = Field(None, description="The whole sequence length (context parallelism splits it).")
    dtype: DType | None = Field(None, description="The training dtype.")
    optimizer: Literal[OPTIMIZERS] | None = Field(None, description="The optimizer whose state is planned for.")


# torch.distributed.pipelining's schedules, by the names its `get_schedule_class` takes
# (torch 2.13; its two base classes left out: they are no schedule a plan can ask for).
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
# The schedules that run several stages per rank (torch's PipelineScheduleMulti), and those
# that run exactly two, in a V (stage r and 2·pp − 1 − r on rank r).
MULTI_STAGE_SCHEDULES = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")

_STAGE_SCHEMA = {"type": "array", "items": {"type": "string"}, "minItems": 1}


def _stages(value: Any) -> Any:
    if isinstance(value, list) and any(isinstance(stage, list) and not stage for stage in value):
        raise ValueError("a stage names at least one module path (an empty stage runs nothing)")
    return value


class PipelineSpec(_Strict):
    """SPEC §8: how the model is cut into stages and how the schedule runs them. Exactly
    one way to cut the stages, at most one way to size the microbatches (JSON Schema
    says so too: `json_schema_extra`)."""

    model_config = {**_Strict.model_config, "json_schema_extra": {
        "oneOf": [{"required": ["stages"], "properties": {"stages": {"type": "array"}}},
                  {"required": ["layers_per_stage"], "properties": {"layers_per_stage": {"type": "integer"}}}],
        "not": {"required": ["microbatches", "microbatch_size"],
                "properties": {"microbatches": {"type": "integer"}, "microbatch_size": {"type": "integer"}}},
    }}

    stages: Annotated[list[Annotated[list[str], WithJsonSchema(_STAGE_SCHEMA)]], BeforeValidator(_stages)] | None = Field(
        None, description="Module paths per stage, in the model's order; {a..b} in a segment is an integer range.")
    layers_per_stage: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Blocks of the largest module list per stage; the first and last stages take what comes before and after.")
    schedule: Literal[SCHEDULES] = Field("1F1B", description="torch.distributed.pipelining's schedule, by its name.")
    microbatches: Annotated[int, Field(ge=1)] | None = Field(None, description="Microbatches per step (each rank's batch split).")
    microbatch_size: Annotated[int, Field(ge=1)] | None = Field(None, description="Sequences per microbatch, instead of their count.")
    virtual_stages: Annotated[int, Field(ge=1)] = Field(1, description="Stages per rank (interleaved and V schedules).")

    @model_validator(mode="before")
    @classmethod
    def _choices(cls, value: Any) -> Any:
        if isinstance(value, dict):
            given = [key for key in ("stages", "layers_per_stage") if value.get(key) is not None]
            if len(given) != 1:
                raise ValueError("give the stages either as module lists (stages) or as a count (layers_per_stage)"
                                 + (", not both" if given else ": neither is given"))
            if value.get("microbatches") is not None and value.get("microbatch_size") is not None:
                raise ValueError("give either microbatches or microbatch_size, not both")
        return value


# The sections of version 2 beyond the TP rules, in the order a plan is applied (SPEC §7, §8).
SECTIONS = ("pipeline", "experts", "context_parallel", "fsdp", "checkpointing", "training")
