"""The reference models: shapes, module names, GQA, and meta-device builds."""

import pytest
import torch

from tpplan.models import llama, mlp
from tpplan.models.llama import Attention, LlamaConfig, repeat_kv


def test_tiny_llama_maps_token_ids_to_vocab_logits():
    model = llama.tiny()
    tokens = torch.randint(0, model.config.vocab_size, (2, 8))
    assert model(tokens).shape == (2, 8, model.config.vocab_size)


def test_llama_module_paths_are_torchtitan_names():
    names = {name for name, _ in llama.tiny().named_modules()}
    assert {
        "tok_embeddings",
        "layers.1.attention_norm",
        "layers.1.attention.wq",
        "layers.1.attention.wk",
        "layers.1.attention.wv",
        "layers.1.attention.wo",
        "layers.1.ffn_norm",
        "layers.1.feed_forward.w1",
        "layers.1.feed_forward.w2",
        "layers.1.feed_forward.w3",
        "norm",
        "output",
    } <= names


def test_attention_exposes_global_head_counts_for_lints():
    attention = llama.tiny().layers[0].attention
    assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (16, 8, 8)


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tiny_llama_shards_evenly_at_every_promised_tp_degree(tp):
    cfg = llama.tiny().config
    for size in (cfg.n_heads, cfg.n_kv_heads, cfg.ffn_hidden, cfg.vocab_size):
        assert size % tp == 0


def test_repeat_kv_repeats_each_kv_head_n_rep_times_in_place():
    kv = torch.randn(2, 5, 3, 4)
    assert torch.equal(repeat_kv(kv, 2), kv.repeat_interleave(2, dim=2))
    assert repeat_kv(kv, 1) is kv


def test_gqa_attention_equals_multi_head_attention_with_shared_kv_weights():
    gqa = Attention(LlamaConfig(dim=64, n_heads=8, n_kv_heads=2))
    mha = Attention(LlamaConfig(dim=64, n_heads=8, n_kv_heads=8))
    head_dim = gqa.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        # Query head h reads KV head h // n_rep: repeat each KV head's rows n_rep times.
        for name in ("wk", "wv"):
            rows = getattr(gqa, name).weight.view(2, head_dim, 64).repeat_interleave(4, dim=0)
            getattr(mha, name).weight.copy_(rows.reshape(-1, 64))
    x = torch.randn(2, 6, 64)
    rope = llama.rotary_table(6, head_dim, 10000.0)
    torch.testing.assert_close(gqa(x, rope), mha(x, rope))


def test_llama_is_causal():
    model = llama.tiny()
    tokens = torch.randint(0, 256, (1, 8))
    changed = tokens.clone()
    changed[0, 5:] = (changed[0, 5:] + 1) % 256
    torch.testing.assert_close(model(tokens)[:, :5], model(changed)[:, :5])


def test_rotary_embedding_preserves_norms_and_leaves_position_zero_alone():
    x = torch.randn(2, 4, 3, 8)
    rotated = llama.apply_rotary(x, llama.rotary_table(4, 8, 10000.0))
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(rotated[:, 0], x[:, 0])


def test_llama3_8b_builds_on_meta_without_allocating():
    with torch.device("meta"):
        model = llama.llama3_8b()
    params = list(model.parameters())
    assert all(p.is_meta for p in params)
    assert sum(p.numel() for p in params) == 8_030_261_248
    attention = model.layers[0].attention
    assert (attention.n_heads, attention.n_kv_heads, attention.head_dim) == (32, 8, 128)


def test_llama_runs_forward_on_meta():
    # The rotary table is made in forward on the tokens' device, so no buffer is left on CPU.
    with torch.device("meta"):
        model = llama.tiny()
        logits = model(torch.zeros(2, 8, dtype=torch.long))
    assert logits.is_meta and logits.shape == (2, 8, 256)


def test_llama_config_rejects_kv_heads_that_do_not_divide_heads():
    with pytest.raises(ValueError, match=r"n_kv_heads \(3\) must divide n_heads \(8\)"):
        LlamaConfig(dim=64, n_heads=8, n_kv_heads=3)


def test_llama_rejects_sequences_longer_than_max_seq_len():
    model = llama.Transformer(LlamaConfig(max_seq_len=4))
    with pytest.raises(ValueError, match=r"sequence length \(5\) must not exceed max_seq_len \(4\)"):
        model(torch.zeros(1, 5, dtype=torch.long))


def test_tiny_mlp_keeps_the_feature_width():
    model = mlp.tiny()
    assert model(torch.randn(2, 8, 32)).shape == (2, 8, 32)
    assert [name for name, _ in model.named_modules()][3:6] == ["blocks.0.in_proj", "blocks.0.act", "blocks.0.out_proj"]


def test_factories_pick_no_device():
    with torch.device("meta"):
        models = [llama.tiny(), mlp.tiny()]
    assert all(p.is_meta for model in models for p in model.parameters())



@pytest.mark.parametrize("build, count", [(llama.llama3_70b, 70_553_706_496), (llama.llama3_405b, 405_853_388_800)])
def test_llama3_70b_and_405b_shapes_have_the_published_parameter_counts(build, count):
    with torch.device("meta"):
        model = build()
    assert sum(p.numel() for p in model.parameters()) == count
