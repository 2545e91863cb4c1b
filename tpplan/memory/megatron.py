"""Megatron-LM's published theoretical memory formula, for comparison beside the dry
run's simulated figures (SPEC §9): `megatron/training/theoretical_memory_usage.py`
(NVIDIA/Megatron-LM at d98e8a6), its dense-transformer part (grouped-query
attention, SwiGLU, RMSNorm, no MoE, no MTP), transcribed: Megatron ships it in its
training scripts, not in the megatron-core package.

What the formula assumes, and the dry run does not: bf16 weights with fp32 main
gradients, fp32 main weights and fp32 Adam moments (18 bytes per parameter, or
6 + 12/dp with the distributed optimizer), the first pipeline stage as the fullest
(its layers and the embedding), activations per layer of 34 bytes per token and
hidden unit for a 4h FFN with sequence parallelism and selective recomputation,
else (10 + 24/tp) (full activation checkpointing is not in the formula), and pp
microbatches in flight on the first stage (the interleaved schedule's penalty
1 + (p − 1)/(p·v)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TransformerShape:
    """What the formula reads of a model."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    tied: bool = False

    @classmethod
    def of(cls, model: Any) -> "TransformerShape":
        """From tpplan's Llama config or a transformers config (`model.config`)."""
        config = model.config
        if hasattr(config, "n_layers"):  # tpplan.models.llama
            return cls(config.n_layers, config.dim, config.n_heads, config.n_kv_heads, config.dim // config.n_heads,
                       config.ffn_hidden, config.vocab_size)
        heads = config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, heads, getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)))


@dataclass(frozen=True)
class MegatronEstimate:
    weights_and_optimizer: float  # bytes
    activations: float

    @property
    def total(self) -> float:
        return self.weights_and_optimizer + self.activations


def megatron_memory(shape: TransformerShape, *, tp: int, pp: int, dp: int, seq: int, micro_batch: int,
                    microbatches: int | None, virtual_stages: int | None = None, distributed_optimizer: bool = True,
                    sequence_parallel_selective: bool = False) -> MegatronEstimate:
    """`report_theoretical_memory`: `compute_weight_and_optimizer_memory` plus, with
    sequence parallelism and selective recomputation, `compute_activation_memory`, else
    `compute_activation_memory_without_sp` (module docstring)."""
    h, norm = shape.hidden, 1  # RMSNorm: one weight per norm
    query_ratio = shape.head_dim * shape.heads / h
    attention = 2 * h * h * (1 + shape.kv_heads / shape.heads) * query_ratio
    mlp = 2 * h * shape.ffn * 3 / 2  # SwiGLU
    layernorms = 2 * h * norm
    embedding = h * shape.vocab
    tp_sharded = (attention + mlp) * shape.layers
    replicated = layernorms * shape.layers + norm * h
    on_first = (tp_sharded / pp + embedding) / tp + replicated / pp
    if not shape.tied and pp == 1:
        on_first += embedding / tp
    per_parameter = 6 + 12 / dp if distributed_optimizer else 18
    weights = on_first * per_parameter

    tokens = seq * micro_batch
    if sequence_parallel_selective:  # Table 2 of arXiv:2205.05198, divided by tp at the end
        activations = tokens * h * (18 + 4 * shape.ffn / h) * shape.layers
    else:
        activations = tokens * h * (10 + 24 / tp) * shape.layers
    activations += 8 * tokens * pp  # the embedding's input, pp microbatches in flight
    activations += tokens * h * pp  # its dropout
    if virtual_stages is not None:
        activations *= 1 + (pp - 1) / (pp * virtual_stages)
    elif pp > 1 and microbatches is not None:
        activations *= min(1, microbatches / pp)
    if sequence_parallel_selective:
        if pp == 1:
            activations += tokens * h * 4 * (1 + shape.vocab / h)  # the head's input and the loss
        activations /= tp
    else:
        if pp == 1:
            activations += (tokens * shape.vocab / tp + tokens * h) * 2  # the logits and the final norm's output
        activations *= 1.05  # the formula's allowance for the optimizer and other temporaries
    return MegatronEstimate(weights, activations)
