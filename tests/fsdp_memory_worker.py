"""One real rank of a training step under a version 2 plan (its TP rules, activation
checkpointing and FSDP2 by `Plan.apply`), measured by `measure_training_step` as
bench/bench_memory_accuracy.py measures it: what the dry run predicts
(tests/test_memory_backend.py).

    torchrun --nproc-per-node N tests/fsdp_memory_worker.py PLAN MODEL BATCH SEQ

Rank 0 prints every rank's peak and where it was, as one JSON line.
"""

from __future__ import annotations

import sys

from real_rank import planned_rank, print_every_rank


def vocab_heavy():
    """A Llama whose embedding and head outweigh its blocks and activations: the root's
    FSDP2 unit, reduced last in backward, holds most of the gradients."""
    from tpplan.models.llama import LlamaConfig, Transformer

    return Transformer(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden=128, max_seq_len=64))


def main(plan_path: str, model_ref: str, batch: int, seq: int) -> None:
    import torch
    import torch.distributed as dist

    from tpplan.memory.memory import measure_training_step
    from tpplan.simulation.simulate import default_inputs

    plan, mesh, model = planned_rank(plan_path, model_ref)
    plan.apply(model, mesh)
    torch.manual_seed(1)
    step = measure_training_step(model, (default_inputs(model, batch, seq),), "adamw", plan.loss_parallel, fsdp=True)
    print_every_rank({"rank": dist.get_rank(), "peak": step.peak_bytes, "peak_module": step.peak_module})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
