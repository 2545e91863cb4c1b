"""The plan-less reference models (tests/zoo.py): they build (also on meta), train,
trace with the lint's tracer, and their attention does what its docstring says under
column/row sharding."""

import pytest
import torch
import torch.nn.functional as F
import zoo
from torch import nn

from tpplan.lint.trace import Call, trace_model
from tpplan.simulation.ladder import running
from tpplan.simulation.modelref import load_callable, make_inputs
from tpplan.simulation.simulate import NoDefaultInputs, default_inputs

# name -> (output shape for the default inputs, the inputs reference or None for the default)
MODELS = {
    "vit": ((2, 16), None),
    "mamba": ((2, 8, 256), None),
    "mlp_stack": ((2, 8, 16), None),
    "custom_attention": ((2, 8, 256), None),
    "custom_attention_strided": ((2, 8, 256), None),
    "convnet": ((2, 8), "zoo:convnet_inputs"),
}

# Names DeepSpeed AutoTP / transformers' plans know a projection by: none may appear.
KNOWN_NAMES = {
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn", "c_proj", "c_fc",
    "gate_proj", "up_proj", "down_proj", "gate_up_proj", "dense", "dense_h_to_4h", "dense_4h_to_h",
    "out_proj", "in_proj", "x_proj", "dt_proj", "fc1", "fc2", "wq", "wk", "wv", "wo", "w1", "w2", "w3",
    "qkv", "proj", "lm_head", "embed_tokens", "query", "value", "attn", "mlp", "self_attn",
}


def inputs_for(name, model, device="cpu"):
    return make_inputs(MODELS[name][1], model, device)


@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_trains_deterministically_from_a_seed(name):
    torch.manual_seed(0)
    model = getattr(zoo, name)()
    torch.manual_seed(0)
    again = getattr(zoo, name)()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))
    assert model.training
    torch.manual_seed(1)
    (x,) = inputs_for(name, model)
    out = model(x)
    assert out.shape == MODELS[name][0]
    assert torch.equal(out, again(x))
    out.square().mean().backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", MODELS)
def test_zoo_model_builds_on_meta_and_traces_every_parameterized_module(name):
    with torch.device("meta"):  # as `--model zoo:NAME` builds it
        model = load_callable(f"zoo:{name}")()
    assert all(p.device.type == "meta" for p in model.parameters())
    with running("meta", model):
        trace = trace_model(model, inputs_for(name, model, "meta"))
    called = {e.fqn for e in trace.events if isinstance(e, Call)}
    weighted = {fqn for fqn, m in model.named_modules() if fqn and next(m.parameters(recurse=False), None) is not None}
    assert weighted <= called


@pytest.mark.parametrize("name", MODELS)
def test_zoo_module_names_are_unknown_to_name_based_tools(name):
    leaves = {fqn.rsplit(".", 1)[-1] for fqn, _ in getattr(zoo, name)().named_modules()}
    assert not leaves & KNOWN_NAMES


def test_convnet_has_no_default_inputs_and_names_its_inputs_factory():
    model = zoo.convnet()
    with pytest.raises(NoDefaultInputs, match="Conv1d"):
        default_inputs(model)
    (x,) = make_inputs("zoo:convnet_inputs", model, "meta")
    assert x.device.type == "meta" and x.shape == (2, zoo.CONVNET_CHANNELS, zoo.CONVNET_LENGTH)


@pytest.mark.parametrize("name", ["mamba", "custom_attention", "custom_attention_strided"])
def test_decoders_are_causal(name):
    torch.manual_seed(0)
    model = getattr(zoo, name)().eval()
    ids = torch.randint(0, 256, (1, 8))
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_hand_written_attention_equals_causal_sdpa():
    torch.manual_seed(0)
    look = zoo.Lookup(dim=32, heads=4, strided=False)
    x = torch.randn(2, 6, 32)
    q, k, v = (look.ask(x).view(2, 6, 4, 8).transpose(1, 2), look.key(x).view(2, 6, 4, 8).transpose(1, 2),
               look.val(x).view(2, 6, 4, 8).transpose(1, 2))
    want = look.tell(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 6, 32))
    torch.testing.assert_close(look(x), want)


def _sharded(look: zoo.Lookup, x: torch.Tensor, tp: int) -> torch.Tensor:
    """The attention run as `tp` ranks would: ask/key/val colwise (contiguous output
    rows), tell rowwise, the partial outputs summed (the all-reduce)."""
    width = look.ask.out_features // tp
    total = torch.zeros_like(x)
    for rank in range(tp):
        rows = slice(rank * width, (rank + 1) * width)
        local = zoo.Lookup(look.ask.in_features, look.heads, look.strided)
        with torch.no_grad():
            for name in ("ask", "key", "val"):
                getattr(local, name).weight = nn.Parameter(getattr(look, name).weight[rows])
            local.tell.weight = nn.Parameter(look.tell.weight[:, rows])
        total += local(x)
    return total


@pytest.mark.parametrize("strided", [False, True])
def test_only_heads_first_attention_survives_contiguous_column_shards(strided):
    torch.manual_seed(0)
    look = zoo.Lookup(dim=32, heads=4, strided=strided)
    x = torch.randn(2, 6, 32)
    with torch.no_grad():
        full, tp2 = look(x), _sharded(look, x, 2)
    # heads first: each rank holds 2 whole heads; head_dim-major: each holds half of every head
    assert torch.allclose(full, tp2, atol=1e-5) is not strided
