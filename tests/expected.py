"""Expected parameter bytes and collective counts of the shipped plans, shared by
test_dryrun, test_torchrun, test_parity and test_hf.

Derived from the model configs (not copied from a run): every sharded weight
splits evenly at the promised degrees, norms stay whole on every rank. Counts
are of one forward and one backward, the same at every TP degree.
"""

from __future__ import annotations

from tpplan.models import mlp
from tpplan.models.llama import LlamaConfig

FP32 = 4


def llama_bytes(cfg: LlamaConfig, tp: int) -> tuple[int, int]:
    """(total, per rank) parameter bytes of a Llama under the shipped plans: embedding,
    head, attention and feed-forward weights split over tp; norms whole on every rank."""
    head_dim = cfg.dim // cfg.n_heads
    attention = 2 * cfg.dim * cfg.n_heads * head_dim + 2 * cfg.dim * cfg.n_kv_heads * head_dim
    sharded = 2 * cfg.vocab_size * cfg.dim + cfg.n_layers * (attention + 3 * cfg.dim * cfg.ffn_hidden)
    norms = (2 * cfg.n_layers + 1) * cfg.dim
    assert sharded % tp == 0
    return FP32 * (sharded + norms), FP32 * (sharded // tp + norms)


def mlp_bytes(model: mlp.MLP, tp: int) -> tuple[int, int]:
    """in_proj weight and bias split by rows, out_proj weight by columns; out_proj bias whole."""
    block = model.blocks[0]
    dim, hidden = block.in_proj.in_features, block.in_proj.out_features
    sharded, whole = len(model.blocks) * (2 * dim * hidden + hidden), len(model.blocks) * dim
    return FP32 * (sharded + whole), FP32 * (sharded // tp + whole)


def llama_comms(plan: str, layers: int) -> dict:
    """Collectives of a Llama (ours or a transformers family) under `plan`: llama_tp.yaml
    or llama_tp_sp.yaml (or their plans/hf counterparts, which count the same)."""
    if plan == "llama_tp.yaml":
        # wo and w2 all-reduce per layer, + the vocab-parallel embedding; the head all-gathers
        # logits. Backward: one per shared input (attention, feed_forward) per layer, + the head's input.
        return {"forward": {"all_gather": 1, "all_reduce": 2 * layers + 1}, "backward": {"all_reduce": 2 * layers + 1}}
    # Sequence parallel: gather the sequence into attention and feed_forward, scatter it out of
    # wo and w2, + the embedding's scatter and the head's two gathers (its input, its logits).
    # Backward mirrors it: the embedding gathers its output grad, the head scatters its input
    # grad. Norm weight grads stay Partial (reduced at the optimizer step), so are not counted.
    return {
        "forward": {"all_gather": 2 * layers + 2, "reduce_scatter": 2 * layers + 1},
        "backward": {"all_gather": 2 * layers + 1, "reduce_scatter": 2 * layers + 1},
    }


def mlp_comms(blocks: int) -> dict:
    """Collectives of the MLP under mlp_tp.yaml: one all-reduce per out_proj forward; backward
    one per block input but the first, which is data (no grad), so never all-reduced."""
    return {"forward": {"all_reduce": blocks}, "backward": {"all_reduce": blocks - 1}}
