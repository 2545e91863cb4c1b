"""The machinery under the layout-flow rules: the traced forward (with repeated
blocks replayed), the dim bookkeeping of views and indexing, the cut-down model
of the dry run, and the communication savings TP340 promises."""

from __future__ import annotations

import pytest
import torch
from lint_helpers import lint, meta_model, only
from torch import nn

from tpplan import load_plan
from tpplan.lint.context import LintContext
from tpplan.lint.ops import _index_dim, _view_dim, _view_shard
from tpplan.lint.trace import Call, Op, Return, TraceError, _Tracer, trace_model
from tpplan.models.mlp import MLP
from tpplan.simulation.simulate import count_collectives, default_inputs, simulated_world, tp_mesh


@pytest.mark.parametrize("src, dst, dim, moved", [
    ((2, 8, 128), (2, 8, 16, 8), 2, 2),  # features split into heads: the shard goes to the heads
    ((2, 8, 16, 8), (2, 8, 128), 2, 2),  # heads merged back into features
    ((2, 8, 16, 8), (2, 8, 128), 3, None),  # a shard of head_dim is interleaved once merged
    ((2, 8, 128), (16, 128), 0, 0),  # batch merged with sequence: the outer dim carries the shard
    ((2, 8, 128), (16, 128), 1, None),
    ((2, 1, 8), (2, 8), 2, 1),  # squeezed
])
def test_a_view_moves_a_shard_to_the_outermost_dim_of_its_group(src, dst, dim, moved):
    assert _view_dim(src, dst, dim) == moved


@pytest.mark.parametrize("src, dst, dim, split, moved", [
    ((2, 8, 64), (16, 64), 1, 1, (0, 2)),  # batch merged in front of a sequence shard: each rank's block of both entries
    ((16, 64), (2, 8, 64), 0, 2, (1, 1)),  # viewed back: a contiguous sequence shard again
    ((16, 64), (16, 64), 0, 2, (0, 2)),  # the same shape: still strided
    ((16, 64), (4, 4, 64), 0, 2, None),  # cut into other groups: not followed
    ((2, 4, 8, 64), (64, 64), 2, 1, (0, 8)),  # two dims merged in front
    ((2, 8, 16, 8), (2, 8, 128), 3, 1, (2, 16)),  # head_dim merged behind heads: its block in each of 16 heads
    ((2, 1, 8), (2, 8), 1, 1, None),  # a shard of a dim of size 1, squeezed away: nothing to follow
])
def test_a_view_merging_dims_in_front_of_a_local_shard_makes_it_strided_and_splitting_them_back_undoes_it(src, dst, dim, split, moved):
    assert _view_shard(src, dst, dim, split) == moved


@pytest.mark.parametrize("shape, index, dim, moved", [
    ((2, 8, 16, 4, 2), (Ellipsis, 0), 2, 2),
    ((8, 4, 2), (None, slice(None), None, slice(None), 0), 0, 1),  # the rotary table's broadcast view
    ((2, 8, 16), (slice(None), slice(None), slice(0, 4)), 2, None),  # slicing into the sharded dim
    ((2, 8, 16), (slice(None), slice(None), slice(None, 99)), 2, 2),  # a slice that keeps all of it
    ((2, 8, 16), (slice(None), 0), 2, 1),
    ((2, 8, 16), [0, 1], 0, None),  # advanced indexing
])
def test_basic_indexing_moves_the_shard_and_slicing_into_it_loses_it(shape, index, dim, moved):
    assert _index_dim(index, shape, dim) == moved


def _events(trace):
    """Events without node ids: what a replay must reproduce."""
    out = []
    for event in trace.events:
        if isinstance(event, Op):
            out.append(("op", event.name, tuple(trace.shapes[n] for n in event.inputs), tuple(trace.shapes[n] for n in event.outputs)))
        elif isinstance(event, Call):
            out.append(("call", event.fqn, tuple(None if a is None else trace.shapes[a] for a in event.args)))
        else:
            out.append(("return", event.fqn, tuple(None if o is None else trace.shapes[o] for o in event.outputs)))
    return out


def test_replayed_blocks_record_what_running_them_records(monkeypatch):
    model = meta_model("tpplan.models.llama:tiny")
    inputs = (default_inputs(model),)
    replayed = trace_model(model, inputs)
    monkeypatch.setattr(_Tracer, "memo_key", lambda self, module, args, kwargs: None)
    executed = trace_model(model, inputs)
    assert _events(replayed) == _events(executed)
    assert sum(isinstance(e, Call) and e.fqn == "layers.1.attention.wq" for e in replayed.events) == 1


def test_a_replayed_block_keeps_its_dataflow():
    trace = trace_model(meta_model("tpplan.models.mlp:tiny"), (default_inputs(meta_model("tpplan.models.mlp:tiny")),))
    calls = {e.fqn: e for e in trace.events if isinstance(e, Call)}
    returns = {e.fqn: e for e in trace.events if isinstance(e, Return)}
    # block 1 (replayed) is fed what block 0 returned
    assert calls["blocks.1"].args[0] == returns["blocks.0"].outputs[0]
    assert calls["blocks.1.in_proj"].args[0] == calls["blocks.1"].args[0]


def test_a_block_returning_an_opaque_object_in_a_tuple_is_run_again_not_replayed():
    class Cache:
        pass

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x), Cache()

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x, _ = block(x)
            return x

    with torch.device("meta"):
        model = Stack()
    trace = trace_model(model, (torch.zeros(2, 4, device="meta"),))  # a replay would return None, not a tuple
    assert [e.fqn for e in trace.events if isinstance(e, Call)][-1] == "blocks.2.lin"


def test_tracing_leaves_the_model_as_it_was_even_when_the_forward_fails():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x):
            return self.proj(x).sum().item()

    with torch.device("meta"):
        model = Broken()
    with pytest.raises(TraceError, match=r"RuntimeError: .*item\(\).* \(at .*test_lint_flow.py:\d+\)"):
        trace_model(model, (torch.zeros(2, 4, device="meta"),))
    assert all("forward" not in vars(m) for m in model.modules())


def test_models_that_meta_tensors_cannot_run_are_traced_on_fake_tensors():
    pytest.importorskip("transformers")
    plan = load_plan(text="version: 1\nrules:\n  lm_head: {style: colwise, output_layouts: replicate}\n")
    ctx = LintContext(plan, meta_model("tpplan.models.hf:llama"), [2])
    assert ctx.trace is not None and ctx.trace_mode == "fake"  # transformers' masks call .item() on meta


def test_repeated_blocks_are_cut_to_two_unless_a_rule_sets_one_apart():
    with torch.device("meta"):
        model = MLP(n_blocks=6)
    uniform = load_plan(text="version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.out_proj: rowwise\n")
    [(container, kept)] = LintContext(uniform, model, [2]).kept_blocks
    assert container is model.blocks and list(kept) == ["0", "1"]
    special = load_plan(text="version: 1\nrules:\n  blocks.[!3].in_proj: colwise\n  blocks.3.in_proj: {style: colwise, use_local_output: false}\n  blocks.*.out_proj: rowwise\n")
    [(_, kept)] = LintContext(special, model, [2]).kept_blocks
    assert list(kept) == ["0", "1", "3", "4", "5"]


def test_a_deep_model_is_dry_run_on_two_blocks_and_problems_name_real_modules():
    with torch.device("meta"):
        model = MLP(dim=32, hidden=96, n_blocks=12)
    problems = lint("""
        version: 1
        rules:
          blocks.*.in_proj: colwise
          blocks.*.out_proj: rowwise
    """, model, tp=(4,))
    assert problems == []
    before = len(list(model.modules()))
    lint("version: 1\nrules:\n  blocks.*.in_proj: colwise\n  blocks.*.out_proj: rowwise\n", model, tp=(2,), select=["TP330"])
    assert len(list(model.modules())) == before  # the cut is made on a copy


def test_tp340_savings_are_what_the_collectives_show():
    naive = "version: 1\nrules:\n  layers.*.attention.w{q,k,v}: colwise\n  layers.*.attention.wo: rowwise\n"
    fixed = """\
version: 1
rules:
  layers.*.attention:
    style: prepare_module_input
    input_layouts: [replicate, null]
    desired_input_layouts: [replicate, null]
    use_local_output: false
  layers.*.attention.w{q,k,v}: colwise
  layers.*.attention.wo: rowwise
"""
    hint = only(lint(naive, "tpplan.models.llama:tiny", select=["TP340"]), "TP340")
    assert "(4 all-reduces per forward-backward" in hint.message
    backward = []
    for text in (naive, fixed):
        with simulated_world(2), torch.device("meta"):
            from tpplan.models.llama import tiny

            model = tiny()
            load_plan(text=text).apply(model, tp_mesh(2))
            backward.append(count_collectives(model, default_inputs(model))["backward"]["all_reduce"])
    assert backward[0] - backward[1] == 4


class _Cats(nn.Module):
    """A colwise pair (ask, key -> tell) whose column outputs meet a `cat`: `how` says which."""

    def __init__(self, how: str, dim: int = 16):
        super().__init__()
        self.how = how
        self.ask, self.key = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.tell = nn.Linear(2 * dim if how in ("packed", "beside_whole") else dim, dim)

    def forward(self, x):
        a, k = self.ask(x), self.key(x)
        if self.how == "cache":  # transformers' DynamicCache: its first update cats onto `torch.tensor([])`
            k = torch.cat([torch.empty(0, dtype=k.dtype, device=k.device), k], dim=-2)
            return self.tell(a * k)
        if self.how == "split_back":  # cat along the sharded dim, then cut back into the same pieces
            a, k = torch.cat([a, k], dim=-1).split([a.shape[-1], k.shape[-1]], dim=-1)
            return self.tell(a * k)
        if self.how.startswith("fresh"):  # DeepSeek-V3's expand_kv: a fresh tensor of the shard's heads, filled in place
            heads = a.unflatten(-1, (-1, 4))
            both = heads.new_empty(*heads.shape[:-1], 2 * heads.shape[-1])
            both[..., : heads.shape[-1]].copy_(heads)
            whole = x.unflatten(-1, (-1, 4))
            # a replicated head expanded to the rank's heads fills its half; the whole tensor's heads do not fit
            both[..., heads.shape[-1]:].copy_(whole[..., :1, :].expand(-1, -1, heads.shape[2], -1) if self.how == "fresh" else whole)
            return self.tell((both[..., : heads.shape[-1]] * both[..., heads.shape[-1]:]).flatten(-2))
        if self.how == "packed":  # [a_r | k_r] on each rank is no contiguous shard of the cat
            return self.tell(torch.cat([a, k], dim=-1))
        return self.tell(torch.cat([a, x], dim=-1))  # beside_whole: a rank's shard beside the whole input


_CAT_PLAN = """
version: 1
rules:
  "{ask,key}": colwise
  tell: rowwise
"""


@pytest.mark.parametrize("how", ["cache", "split_back", "fresh"])
def test_cat_of_shards_is_followed_not_stopped(how):
    """A cat that keeps each rank's shard (a 1-D empty tensor torch.cat skips; the sharded
    dim's pieces cut back as they were put together; a fresh tensor of the rank's heads
    filled from the shard and a replicated head expanded to them) is followed to the
    rowwise half: no TP328 (the flow stopped) and nothing else."""
    with torch.device("meta"):
        model = _Cats(how)
    assert [str(p) for p in lint(_CAT_PLAN, model)] == []


@pytest.mark.parametrize("how, code, message", [
    ("packed", "TP326", "'tell'"),
    ("beside_whole", "TP321", "'cat'"),
    ("fresh_beside_whole", "TP322", "'copy'"),
])
def test_a_cat_that_breaks_the_shard_is_still_flagged(how, code, message):
    """A cat along the sharded dim handed to a rowwise half as if contiguous, or a shard
    beside the whole tensor it is a shard of: errors, located at the colwise rule (line 3)."""
    with torch.device("meta"):
        model = _Cats(how)
    problems = lint(_CAT_PLAN, model)
    problem = only(problems, code)
    assert (problem.line, problem.severity) == (3, "error") and message in problem.message, str(problem)
    assert not [p for p in problems if p.code == "TP328"]


def test_the_shipped_hf_llama_plan_validates_strict_on_a_gqa_llama_with_its_cache(tmp_path):
    """transformers' Llama (2 KV heads of 4, the cache on, as a config.json has it) caches keys
    and values by `torch.cat` onto an empty 1-D tensor: the flow follows the shards through
    it, so `validate --strict` passes (it warned TP328 at 'cat', exit 1)."""
    import json
    from pathlib import Path

    from typer.testing import CliRunner

    from tpplan.cli.app import app

    pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 128}))
    plan = Path(__file__).resolve().parent.parent / "plans" / "hf" / "llama_tp.yaml"
    result = CliRunner().invoke(app, ["validate", "--strict", str(plan), "--model", f"hf:{tmp_path}", "--tp", "2"])
    assert result.exit_code == 0 and "TP328" not in result.output, result.output


class _Router(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x):
        return torch.sigmoid(self.gate(x).float())


class _ScoredMoE(nn.Module):
    """torchtitan's MoE in small: a router's scores and two feed-forwards whose outputs are
    partial sums (rowwise, output partial); the routed one scattered into zeros, then
    weighed by the scores after it (`R @ P`) or its input by them before it, plus the
    shared one (`P + P`)."""

    def __init__(self, after: bool, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.after = after
        self.router = _Router(dim)
        self.up, self.down = nn.Linear(dim, hidden), nn.Linear(hidden, dim, bias=False)
        self.shared_up, self.shared_down = nn.Linear(dim, hidden), nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        flat = x.view(-1, x.shape[-1])
        scores = self.router(flat)
        routed = self.down(torch.relu(self.up(flat if self.after else flat * scores)))
        unsorted = torch.zeros(flat.shape, dtype=routed.dtype, device=routed.device)
        unsorted[torch.arange(flat.shape[0], device=flat.device)] = routed
        if self.after:
            unsorted = torch.bmm(scores.reshape(-1, 1, 1), unsorted.unsqueeze(1)).squeeze(1)
        return (self.shared_down(torch.relu(self.shared_up(flat))) + unsorted).view_as(x)


class _ScoredModel(nn.Module):
    def __init__(self, after: bool):
        super().__init__()
        self.moe = _ScoredMoE(after)

    def forward(self, x):
        return self.moe(x)


_SCORED_PLAN = """
version: 1
rules:
  moe: {style: prepare_module_output, output_layouts: partial, desired_output_layouts: replicate}
  moe.{up,shared_up}: colwise
  moe.{down,shared_down}: {style: rowwise, output_layouts: partial}
"""


def test_scores_weighing_partial_sums_need_their_gate_summed_and_the_flow_follows_the_partial_sums():
    """The partial sums are followed through the scatter into zeros, the scores' bmm and
    the sum with the shared experts' (no TP328). Scores applied after the experts: each
    rank's gradient of them is its share of a sum (TP325 at the MoE's rule, naming the
    router's gate), fixed by summing the gate's output gradient; applied before, clean."""
    with torch.device("meta"):
        after, before = _ScoredModel(after=True), _ScoredModel(after=False)
    problems = lint(_SCORED_PLAN, after)
    assert [p.code for p in problems] == ["TP325"], [str(p) for p in problems]
    problem = problems[0]
    assert (problem.line, problem.severity) == (3, "error"), str(problem)
    assert "in 'bmm' inside 'moe', a whole tensor computed from parameters (from the output of 'moe.router.gate')" in problem.message
    assert problem.message.endswith("add the rule 'moe.router.gate: sum_output_grad' (its output's gradient summed over the mesh)")
    assert [str(p) for p in lint(_SCORED_PLAN + "  moe.router.gate: sum_output_grad\n", after)] == []
    assert [str(p) for p in lint(_SCORED_PLAN, before)] == []
