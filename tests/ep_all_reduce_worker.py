"""Worker for tests/test_experts.py, run under torchrun (gloo, CPU): the experts module
of a tiny transformers MoE model under AllReduceExpertParallel (dispatch: all_reduce),
every rank holding every token, with routing skewed so that the ranks' experts get
unequal shares and one expert gets no token; compared with the whole module (outputs
and every gradient). Rank 0 prints one JSON line: max diffs, the rows each rank's
experts computed, the routed pairs each rank holds the experts of, the collectives."""

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from tpplan.models import hf as hf_models
from tpplan.sharding.expert_parallel import AllReduceExpertParallel
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
    n_experts, k, tokens = experts.gate_up_proj.shape[0], 2, 12
    g = torch.Generator().manual_seed(1)  # the same tokens and routing on every rank
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g)
    index = torch.stack([torch.randperm(n_experts - 1, generator=g)[:k] for _ in range(tokens)])  # the last expert gets none
    index[:5] = torch.tensor([0, 1])  # skewed towards the first experts
    weights = torch.softmax(torch.randn(tokens, k, generator=g), -1)

    parallelize_module(experts, mesh, AllReduceExpertParallel())
    rows = []
    experts.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[0]))  # after the style's: its rows
    h, w = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    cos = torch.arange(hidden.numel()).view_as(hidden).float().cos()
    with CommDebugMode() as fwd:
        out = experts(h, index, w)
    with CommDebugMode() as bwd:
        (out * cos).sum().backward()
    rh, rw = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    ref = reference(rh, index, rw)
    (ref * cos).sum().backward()
    diffs = {"output": (out - ref).abs().max().item(), "hidden grad": (h.grad - rh.grad).abs().max().item(),
             "weights grad": (w.grad - rw.grad).abs().max().item()}
    diffs.update(grad_diffs(experts, reference))
    local = n_experts // world
    mine = ((index >= rank * local) & (index < (rank + 1) * local)).sum().item()
    gathered = [None] * world
    dist.all_gather_object(gathered, (rows[0], mine))
    if rank == 0:
        print(json.dumps({"diffs": diffs, "rows": [r for r, _ in gathered], "routed": [m for _, m in gathered],
                          "tokens": tokens, "top_k": k, "experts": n_experts,
                          "forward": collectives(fwd), "backward": collectives(bwd)}), flush=True)
    finish()


if __name__ == "__main__":
    main(sys.argv[1])
