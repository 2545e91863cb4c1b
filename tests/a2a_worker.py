"""Worker for tests/test_expert_all_to_all.py, run under torchrun (gloo, CPU): the
experts module of a tiny transformers MoE model under
AllToAllExpertParallel (dispatch: all_to_all), fed this rank's own tokens with routing skewed
so that per-rank split sizes are ragged and some expert gets no token, compared with
the whole module on every rank's tokens (outputs and every gradient). Rank 0 prints
one JSON line: max diffs, the split sizes of each rank, the collective counts."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from tpplan.models import hf as hf_models
from tpplan.sharding import expert_dispatch
from tpplan.sharding.expert_parallel import AllToAllExpertParallel
from worker_common import collectives, finish, grad_diffs


def main(family: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = getattr(hf_models, family)()
    experts = model.model.layers[0].mlp.experts
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.1)
    reference = copy.deepcopy(experts)
    n_experts, k, hidden_size = experts.gate_up_proj.shape[0], 2, model.config.hidden_size
    # Every rank makes every rank's tokens (same seed); rank r owns 3 + 2r of them.
    sizes = [3 + 2 * r for r in range(world)]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(sum(sizes), hidden_size, generator=g)
    index = torch.stack([torch.randperm(n_experts - 1, generator=g)[:k] for _ in range(sum(sizes))])  # the last expert gets none
    index[: sizes[0]] = torch.tensor([0, 1])  # rank 0's tokens all to experts 0 and 1
    weights = torch.softmax(torch.randn(sum(sizes), k, generator=g), -1)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])

    parallelize_module(experts, mesh, AllToAllExpertParallel())
    seen = []
    original = expert_dispatch.dispatch

    def recording(*args, **kwargs):
        rows, expert, routed = original(*args, **kwargs)
        seen.append((routed.input_splits, routed.output_splits))
        return rows, expert, routed

    sys.modules["tpplan.sharding.expert_parallel"].dispatch = recording  # the name AllToAllExpertParallel calls
    from torch.distributed.tensor.debug import CommDebugMode

    h, w = hidden[mine].clone().requires_grad_(), weights[mine].clone().requires_grad_()
    with CommDebugMode() as fwd:
        out = experts(h, index[mine], w)
    with CommDebugMode() as bwd:
        (out * torch.arange(out.numel()).view_as(out).float().cos()).sum().backward()

    rh, rw = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = reference(rh, index, rw)
    (ref[mine] * torch.arange(out.numel()).view_as(out).float().cos()).sum().backward()
    # The reference backward used this rank's loss only: sum the expert gradients over ranks.
    for p in reference.parameters():
        dist.all_reduce(p.grad)
    diffs = {"output": (out - ref[mine]).abs().max().item(),
             "hidden grad": (h.grad - rh.grad[mine]).abs().max().item(),
             "weights grad": (w.grad - rw.grad[mine]).abs().max().item()}
    diffs.update(grad_diffs(experts, reference))
    splits = [None] * world
    dist.all_gather_object(splits, seen[0])
    if rank == 0:
        print(json.dumps({"diffs": diffs, "splits": splits, "forward": collectives(fwd), "backward": collectives(bwd)}), flush=True)
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
