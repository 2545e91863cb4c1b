"""MoE checkpoints into the expert styles: tiny Qwen3-MoE, Mixtral and gpt-oss saved
with `save_pretrained` and loaded at TP 2 (one-process simulation) by the *_tp
(expert_tp: packed gate/up as `_StridedShard`) and *_ep (expert_parallel) plans.

transformers 5.24 writes Qwen3-MoE and Mixtral experts per expert (its conversion
mapping un-fuses `experts.gate_up_proj [E, 2I, H]` into `experts.{e}.gate_proj` /
`up_proj` (Mixtral: `block_sparse_moe.experts.{e}.w1` / `w3`) and `down_proj` /
`w2`), gpt-oss fused as the model holds it; load_checkpoint maps both.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from tpplan import load_plan  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.checkpoint.inspect import match  # noqa: E402
from tpplan.simulation.simulated_load import simulated_load  # noqa: E402
from tpplan.checkpoint.source import locate, read_metadata  # noqa: E402
from tpplan.simulation.simulate import allowed_diff, max_abs_diff, tolerance  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    out = {}
    for i, name in enumerate(FAMILIES):
        torch.manual_seed(30 + i)
        getattr(hf_models, name)().save_pretrained(root / name)
        out[name] = root / name
    return out


def ids():
    return torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))


def test_transformers_writes_experts_per_expert_except_gpt_oss(saved):
    def keys(name):
        with safe_open(saved[name] / "model.safetensors", "pt") as f:
            return set(f.keys())

    qwen, mixtral, oss = keys("qwen3_moe"), keys("mixtral"), keys("gpt_oss")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in qwen and "model.layers.0.mlp.experts.gate_up_proj" not in qwen
    assert "model.layers.0.block_sparse_moe.experts.0.w3.weight" in mixtral
    assert {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks"} <= oss


@pytest.mark.parametrize("style", ["tp", "ep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_checkpoint_loads_at_tp2_equal_to_from_pretrained(saved, family, style):
    reference = transformers.AutoModelForCausalLM.from_pretrained(saved[family]).eval()
    inputs = ids()
    with torch.no_grad():
        want = reference(inputs).logits
    plan = load_plan(ROOT / f"plans/hf/{family}_{style}.yaml")
    build = getattr(hf_models, family)
    with simulated_load(build, plan, 2, str(saved[family])) as sim:
        sim.model.eval()
        with torch.no_grad():
            outputs = sim.run(inputs)
        for rank, got in enumerate(outputs):
            diff = max_abs_diff(got, want)
            print(f"{family}_{style} TP2 rank {rank}: max |logits diff| = {diff:.3g}")
            assert diff <= allowed_diff(want, *tolerance(torch.float32)), f"rank {rank}: {diff}"
        # every rank holds its expert shards with the checkpoint's values
        ref = dict(reference.named_parameters())
        for name, param in sim.model.named_parameters():
            if ".experts." in name:
                full = param.full_tensor()
                for r, value in full._local_tensors.items():
                    assert torch.equal(value, ref[name].detach()), (name, r)


@pytest.mark.parametrize("style", ["tp", "ep"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dry_run_read_bytes_give_each_rank_its_expert_share(saved, family, style):
    """The bytes each rank reads: experts 1/TP, the rest per the plan, all ranks alike."""
    from torch.distributed.device_mesh import init_device_mesh

    from tpplan.simulation.simulate import simulated_world

    source = locate(saved[family])
    read_metadata(source)
    # expert_tp keeps gpt-oss's down_proj_bias [E, H] whole (it is added once to the reduced output)
    whole = ("down_proj_bias",) if style == "tp" else ()
    expert_bytes = sum(md.size.numel() * 4 for k, md in source.tensors.items() if ".experts." in k and not k.endswith(whole))
    whole_bytes = sum(md.size.numel() * 4 for k, md in source.tensors.items() if ".experts." in k and whole and k.endswith(whole))
    with simulated_world(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        with torch.device("meta"):
            model = getattr(hf_models, family)()
        load_plan(ROOT / f"plans/hf/{family}_{style}.yaml").apply(model, mesh)
        found = match(model, source)
    assert not found.problems
    full = match_unsharded(family, source)
    per_rank = found.rank_bytes(2)
    assert per_rank[0] == per_rank[1]
    # sharded expert tensors: exactly half of their bytes on each rank
    share = sum(torch.Size(exp.local_shapes[0]).numel() * 4 for exp, _ in found.fused.values())
    share += sum(torch.Size(e.local_shapes[0]).numel() * 4 for k, e in found.loads.items() if ".experts." in k and not k.endswith(whole or ("-",)))
    assert share * 2 == expert_bytes
    kept = sum(torch.Size(e.local_shapes[0]).numel() * 4 for k, e in found.loads.items() if whole and k.endswith(whole))
    assert kept == whole_bytes
    print(f"{family}_{style} TP2: rank reads {per_rank[0]} of {full} bytes; experts {share} of {expert_bytes + whole_bytes}")
    assert per_rank[0] < full


def match_unsharded(family, source) -> int:
    with torch.device("meta"):
        model = getattr(hf_models, family)()
    found = match(model, source)
    assert not found.problems
    return found.rank_bytes(1)[0]


@pytest.mark.parametrize("family,style,tp", [("qwen3_moe", "tp", 2), ("mixtral", "ep", 2), ("gpt_oss", "tp", 4)])
def test_apply_dry_run_checkpoint_on_a_moe_checkpoint(saved, family, style, tp):
    """`apply --dry-run --checkpoint`: no missing or unexpected key, each rank reads its shards'
    bytes (the experts' 1/TP), and --check (the simulated load) equals one device."""
    import json

    from typer.testing import CliRunner

    from tpplan.cli.app import app

    # gpt-oss by its factory: `--model hf:` builds it with sdpa, which its transformers class refuses
    model = f"tpplan.models.hf:{family}" if family == "gpt_oss" else f"hf:{saved[family]}"
    result = CliRunner().invoke(app, [
        "apply", "--dry-run", "--tp", str(tp), "--model", model, "--plan", str(ROOT / f"plans/hf/{family}_{style}.yaml"),
        "--checkpoint", str(saved[family]), "--check", "--format", "json",
    ])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    ckpt = report["checkpoint"]
    assert (ckpt["missing"], ckpt["unexpected"]) == ([], [])
    assert ckpt["rank_read_bytes"] == [report["params"]["per_rank_bytes"]] * tp
    assert report["check"]["passed"] is True
