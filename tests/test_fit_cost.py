"""tpplan fit's FLOP count and cost model (tpplan/fitting/flops.py, tpplan/fitting/cost.py)
against figures computed by hand."""

from __future__ import annotations

import pytest

from tpplan.fitting import cost
from tpplan.fitting.flops import count_flops
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


# -- the cost model -------------------------------------------------------------------

def test_presets_and_overrides():
    h100 = cost.GPUS["h100"]
    assert (h100.peak_flops, h100.memory_bytes, h100.intra_bandwidth, h100.inter_bandwidth) == (989e12, 85_899_345_920, 450e9, 50e9)
    assert (h100.intra_latency, h100.inter_latency, h100.efficiency) == (5e-6, 10e-6, 0.4)
    assert cost.GPUS["mi300x"].intra_bandwidth == 7 * 64e9
    faster = cost.gpu_with("a100", efficiency=0.5, inter_bandwidth=50e9)
    assert (faster.peak_flops, faster.efficiency, faster.inter_bandwidth) == (312e12, 0.5, 50e9)
    with pytest.raises(ValueError, match="unknown GPU 'b200'"):
        cost.gpu_with("b200")
    with pytest.raises(ValueError, match="unknown GPU figure.*peak"):
        cost.gpu_with("h100", peak=1.0)
    said = cost.assumptions(h100, 8)
    assert said["gpus_per_node"] == 8 and said["peak_flops"] == 989e12 and said["name"] == "H100 SXM"


def test_which_axes_lie_inside_a_node():
    sizes = {"pp": 2, "dp_shard": 4, "tp": 8}  # 64 ranks, 8 per node
    assert cost.axis_in_node("tp", sizes, 8)  # ranks 0-7: stride 1 x 8
    assert not cost.axis_in_node("dp_shard", sizes, 8)  # stride 8 (tp): ranks 0, 8, 16, 24
    assert not cost.axis_in_node("pp", sizes, 8)  # stride 32
    assert cost.axis_in_node("dp_replicate", sizes, 8)  # size 1: a group of one
    assert cost.axis_in_node("dp_shard", {"dp_shard": 4, "tp": 2}, 8)  # stride 2 x 4 = 8 ranks
    assert cost.axis_in_node("ep", {"dp_shard": 8, "tp": 2, "ep": 8}, 8)
    assert not cost.axis_in_node("ep", {"dp_shard": 16, "ep": 16}, 8)
    # efsdp (the experts' FSDP): spaced by ep over the dp_shard·cp·tp consecutive ranks ep borrows from
    assert cost.axis_in_node("efsdp", {"dp_shard": 4, "tp": 2, "ep": 2}, 8)
    assert not cost.axis_in_node("efsdp", {"pp": 2, "dp_shard": 8, "tp": 2, "ep": 8}, 8)  # ranks 0, 8 of 16
    with pytest.raises(ValueError):
        cost.axis_in_node("dp", sizes, 8)


def test_ring_collectives_by_hand():
    # 3 calls moving 8 MB in all on 4 ranks at 100 GB/s, α 5 µs
    mb8, beta, alpha = 8_000_000, 100e9, 5e-6
    gather = 3 * 3 * alpha + 0.75 * mb8 / beta  # 45 µs + 60 µs
    assert cost.collective_seconds("all_gather", 3, mb8, 4, beta, alpha) == pytest.approx(105e-6)
    assert cost.collective_seconds("all_gather", 3, mb8, 4, beta, alpha) == pytest.approx(gather)
    assert cost.collective_seconds("reduce_scatter", 3, mb8, 4, beta, alpha) == pytest.approx(105e-6)
    assert cost.collective_seconds("all_to_all", 3, mb8, 4, beta, alpha) == pytest.approx(105e-6)
    assert cost.collective_seconds("broadcast", 3, mb8, 4, beta, alpha) == pytest.approx(105e-6)
    assert cost.collective_seconds("all_reduce", 3, mb8, 4, beta, alpha) == pytest.approx(210e-6)  # 90 + 120 µs
    assert cost.collective_seconds("send", 3, mb8, 2, beta, alpha) == pytest.approx(95e-6)  # 15 + 80 µs
    assert cost.collective_seconds("recv", 3, mb8, 2, beta, alpha) == pytest.approx(95e-6)
    assert cost.collective_seconds("all_reduce", 3, mb8, 1, beta, alpha) == 0.0
    with pytest.raises(ValueError, match="'all_gather_into_tensor'.*tpplan bug"):
        cost.collective_seconds("all_gather_into_tensor", 1, 1, 2, beta, alpha)


def test_comm_seconds_per_axis_at_its_link():
    # the dry run's figures for tiny at pp 2 x tp 2 (plans/llama_pp_tp.yaml), on 2 GPUs per node: tp inside, pp across
    comms = {"pp": {"forward": {"send": {"count": 4, "bytes": 16384}}, "backward": {"recv": {"count": 4, "bytes": 16384}}},
             "tp": {"forward": {"all_reduce": {"count": 12, "bytes": 49152}}, "backward": {"all_reduce": {"count": 8, "bytes": 32768}}}}
    got = cost.comm_seconds(comms, {"pp": 2, "tp": 2}, cost.GPUS["h100"], 2)
    pp = 2 * (4 * 10e-6 + 16384 / 50e9)  # 80 µs + 0.65536 µs
    tp = 2 * 20 * 5e-6 + (49152 + 32768) / 450e9  # 200 µs + 0.182 µs
    assert got == {"pp": pytest.approx(pp), "tp": pytest.approx(tp)}
    assert got["pp"] == pytest.approx(80.65536e-6)
    # efsdp's groups are dp_shard·cp·tp / ep ranks (the dry run files the experts' FSDP2 under it)
    experts = {"efsdp": {"backward": {"reduce_scatter": {"count": 2, "bytes": 98304}}}}
    got = cost.comm_seconds(experts, {"dp_shard": 2, "tp": 2, "ep": 2}, cost.GPUS["h100"], 8)
    assert got == {"efsdp": pytest.approx(2 * 1 * 5e-6 + 0.5 * 98304 / 450e9)}
    # ep 4 = dp_shard 4 (tp 1): the dry run files EP's all_to_all under dp_shard, whose group it is; it stays exposed
    shared = {"dp_shard": {"forward": {"all_to_all": {"count": 6, "bytes": 32832}, "all_gather": {"count": 3, "bytes": 85376}}}}
    got = cost.comm_seconds(shared, {"dp_shard": 4, "tp": 1, "ep": 4}, cost.GPUS["h100"], 8)
    assert got == {"dp_shard": pytest.approx(3 * 3 * 5e-6 + 0.75 * 85376 / 450e9),
                   "ep": pytest.approx(6 * 3 * 5e-6 + 0.75 * 32832 / 450e9)}
    assert cost.step_time(1.0, got, 0.0).comm == pytest.approx(got["ep"])
    with pytest.raises(ValueError, match="'gather'"):
        cost.comm_seconds({"tp": {"forward": {"gather": {"count": 1, "bytes": 1}}}}, {"tp": 2}, cost.GPUS["h100"], 8)


def test_compute_and_the_step():
    assert cost.compute_seconds(989e12 * 0.4 * 2.5, cost.GPUS["h100"]) == pytest.approx(2.5)
    # FSDP's 1.5 s hides behind 2 s of compute; TP's 0.3 s and PP's 0.1 s are added
    step = cost.step_time(2.0, {"dp_shard": 1.5, "tp": 0.3, "pp": 0.1}, 0.0)
    assert step == cost.StepTime(2.0, pytest.approx(0.4), 0.0, pytest.approx(2.4))
    # 2.5 s of FSDP and HSDP against 2 s: 0.5 s shows; a 20% bubble idles 2.5 x 0.2 / 0.8 = 0.625 s
    # EP's all_to_all waits on the critical path; the experts' FSDP (efsdp) hides behind compute as dp_shard's
    step = cost.step_time(2.0, {"ep": 0.3, "efsdp": 1.5, "dp_shard": 0.4}, 0.0)
    assert (step.comm, step.total) == (pytest.approx(0.3), pytest.approx(2.3))
    step = cost.step_time(2.0, {"dp_shard": 1.5, "dp_replicate": 1.0}, 0.2)
    assert (step.comm, step.bubble, step.total) == (pytest.approx(0.5), pytest.approx(0.625), pytest.approx(3.125))
    assert step.bubble / step.total == pytest.approx(0.2)  # the bubble is its share of the whole step
    with pytest.raises(ValueError):
        cost.step_time(1.0, {}, 1.0)
