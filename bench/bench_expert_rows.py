"""Expert work of expert_parallel's all_reduce dispatch: the expert matmul rows each
rank computes (its experts' matmul FLOPs / one row's), against one device.

    python bench/bench_expert_rows.py [--experts 8] [--top-k 2] [--tokens 256] [--tp 2 4] [--check]

A transformers Qwen3-MoE experts module (hidden 64, intermediate 32, random weights and
routing) sharded with `expert_parallel` (dispatch all_reduce) runs once per simulated
rank (torch's fake process group, that rank's real values); torch's FlopCounterMode
counts the matmul FLOPs of its forward, one device's over its T*k routed rows gives one
row's. Prints per degree the expert rows per rank and the sum over the ranks / one
device's. Goal: 1.0 (each routed pair once; every local expert on every token, before,
is E/k). Runs against an older tree too (`ExpertParallel(dispatch="all_reduce")`), for
the before number.
"""

from __future__ import annotations

import sys

from _common import arguments


def _style():
    try:
        from tpplan.sharding.expert_parallel import AllReduceExpertParallel

        return AllReduceExpertParallel()
    except ImportError:  # before the dispatches were classes
        from tpplan.sharding.experts import ExpertParallel

        return ExpertParallel(dispatch="all_reduce")


def _experts(n_experts: int, top_k: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=n_experts, num_experts_per_tok=top_k)
    return Qwen3MoeExperts(config)


def _flops(module, inputs) -> int:
    """The matmul FLOPs of one forward of the experts."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as flops:
        module(*inputs)
    return flops.get_total_flops()


def measure(n_experts: int, top_k: int, tokens: int, tp: int) -> tuple[list[int], int]:
    """Expert matmul rows per rank at `tp`, and one device's (T*k)."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.manual_seed(0)
    base = _experts(n_experts, top_k)
    with torch.no_grad():
        for p in base.parameters():
            p.normal_(0.0, 0.1)
    hidden = torch.randn(tokens, 64)
    weights, index = torch.topk(torch.randn(tokens, n_experts).softmax(-1), top_k, dim=-1)
    one_rows = tokens * top_k
    per_row = _flops(copy.deepcopy(base), (hidden, index, weights)) / one_rows
    rows = []
    for rank in range(tp):
        dist.init_process_group("fake", rank=rank, world_size=tp, store=FakeStore())
        try:
            module = copy.deepcopy(base)
            parallelize_module(module, init_device_mesh("cpu", (tp,)), _style())
            rows.append(round(_flops(module, (hidden, index, weights)) / per_row))
        finally:
            dist.destroy_process_group()
    return rows, one_rows


def main() -> int:
    parser = arguments(__doc__, check="when the ranks' rows add up to more than one device's")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    missed = False
    print(f"{args.experts} experts, top {args.top_k}, {args.tokens} tokens: one device computes "
          f"{args.tokens * args.top_k} rows; every local expert on every token would be E/k = {args.experts / args.top_k:g}x that")
    for tp in args.tp:
        rows, one_rows = measure(args.experts, args.top_k, args.tokens, tp)
        print(f"tp {tp}: expert rows per rank {rows}, sum {sum(rows)} / one device {one_rows} = {sum(rows) / one_rows:.2f}")
        missed |= sum(rows) > one_rows
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
