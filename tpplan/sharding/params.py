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

from torch.distributed.tensor.parallel import ParallelStyle, PrepareModuleInput

from ..core.expert_styles import LocalParamsSpec
from ..core.problems import StyleInputError
from .experts import distribute_param
from .placed import own_placements, plan_placements

__all__ = ["LocalParams"]


class LocalParams(ParallelStyle):
    """Own parameters as DTensors laid out by `params` (default Replicate, gradients summed);
    outputs pass as they are.

    Keyword Args:
        params (dict[str, Placement], optional): placement per own parameter name.
        input_layouts, desired_input_layouts, input_kwarg_layouts,
        desired_input_kwarg_layouts, use_local_output: as torch's PrepareModuleInput,
            applied to the inputs first when any layout is given (gpt-oss's attention:
            its sinks sharded and its hidden_states one replicated DTensor for q/k/v).
    """

    def __init__(
        self,
        *,
        params: Mapping[str, Placement] | None = None,
        input_layouts: Any = None,
        desired_input_layouts: Any = None,
        input_kwarg_layouts: dict | None = None,
        desired_input_kwarg_layouts: dict | None = None,
        use_local_output: bool = False,
    ):
        super().__init__()
        self.params = dict(params or {})
        self.prepare = None
        if input_layouts is not None or input_kwarg_layouts is not None:
            self.prepare = PrepareModuleInput(
                input_layouts=input_layouts,
                desired_input_layouts=desired_input_layouts,
                input_kwarg_layouts=input_kwarg_layouts,
                desired_input_kwarg_layouts=desired_input_kwarg_layouts,
                use_local_output=use_local_output,
            )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        own = dict(module.named_parameters(recurse=False))
        unknown = sorted(set(self.params) - set(own))
        if unknown:
            raise StyleInputError(
                f"local_params: {type(module).__name__} has no parameter {', '.join(map(repr, unknown))} "
                f"(its own parameters: {', '.join(own) or 'none'})",
                "name the module's own parameters in params, or put the rule on the module that holds them",
            )
        if self.prepare is not None:
            self.prepare._apply(module, device_mesh)  # its input hook runs before ours
        placements = own_placements(LocalParamsSpec.model_construct(style="local_params", params=plan_placements(self.params)), module)
        for name, param in own.items():
            if isinstance(param, DTensor):
                continue
            value = distribute_param(param.data, device_mesh, placements[name], self.src_data_rank)
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
        return f"LocalParams(params={self.params!r}, prepare={self.prepare!r})"
