"""Worker for tests/test_any_experts.py, run under torchrun (gloo, CPU): the torchtitan-shaped
GroupedExperts (tests/grouped_experts.py) under AllReduceExpertParallel, called as
torchtitan calls it (x sorted by expert, num_tokens_per_expert), every rank holding all
tokens, the ranks' experts getting unequal shares; compared with the whole module (output,
x's gradient, every weight gradient). Rank 0 prints one JSON line: max diffs, the rows each
rank's experts computed, the collectives."""

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grouped_experts import GroupedExperts  # noqa: E402
from tpplan.sharding.expert_parallel import AllReduceExpertParallel  # noqa: E402
from worker_common import collectives, finish, grad_diffs  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    experts = GroupedExperts()
    reference = copy.deepcopy(experts)
    counts = torch.tensor([3, 0, 5, 2])  # experts 0-1 get 3 rows, 2-3 get 7
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))
    parallelize_module(experts, mesh, AllReduceExpertParallel())
    rows = []
    experts.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))  # after the style's
    xs = x.clone().requires_grad_()
    cos = torch.arange(x.numel()).view_as(x).float().cos()
    with CommDebugMode() as fwd:
        out = experts(xs, counts)
    with CommDebugMode() as bwd:
        (out * cos).sum().backward()
    xr = x.clone().requires_grad_()
    (reference(xr, counts) * cos).sum().backward()
    diffs = {"output": (out - reference(x, counts)).abs().max().item(), "x grad": (xs.grad - xr.grad).abs().max().item()}
    diffs.update(grad_diffs(experts, reference))
    gathered = [None] * world
    dist.all_gather_object(gathered, rows[0])
    if rank == 0:
        print(json.dumps({"diffs": diffs, "rows": gathered, "forward": collectives(fwd), "backward": collectives(bwd)}), flush=True)
    finish()


if __name__ == "__main__":
    main()
