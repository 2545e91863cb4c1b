"""What a training checkpoint holds beside the model: the optimizer state and `extra`.

They live in the same DCP save as the model (one `.metadata`, so they cannot be
of different steps), under the reserved key `_tpplan`:

- `_tpplan.optimizer...`: torch's `get_optimizer_state_dict(model, optimizer)`
  (sharded like the parameters: DTensor moments under TP and FSDP2), read back
  into the sharded model's own layout and set with `set_optimizer_state_dict`;
- `_tpplan.extra.rankR`: rank R's `extra` (the data position, RNG states...),
  serialized with `torch.save`; each rank gets its own back, and at another world
  size a rank that did not save one gets rank 0's. Reading it unpickles, as
  reading DCP's own `.metadata` does: load checkpoints you trust.

Model loads (`tpplan apply --checkpoint`, the dry run) ignore `_tpplan` keys.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

from ..errors import fail

if TYPE_CHECKING:
    import torch
    from torch import nn

RESERVED = "_tpplan"
OPTIMIZER = f"{RESERVED}.optimizer."
EXTRA = f"{RESERVED}.extra."


def this_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() and dist.get_backend() != "fake" else 0


def state_for_save(model: "nn.Module", optimizer: "torch.optim.Optimizer | None", extra: Any) -> dict:
    """{"_tpplan": {...}} to add to the model's state for DCP (empty without either)."""
    import torch

    held: dict[str, Any] = {}
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        held["optimizer"] = get_optimizer_state_dict(model, optimizer)
    if extra is not None:
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        held["extra"] = {f"rank{this_rank()}": buffer.getvalue()}
    return {RESERVED: held} if held else {}


def targets_for_load(model: "nn.Module", optimizer: "torch.optim.Optimizer | None", keys: set[str], where: str) -> dict:
    """What dcp.load fills besides the model: the optimizer's state (when asked for)
    and this rank's extra (when saved). `keys`: every key of the checkpoint's metadata."""
    held: dict[str, Any] = {}
    if optimizer is not None:
        if not any(k.startswith(OPTIMIZER) for k in keys):
            raise fail("TP601", f"the checkpoint {where} holds no optimizer state (saved without optimizer=): load it without optimizer=", where)
        for group in optimizer.param_groups:
            if any(p.device.type == "meta" for p in group["params"]):
                raise ValueError("load_checkpoint(optimizer=...): the optimizer holds meta-device parameters; "
                                 "load the model first (or build it with storage), then create the optimizer")
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        held["optimizer"] = get_optimizer_state_dict(model, optimizer)  # this rank's layout, moments allocated
    mine, first = f"{EXTRA}rank{this_rank()}", f"{EXTRA}rank0"
    for key in (mine, first):
        if key in keys:
            held["extra"] = {key[len(EXTRA):]: b""}
            break
    return {RESERVED: held} if held else {}


def restore(model: "nn.Module", optimizer: "torch.optim.Optimizer | None", targets: dict) -> Any:
    """Set the optimizer state read by dcp.load; return the extra (None when none was saved)."""
    import torch

    held = targets.get(RESERVED, {})
    if optimizer is not None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, held["optimizer"])
    if "extra" not in held:
        return None
    (blob,) = held["extra"].values()
    return torch.load(io.BytesIO(blob), weights_only=False)  # trusted as DCP's own pickled .metadata is
