"""A model whose sharded dims the TP degrees 3 and 4 do not divide, its plan, and a
torchrun job that loads a checkpoint into it at that degree (torch's uneven shards:
rank r holds chunk r of `torch.chunk`) and writes what each rank read: the bytes
of the tensors it holds and whether each equals its slice of the checkpoint.
With --save, the loaded model is saved again as DCP (each rank its uneven chunks).

    torchrun --nproc-per-node 3 tests/uneven_load_worker.py CKPT OUT [--save DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tpplan.models.mlp import MLP  # noqa: E402
from worker_common import finish  # noqa: E402

DIM, HIDDEN = 30, 130  # torch.chunk: 130 = 44 + 44 + 42 at TP 3, 33 + 33 + 33 + 31 at TP 4
PLAN = """\
version: 1
rules:
  blocks.*.in_proj: {style: colwise, use_local_output: false}
  blocks.*.out_proj: rowwise
"""


def odd() -> MLP:
    """2 blocks of 30 -> 130 -> 30."""
    return MLP(dim=DIM, hidden=HIDDEN, n_blocks=2)


def llama_odd_vocab():
    """tpplan.models.hf' LlamaForCausalLM with 130 tokens: its vocab-parallel embedding and lm_head shard unevenly."""
    from tpplan.models.hf import _build

    return _build("LlamaConfig", "LlamaForCausalLM", "sdpa", vocab_size=130)


def rank_reads(model: torch.nn.Module, full: dict[str, torch.Tensor], rank: int, local=None) -> tuple[int, list[str]]:
    """(bytes of the tensors rank `rank` of a 1-D mesh holds of `model`, the names whose
    values are not their slice of `full`). `local(dtensor)`: that rank's shard (default
    `to_local()`, this process's)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    local_of = local or (lambda t: t.to_local())
    held, wrong = 0, []
    for name, t in model.state_dict().items():
        if isinstance(t, DTensor):
            # the 1-D TP mesh: rank r is coordinate r
            shape, offset = _compute_local_shape_and_global_offset(tuple(t.shape), tuple(t.device_mesh.shape), [rank], t.placements)
            want = full[name][tuple(slice(o, o + s) for o, s in zip(offset, shape))]
            mine = local_of(t)
        else:
            want, mine = full[name], t
        held += mine.numel() * mine.element_size()
        if tuple(mine.shape) != tuple(want.shape) or not torch.equal(mine, want):
            wrong.append(name)
    return held, wrong


def main() -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan import load_checkpoint, load_plan, save_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint")
    parser.add_argument("out")
    parser.add_argument("--save")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = odd()
    load_plan(text=PLAN).apply(model, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)))
    result = load_checkpoint(model, args.checkpoint, device="cpu")
    with torch.device("cpu"):
        full = odd()
    load_checkpoint(full, args.checkpoint, device="cpu")  # the whole model, as one device reads it
    held, wrong = rank_reads(model, full.state_dict(), rank)
    Path(args.out, f"rank{rank}.json").write_text(json.dumps({"held": held, "read_bytes": result.read_bytes, "wrong": wrong}))
    if args.save:
        save_checkpoint(model, args.save)
    finish()  # gloo workers may abort at interpreter exit after DTensor collectives


if __name__ == "__main__":
    main()
