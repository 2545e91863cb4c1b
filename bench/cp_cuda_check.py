"""Context parallelism on CUDA GPUs: torch's ring attention, as a plan's context_parallel section applies it, against one device.

Run under torchrun on N CUDA GPUs (nccl; cp = N, e.g. 2 or 4):

    torchrun --nproc-per-node 2 bench/cp_cuda_check.py [--dtype float32|bfloat16] [--check]

For each rotate method (allgather, alltoall) and load balance (headtail, none), rank 0
prints one JSON line: the max |difference| of (1) the ring attention's output and q/k/v
gradients against one full causal SDPA (`check/context_parallel.ring_parity`, batch 2,
8 heads, seq 1024, head_dim 64) and (2) a transformer's loss and every parameter gradient
with `Plan.apply` (the attention blocks' SDPA sequence-sharded, the positions buffer cut
as the batch is, FSDP2 over the cp ranks) against its unsharded copy
(`check/context_parallel.model_parity`, `tpplan.models.positional`, seq 32), and the
ring's collectives on rank 0. The CPU tests (tests/test_context_parallel.py) run the same
two checks with cp ranks as threads and the CPU kernel in torch's ring; here the CUDA
kernels (flash for bfloat16, efficient for float32) run in it as in training.

`--cpu-simulated` runs the same on gloo CPU ranks with the CPU kernel in torch's ring
(`simulation.device_rules.context_parallel_rules`, what the dry run and the tests use):
it checks this script where there is no GPU; its figures are not CUDA's.

Goal: every difference within the dtype's tolerance (float32 1e-4, bfloat16 3e-2) of the
largest one-device value (at least 1: absolute below it); `--check` exits 1 when one is not.
Not run in this task's sessions (no GPU was lent); it needs torch 2.13 with CUDA.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import _common

sys.path.insert(0, str(_common.ROOT))

TOLERANCE = {"float32": 1e-4, "bfloat16": 3e-2}
PLAN = """\
version: 2
name: cp-cuda-check
mesh: {{cp: {cp}, tp: 1}}
rules: {{}}
context_parallel:
  modules: {modules}
  rotate: {rotate}
  load_balance: {load_balance}
  buffers: {buffers}
"""


def main() -> int:
    parser = _common.arguments(__doc__, check="when a difference is above the tolerance")
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="float32")
    parser.add_argument("--cpu-simulated", action="store_true", help="gloo CPU ranks, CUDA's ring simulated (checks the script)")
    args = parser.parse_args()

    import torch
    import torch.distributed as dist

    from tpplan import load_plan
    from tpplan.check.context_parallel import model_parity, ring_parity
    from tpplan.models import positional

    if args.cpu_simulated:
        from tpplan.simulation.device_rules import context_parallel_rules

        device, simulated = torch.device("cpu"), context_parallel_rules
        dist.init_process_group("gloo")
    else:
        if not torch.cuda.is_available():
            print("cp_cuda_check: torch sees no CUDA device; context parallelism needs CUDA in torch 2.13", file=sys.stderr)
            return 2
        device, simulated = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))), contextlib.nullcontext
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    cp, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, args.dtype)
    worst = 0.0
    try:
        for rotate in ("allgather", "alltoall"):
            for load_balance in ("headtail", "none"):
                ring_plan = load_plan(text=PLAN.format(cp=cp, modules="attention", rotate=rotate, load_balance=load_balance, buffers="{}"))
                model_plan = load_plan(text=PLAN.format(cp=cp, modules="layers.*.attention", rotate=rotate,
                                                        load_balance=load_balance, buffers="{positions: 0}"))
                torch.manual_seed(0)  # the same whole tensors and weights on every rank
                q, k, v, grad = (torch.randn(2, 8, 1024, 64, device=device, dtype=dtype) for _ in range(4))
                with simulated():
                    ring, ring_scale, collectives = ring_parity(ring_plan, ring_plan.build_mesh(cp, device.type), q, k, v, grad)
                with device:
                    reference = positional.tiny().to(dtype)
                tokens, labels = (torch.randint(0, 64, (2, 32), device=device) for _ in range(2))
                with simulated():
                    model, model_scale = model_parity(model_plan, model_plan.build_mesh(cp, device.type), reference, tokens, labels)
                relative = [ring[n] / max(1.0, ring_scale[n]) for n in ring] + [model[n] / max(1.0, model_scale[n]) for n in model]
                worst = max(worst, *relative)
                if rank == 0:
                    print(json.dumps({"cp": cp, "rotate": rotate, "load_balance": load_balance, "dtype": args.dtype,
                                      "ring_max_abs_diff": ring, "model_max_abs_diff": max(model.values()), "model_loss_diff": model["loss"],
                                      "ring_collectives_rank0": {f"{name} {nbytes} B": n for (name, nbytes), n in collectives.items()}}),
                          flush=True)
    finally:
        dist.destroy_process_group()
        sys.stdout.flush()
    met = worst <= TOLERANCE[args.dtype]
    if rank == 0:
        print(f"worst difference {worst:.3g} (tolerance {TOLERANCE[args.dtype]:g}): {'met' if met else 'MISSED'}")
    return _common.exit_code(args.check, met)


if __name__ == "__main__":
    raise SystemExit(main())
