"""tpplan fit's FLOP count and cost model (tpplan/fit/flops.py, tpplan/fit/cost.py)
against figures computed by hand."""

from __future__ import annotations

import pytest

from tpplan.fit.flops import count_flops
from tpplan.models import llama

# tpplan.models.llama:tiny: dim 128, 16 heads of 8 (8 KV heads: wk/wv 64 wide), FFN 256,
# vocab 256, 2 layers; one sequence of 64 tokens. A matmul (m x k) @ (k x n) is 2mkn FLOPs.
S = 64
WQ = WO = 2 * S * 128 * 128  # 2_097_152
WK = WV = 2 * S * 128 * 64  # 1_048_576
SDPA = 2 * (2 * 16 * S * S * 8)  # QK^T and PV over 16 heads (torch's formula: the full square, causal or not): 2_097_152
ATTENTION = WQ + WK + WV + WO + SDPA  # 8_388_608
FFN = 3 * (2 * S * 128 * 256)  # w1, w3, w2: 12_582_912
LAYER = ATTENTION + FFN  # 20_971_520
HEAD = 2 * S * 128 * 256  # 4_194_304
FORWARD = 2 * LAYER + HEAD  # 46_137_344
# Backward: each projection's gradient of its input and of its weight (2x its forward; layer 0's
# too, since the embedding's output needs a gradient); attention's backward is torch's 5 batched
# matmuls (the scores recomputed, then dV, dP, dQ, dK): 2.5x its forward's 2.
LAYER_BACKWARD = 2 * (LAYER - SDPA) + 5 * SDPA // 2  # 42_991_616
BACKWARD = 2 * LAYER_BACKWARD + 2 * HEAD  # 94_371_840


@pytest.fixture(scope="module")
def tiny_flops():
    return count_flops(llama.tiny, S, "bf16")


def test_the_forward_is_the_matmuls_and_attention_counted_by_hand(tiny_flops):
    assert FORWARD == 46_137_344
    assert tiny_flops.forward[""] == FORWARD
    assert tiny_flops.forward["layers.1"] == LAYER
    assert tiny_flops.forward["layers.0.attention"] == ATTENTION
    assert tiny_flops.forward["layers.0.attention.wk"] == WK
    assert tiny_flops.forward["layers.0.feed_forward"] == FFN
    assert tiny_flops.forward["output"] == HEAD
    assert tiny_flops.forward["layers"] == 2 * LAYER  # a ModuleList never runs: its children's sum
    assert tiny_flops.forward["tok_embeddings"] == tiny_flops.forward["norm"] == 0


def test_the_backward_is_twice_the_matmuls_and_torchs_attention_backward(tiny_flops):
    assert BACKWARD == 94_371_840
    assert tiny_flops.backward[""] == BACKWARD
    assert tiny_flops.backward["layers.0"] == LAYER_BACKWARD
    assert tiny_flops.backward["output"] == 2 * HEAD
    # siblings that read one input are each charged their own backward only (torch's tracker alone
    # charged wk with wq's and wv's: 6x its forward)
    for name, forward in (("wq", WQ), ("wk", WK), ("wv", WV), ("wo", WO)):
        assert tiny_flops.backward[f"layers.0.attention.{name}"] == 2 * forward
    assert tiny_flops.backward["layers.0.feed_forward.w3"] == 2 * FFN // 3
    # The earlier session's 125_829_120 for this model's step is 3 x the projections' forward
    # (41_943_040) at 64 tokens: the CPU's attention op was not counted then.
    assert 3 * (FORWARD - 2 * SDPA) == 125_829_120
    assert tiny_flops.total == (FORWARD, BACKWARD)  # the loss adds no matmul


def test_units_are_summed_once(tiny_flops):
    assert tiny_flops.of(["layers.0", "output"]) == (LAYER + HEAD, LAYER_BACKWARD + 2 * HEAD)
    assert tiny_flops.of(["layers", "layers.0", "layers.0.attention.wq"]) == (2 * LAYER, 2 * LAYER_BACKWARD)
    assert tiny_flops.of(["", "output"]) == tiny_flops.total
    assert tiny_flops.of(["tok_embeddings", "norm"]) == (0, 0)
    with pytest.raises(KeyError):
        tiny_flops.of(["layers.7"])


def six_layers():
    return llama.Transformer(llama.LlamaConfig(n_layers=6))


def test_identical_blocks_counted_once_give_the_whole_count():
    reused, whole = count_flops(six_layers, 32, "fp32"), count_flops(six_layers, 32, "fp32", reuse=False)
    assert reused == whole
    assert reused.forward["layers.3.attention"] == reused.forward["layers.0.attention"] > 0
