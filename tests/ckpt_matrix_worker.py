"""A torchrun job (2 gloo ranks, TP 2, plans/hf/llama_tp.yaml) that saves a tiny HF
Llama after each of three loads (a safetensors directory: zero-copy mapped
parameters; a DCP directory; none: random initial values) in each of two ways
(synchronous, asynchronous), with AdamW state of one step, and loads every save
back into a fresh model. Rank 0 prints one JSON line: per case, the keys whose
local shards differ on any rank (bitwise), how many were compared, how many of
the model's tensors viewed a file at the save, and the lock files left under ROOT.

    torchrun --nproc-per-node 2 tests/ckpt_matrix_worker.py ROOT
        (ROOT/hf: save_pretrained's directory; ROOT/dcp: a DCP save of the same weights)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tpplan import load_checkpoint, load_plan, save_checkpoint
from tpplan.models import hf as hf_models
from tpplan.checkpoint.mapped import backing_file
from worker_common import finish

PLAN = Path(__file__).resolve().parent.parent / "plans/hf/llama_tp.yaml"


def build(mesh, load: str, root: Path):
    """The TP-2 model after `load` ("hf", "dcp" or "none"), and its AdamW after one step."""
    if load == "none":
        torch.manual_seed(11)
        model = hf_models.llama()
    else:
        with torch.device("meta"):
            model = hf_models.llama()
    load_plan(PLAN).apply(model, mesh)
    if load != "none":
        load_checkpoint(model, root / load)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def flat(value, prefix: str = "") -> dict:
    """{dotted key: this rank's local tensor (a clone) or a plain value} of a nested state."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in flat(item, f"{prefix}{i}.").items()}
    if isinstance(value, DTensor):
        value = value.to_local()
    return {prefix[:-1]: value.detach().clone() if isinstance(value, torch.Tensor) else value}


def state(model, optimizer) -> dict:
    return {**flat(model.state_dict(), "model."), **flat(get_optimizer_state_dict(model, optimizer), "optimizer.")}


def differences(a: dict, b: dict) -> list[str]:
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not (
        torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype if isinstance(a[k], torch.Tensor) else a[k] == b[k])]


def main() -> None:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {}
    for load in ("hf", "dcp", "none"):
        model, optimizer = build(mesh, load, root)
        mapped = sum(backing_file(t) is not None for t in model.state_dict().values())
        expected = state(model, optimizer)
        for mode in ("sync", "async"):  # the asynchronous save last: it changes the model
            case = f"{load}-{mode}"
            out = root / "saves" / case
            saved = save_checkpoint(model, out, step=1, optimizer=optimizer, async_save=mode == "async")
            if mode == "async":
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1.0)  # training goes on during the write: the save keeps the values of the call
                saved = saved.wait()
            dist.barrier()  # rank 0 committed
            torch.manual_seed(99)
            fresh = hf_models.llama()
            load_plan(PLAN).apply(fresh, mesh)
            fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
            info = load_checkpoint(fresh, out, optimizer=fresh_optimizer)
            found = state(fresh, fresh_optimizer)
            mine = {"differ": differences(expected, found), "tensors": sum(isinstance(v, torch.Tensor) for v in expected.values()),
                    "mapped": mapped, "step": info.step, "saved": saved}
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
            results[case] = every
    dist.barrier()
    if dist.get_rank() == 0:
        locks = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith(".lock") or p.name == ".lock")
        print(json.dumps({"cases": results, "locks": locks}), flush=True)
    finish()


if __name__ == "__main__":
    main()
