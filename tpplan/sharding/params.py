"""`LocalParams`: a module inside a sharded region that computes on local tensors
(activations already sharded by the styles around it), with its own parameters
laid out by name.

- a sharded parameter (`shard(0)` of gpt-oss's per-head attention `sinks`, whose
  heads follow the column-parallel q_proj) is its local shard in the forward;
- a replicated parameter (the default: Qwen3's per-head `q_norm`/`k_norm`, Apertus's
  xIELU `alpha_p`/`alpha_n` between a colwise and a rowwise projection) computes on
  this rank's slice of the activations, so its local gradient is this rank's share:
  it is marked partial and summed over the mesh (transformers'
  `replicated_with_grad_allreduce`). A plain tensor there would keep a partial
  gradient that differs per rank, silently.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from .experts import distribute_param
from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["LocalParams"]


class LocalParams(ParallelStyle):
    """Own parameters as DTensors laid out by `params` (default Replicate, gradients summed);
    inputs and outputs pass as they are (local tensors).

    Keyword Args:
        params (dict[str, Placement], optional): placement per own parameter name.
    """

    def __init__(self, *, params: Mapping[str, Placement] | None = None):
        super().__init__()
        self.params = dict(params or {})

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = dict(module.named_parameters(recurse=False))
        unknown = sorted(set(self.params) - set(own))
        if unknown:
            raise ValueError(
                f"local_params: {type(module).__name__} has no parameter {', '.join(map(repr, unknown))} "
                f"(its own parameters: {', '.join(own) or 'none'})"
            )
        for name, param in own.items():
            if isinstance(param, DTensor):
                continue
            placement = self.params.get(name, Replicate())
            value = distribute_param(param.data, device_mesh, placement, self.src_data_rank)
            module.register_parameter(name, nn.Parameter(value, requires_grad=param.requires_grad))
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)
        return module

    @staticmethod
    def _pre_forward(module: nn.Module, args: tuple) -> None:
        for name, param in module.named_parameters(recurse=False):
            if all(p.is_replicate() for p in param.placements):
                module.__dict__[name] = param.to_local(grad_placements=(Partial(),) * len(param.placements))
            else:
                module.__dict__[name] = param.to_local()

    @staticmethod
    def _post_forward(module: nn.Module, args: tuple, output: Any) -> Any:
        for name, _ in module.named_parameters(recurse=False):
            module.__dict__.pop(name, None)
        return output

    def __repr__(self) -> str:
        return f"LocalParams(params={self.params!r})"
