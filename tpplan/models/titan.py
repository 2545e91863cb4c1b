"""torchtitan 0.2.2's own model classes at small sizes, for `--model tpplan.models.titan:qwen3`,
the plans in plans/titan/ and the tests that compare them with torchtitan's own
parallelize functions.

Needs `torchtitan==0.2.2` (not a dependency of tpplan: see
docs/development.md). Its model modules import the training stack but only one
CUDA-only piece: `torchtitan.models.moe.kernels` imports triton for expert
parallelism's token permutation. `titan()` puts a module without triton in its
place, whose functions raise, so the models import on CPU; nothing here calls them.
The MoE router's `torch.histc` on integer tensors is CUDA-only too: `llama4()`
gives torchtitan's moe module a `torch` whose histc counts integers in float.

Every factory builds from a small config (dim 64, 2 layers, 8 query heads and
4 KV heads, vocab 256) so that TP 2 and 4 divide every sharded dim, and never
names a device: the CLI calls them under `torch.device(...)`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

_KERNELS = "torchtitan.models.moe.kernels"

SMALL: dict[str, Any] = dict(dim=64, n_layers=2, n_heads=8, n_kv_heads=4, vocab_size=256, max_seq_len=64)


def _cuda_only(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("torchtitan's triton kernels (expert-parallel token permutation) need CUDA")


def titan(module: str) -> types.ModuleType:
    """Import `torchtitan.<module>` on a machine without triton."""
    import importlib

    if _KERNELS not in sys.modules and importlib.util.find_spec("triton") is None:
        shim = types.ModuleType(_KERNELS)
        shim.generate_permute_indices = shim.fill_indices_wrapper = _cuda_only
        shim.__all__ = ["generate_permute_indices", "fill_indices_wrapper"]
        sys.modules[_KERNELS] = shim
    return importlib.import_module(f"torchtitan.{module}")


def llama3():
    """torchtitan's Llama 3 Transformer (GQA, SwiGLU hidden 256)."""
    model = titan("models.llama3.model.model")
    args = titan("models.llama3.model.args").TransformerModelArgs(**SMALL, multiple_of=64)
    return model.Transformer(args)


def qwen3():
    """torchtitan's Qwen3 (GQA, q_norm / k_norm on each head), dense."""
    model = titan("models.qwen3.model.model")
    args = titan("models.qwen3.model.args").Qwen3ModelArgs(**SMALL, head_dim=16, hidden_dim=128)
    return model.Qwen3Model(args)


_DEEPSEEK_SMALL: dict[str, Any] = dict(
    dim=64, n_layers=2, n_heads=8, vocab_size=256, max_seq_len=64, inter_dim=128,
    moe_inter_dim=64, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
)


def deepseek_v3():
    """torchtitan's DeepSeek-V3 with MLA attention (q_lora_rank 0) and dense
    feed-forwards only (n_dense_layers = n_layers): its MoE is left out."""
    model = titan("models.deepseek_v3.model.model")
    args = titan("models.deepseek_v3.model.args").DeepSeekV3ModelArgs(**_DEEPSEEK_SMALL, n_dense_layers=2)
    return model.DeepSeekV3Model(args)


def deepseek_v3_moe():
    """torchtitan's DeepSeek-V3 as its debugmodel is laid out: a dense first layer, then
    MoE (here 4 experts, top-2, softmax scores applied after the experts, two shared
    experts in one FeedForward, the load-balancing expert_bias buffer), experts
    computed by the for-loop (CPU has no float32 grouped_mm)."""
    _cpu_router()
    model = titan("models.deepseek_v3.model.model")
    moe_args = titan("models.moe.moe").MoEArgs(
        num_experts=4, num_shared_experts=2, top_k=2, score_func="softmax", route_norm=False,
        score_before_experts=False, use_grouped_mm=False,
    )
    args = titan("models.deepseek_v3.model.args").DeepSeekV3ModelArgs(**_DEEPSEEK_SMALL, n_dense_layers=1, moe_args=moe_args)
    # set only by update_from_config (a JobConfig's expert_parallel_comm_backend), read by every MoE layer
    args.moe_impl = "standard"
    return _init_experts(model.DeepSeekV3Model(args))


class _TorchWithCpuHistc(types.ModuleType):
    """torch, but `histc` of an integer tensor counts in float as it does on CUDA
    (CPU's histc takes floating tensors only); the router's counts are exact either way."""

    def __init__(self, torch: types.ModuleType):
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def histc(self, input, *args, **kwargs):
        if not input.is_floating_point():
            return self._torch.histc(input.float(), *args, **kwargs).to(input.dtype)
        return self._torch.histc(input, *args, **kwargs)


def _cpu_router() -> None:
    import torch

    moe = titan("models.moe.moe")
    if not isinstance(moe.torch, _TorchWithCpuHistc):
        moe.torch = _TorchWithCpuHistc(torch)


def llama4():
    """torchtitan's Llama 4 with MoE in every layer (4 experts, top-1, one shared expert),
    experts computed by the for-loop (CPU has no float32 grouped_mm)."""
    _cpu_router()
    model = titan("models.llama4.model.model")
    args_module = titan("models.llama4.model.args")
    moe_args = titan("models.moe.moe").MoEArgs(num_experts=4, num_shared_experts=1, top_k=1, use_grouped_mm=False, load_balance_coeff=None)
    args = args_module.TransformerModelArgs(**SMALL, multiple_of=64, moe_args=moe_args, interleave_moe_layer_step=1)
    return _init_experts(model.Transformer(args))


def _init_experts(built):
    """GroupedExperts' weights are torch.empty until torchtitan's init_weights, whose
    trunc_normal_ reads values (fake tensors cannot): its std, with normal_."""
    import torch

    with torch.no_grad():
        for layer in built.layers.values():
            if getattr(layer, "moe_enabled", True):
                for weight in layer.moe.experts.parameters():
                    weight.normal_(0.0, 0.02)
    return built
