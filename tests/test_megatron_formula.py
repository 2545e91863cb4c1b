"""Megatron-LM's theoretical memory formula (tpplan/memory/megatron.py), against the
same formula worked by hand on a small shape."""

from __future__ import annotations

import pytest

from tpplan.memory.megatron import TransformerShape, megatron_memory
from tpplan.models.llama import LlamaConfig, Transformer

SMALL = TransformerShape(layers=2, hidden=8, heads=2, kv_heads=1, head_dim=4, ffn=16, vocab=32)


def test_weights_and_optimizer_of_the_first_stage_by_hand():
    # attention 2·8·8·(1 + 1/2)·(4·2/8) = 192, SwiGLU 2·8·16·3/2 = 384, norms 2·8, embedding 8·32 = 256
    # first stage: ((192 + 384)·2 / pp 2 + 256) / tp 2 + (16·2 + 8) / pp 2 = 436 parameters
    # distributed optimizer over dp 4: 6 + 12/4 = 9 bytes each
    found = megatron_memory(SMALL, tp=2, pp=2, dp=4, seq=4, micro_batch=1, microbatches=4)
    assert found.weights_and_optimizer == 436 * 9
    assert megatron_memory(SMALL, tp=2, pp=2, dp=4, seq=4, micro_batch=1, microbatches=4,
                           distributed_optimizer=False).weights_and_optimizer == 436 * 18


def test_activations_without_and_with_sequence_parallelism_by_hand():
    # without SP: 4 tokens·8·(10 + 24/2)·2 layers = 1408, + 8·4·pp 2 + 4·8·pp 2 = 1536, × min(1, 4/2), × 1.05
    found = megatron_memory(SMALL, tp=2, pp=2, dp=4, seq=4, micro_batch=1, microbatches=4)
    assert found.activations == pytest.approx(1536 * 1.05)
    assert found.total == pytest.approx(436 * 9 + 1536 * 1.05)
    # with SP and selective recomputation: 4·8·(18 + 4·16/8)·2 = 1664, + 64 + 64, one microbatch of pp 2 in flight, / tp 2
    found = megatron_memory(SMALL, tp=2, pp=2, dp=4, seq=4, micro_batch=1, microbatches=1, sequence_parallel_selective=True)
    assert found.activations == pytest.approx((1664 + 64 + 64) * 0.5 / 2)


def test_the_shape_is_read_from_the_model():
    model = Transformer(LlamaConfig())
    assert TransformerShape.of(model) == TransformerShape(2, 128, 16, 8, 8, 256, 256)
