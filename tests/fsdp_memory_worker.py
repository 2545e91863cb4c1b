"""One real rank of a training step under a version 2 plan (its TP rules, activation
checkpointing and FSDP2 by `Plan.apply`), measured by `measure_training_step` as
bench/bench_memory_accuracy.py measures it: what the dry run predicts
(tests/test_memory_backend.py).

    torchrun --nproc-per-node N tests/fsdp_memory_worker.py PLAN MODEL BATCH SEQ

Rank 0 prints every rank's peak and where it was, as one JSON line.
"""

from __future__ import annotations

import json
import os
import sys


def vocab_heavy():
    """A Llama whose embedding and head outweigh its blocks and activations: the root's
    FSDP2 unit, reduced last in backward, holds most of the gradients."""
    from tpplan.models.llama import LlamaConfig, Transformer

    return Transformer(LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, ffn_hidden=128, max_seq_len=64))


def main(plan_path: str, model_ref: str, batch: int, seq: int) -> None:
    import torch
    import torch.distributed as dist

    from tpplan import load_plan
    from tpplan.memory.memory import measure_training_step
    from tpplan.simulation.modelref import build_model, load_callable
    from tpplan.simulation.simulate import default_inputs

    dist.init_process_group("gloo")
    plan = load_plan(plan_path)
    mesh = plan.build_mesh(dist.get_world_size())
    torch.manual_seed(0)
    model = build_model(model_ref, "cpu", load_callable(model_ref, "--model"))
    plan.apply(model, mesh)
    torch.manual_seed(1)
    step = measure_training_step(model, (default_inputs(model, batch, seq),), "adamw", plan.loss_parallel, fsdp=True)
    mine = {"rank": dist.get_rank(), "peak": step.peak_bytes, "peak_module": step.peak_module}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        print(json.dumps(everyone), flush=True)
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # torch 2.13 gloo may abort at interpreter exit after DTensor collectives


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
