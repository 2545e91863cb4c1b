"""`SumOutputGrad` (a plan's `{style: sum_output_grad, last: N}`): a module left whole on
every rank (plain parameters, its own forward) whose output, or its last `last`
features, every rank's shard uses whole, so that each rank's gradient of it is
only that rank's share: in backward it is summed over the mesh (one all-reduce).

The case it is for: an MLA attention's kv_a_proj_with_mqa (DeepSeek V2 style,
transformers' `mla_kv_a_proj`), whose output is [kv latent; rotary key]. The latent
goes through the colwise kv_b_proj, whose input gradient torch already sums; the
rotary key is shared by the rank's local heads only, so its gradient is partial.
The output stays a plain tensor: the forward is unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from ..core.problems import StyleInputError

__all__ = ["SumOutputGrad"]


class SumOutputGrad(ParallelStyle):
    """Sum the gradient of the module's output (its last `last` features) over the mesh.

    Keyword Args:
        last (int, optional): how many of the output's last features; default all.
    """

    def __init__(self, *, last: int | None = None):
        super().__init__()
        self.last = last

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, args, output: self._summed(mod, output, device_mesh))
        return module

    def _summed(self, module: nn.Module, output, mesh: DeviceMesh) -> torch.Tensor:
        if not isinstance(output, torch.Tensor) or output.dim() == 0:
            raise StyleInputError(
                f"sum_output_grad: {type(module).__name__} returns {type(output).__name__}, not a tensor with features",
                "put the rule on a module whose output is one tensor (a Linear)",
            )
        width = output.shape[-1]
        last = width if self.last is None else self.last
        if last > width:
            raise StyleInputError(
                f"sum_output_grad: last: {last} is more than the {width} features of {type(module).__name__}'s output",
                f"give last: N with N at most {width}, or leave it out for all",
            )
        kept, shared = output.split([width - last, last], dim=-1)
        # identity forward; backward: the local gradient read as a partial sum, all-reduced
        shared = DTensor.from_local(shared, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
        return torch.cat([kept, shared], dim=-1) if width > last else shared

    def __repr__(self) -> str:
        return f"SumOutputGrad(last={self.last!r})"
