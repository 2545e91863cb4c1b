"""The three frameworks' parallelism configs as data: their field names, their
spellings of dtypes and policies, and which tpplan axis each size field is.
One table per framework, read by export (plan -> config) and import (config ->
plan) alike, so the two directions cannot disagree.

Read from each framework's own source, at the versions named:
- transformers 5.25: `transformers.distributed.DistributedConfig` (a dataclass;
  tests/test_interop.py builds it from the exported JSON).
- accelerate 1.16: `accelerate.parallelism_config.ParallelismConfig` and
  `accelerate.utils.TorchContextParallelConfig` (tests build them too).
- torchtitan 0.3.0: `torchtitan/config/configs.py`'s `ParallelismConfig` and
  `TrainingConfig`. torchtitan 0.3 does not import on torch 2.13, so these
  names are data copied from its wheel, not read from an installed package.
  0.3 builds its config in Python (a config registry) and takes these fields
  as `--parallelism.KEY VALUE` overrides; 0.2.x reads them from a job TOML's
  `[parallelism]` and `[training]` tables (`--job.config_file`). Export writes
  only fields both have, so its TOML is read by 0.2.2's ConfigManager (which
  refuses an unknown field; tests/test_interop.py runs it) and names 0.3's.
"""

from __future__ import annotations

TARGETS = ("torchtitan", "transformers", "accelerate")

# -- transformers 5.25: DistributedConfig ---------------------------------------------------------

# tpplan axis -> DistributedConfig's size field (cp: none, transformers has no context parallelism)
TRANSFORMERS_SIZES = {"tp": "tp_size", "dp_shard": "fsdp_size", "dp_replicate": "dp_replicate_size", "pp": "pp_size", "ep": "ep_size"}
# Every field of DistributedConfig (import refuses a key outside it, as from_dict would drop it silently).
TRANSFORMERS_FIELDS = (
    "tp_size", "tp_plan", "enable_sequence_parallel", "enable_expert_parallel", "fsdp_size", "dp_replicate_size",
    "fsdp_plan", "fsdp_cpu_offload", "fsdp_mixed_precision", "pp_size", "ep_size", "ep_plan", "ep_implementation",
)
# fsdp_plan's two styles (transformers.distributed.fsdp.ALL_FSDP_STYLES): a unit's reshard_after_forward
TRANSFORMERS_FSDP_STYLES = {True: "free_full_weight", False: "keep_full_weight"}
# fsdp_mixed_precision: true is this policy, and no other (transformers.distributed.fsdp)
TRANSFORMERS_MIXED_PRECISION = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
# ep_plan's value for a whole-experts module; how it moves tokens is ep_implementation
TRANSFORMERS_EP_DISPATCH = "ep_dispatch_experts"
# ep_implementation -> tpplan's expert_parallel dispatch ("auto" runs all_to_all in training)
TRANSFORMERS_EP_IMPLEMENTATIONS = {"all_to_all": "all_to_all", "all_reduce": "all_reduce", "auto": "all_to_all"}

# -- accelerate 1.16: ParallelismConfig ----------------------------------------------------------

# tpplan axis -> ParallelismConfig's size field (no pp, no ep: accelerate has neither)
ACCELERATE_SIZES = {"dp_replicate": "dp_replicate_size", "dp_shard": "dp_shard_size", "tp": "tp_size", "cp": "cp_size"}
ACCELERATE_FIELDS = (*ACCELERATE_SIZES.values(), "cp_backend", "cp_handler", "sp_size", "sp_backend", "tp_handler", "sp_handler")
# what ParallelismConfig.to_json() adds: its sizes again, keyed by axis (derived, so read only for agreement)
ACCELERATE_DERIVED = "_sizes"
# cp_handler is TorchContextParallelConfig(cp_comm_strategy=...): the same words as context_parallel.rotate
ACCELERATE_CP_STRATEGIES = ("allgather", "alltoall")
ACCELERATE_CP_BACKEND = "torch"

# -- torchtitan 0.3.0: [parallelism] and [training] ----------------------------------------------

TORCHTITAN_SIZES = {
    "dp_replicate": "data_parallel_replicate_degree",
    "dp_shard": "data_parallel_shard_degree",  # the one field that may be -1 (the rest of the world)
    "cp": "context_parallel_degree",
    "tp": "tensor_parallel_degree",
    "ep": "expert_parallel_degree",
    "pp": "pipeline_parallel_degree",
}
TORCHTITAN_REST_AXIS = "dp_shard"
# Every field of ParallelismConfig (configs.py), so import names the ones a plan does not hold
# instead of calling them unknown.
TORCHTITAN_PARALLELISM_FIELDS = (
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward", "enable_fsdp_symm_mem",
    "tensor_parallel_degree", "enable_sequence_parallel", "spmd_backend", "pipeline_parallel_degree",
    "module_fqns_per_model_part", "pipeline_parallel_first_stage_less_layers", "pipeline_parallel_last_stage_less_layers",
    "pipeline_parallel_layers_per_stage", "pipeline_parallel_schedule", "pipeline_parallel_schedule_csv",
    "pipeline_parallel_microbatch_size", "context_parallel_degree", "context_parallel_load_balancer",
    "context_parallel_ptrr_mask_key", "expert_parallel_degree",
)
# torchtitan 0.2.2's [parallelism] fields that 0.3 dropped: import reads a 0.2.x job TOML too
TORCHTITAN_022_PARALLELISM_FIELDS = (
    "disable_loss_parallel", "enable_async_tensor_parallel", "pipeline_parallel_expert_parallel_overlap",
    "context_parallel_rotate_method", "expert_tensor_parallel_degree", "expert_parallel_comm_backend",
)
# fsdp_reshard_after_forward: tpplan's bool -> torchtitan's policy ("default" is torchtitan's own
# heuristic, which no tpplan value is; import reads it as tpplan's default, true)
TORCHTITAN_RESHARD = {True: "always", False: "never"}
TORCHTITAN_LOAD_BALANCERS = {"headtail": "headtail"}  # "ptrr" (FlexAttention) has no tpplan equivalent
# [training]'s fields a plan holds: tpplan training key -> torchtitan field
TORCHTITAN_TRAINING = {"global_batch": "global_batch_size", "seq": "seq_len", "dtype": "dtype"}
TORCHTITAN_MIXED_PRECISION = {"param_dtype": "mixed_precision_param", "reduce_dtype": "mixed_precision_reduce"}
TORCHTITAN_OFFLOAD = "enable_cpu_offload"
# dtype spellings (TrainingConfig's Literals): each field takes only these
TORCHTITAN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
TORCHTITAN_DTYPE_CHOICES = {
    "dtype": ("bf16", "fp32"), "mixed_precision_param": ("bf16", "fp32"), "mixed_precision_reduce": ("fp32",),
}
