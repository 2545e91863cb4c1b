"""Zero-copy loading (tpplan/checkpoint/mapped.py): a replicated tensor or a
dim-0 shard in the checkpoint's dtype becomes a view of safetensors' private
mapping of the file (not a fresh allocation), with the file's values; a
dim-1 shard, a dtype conversion and an already materialized tensor are copied;
writes never reach the file; saving over the source directory keeps the values;
a mapped shard stages for an asynchronous save.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402

from tpplan import load_checkpoint, load_plan, save_checkpoint  # noqa: E402
from tpplan.models import hf as hf_models  # noqa: E402
from tpplan.checkpoint.training import asyncsave  # noqa: E402
from tpplan.checkpoint.mapped import backing_file  # noqa: E402
from tpplan.checkpoint.save import state_to_save  # noqa: E402
from tpplan.simulation.simulate import simulated_world  # noqa: E402

pytestmark = pytest.mark.usefixtures("no_process_group_leaks")

PLAN = Path(__file__).resolve().parent.parent / "plans/hf/llama_tp.yaml"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{name: (directory, the file's tensors)} of a tiny fp32 Llama, untied and tied."""
    out = {}
    for name, factory in (("llama", hf_models.llama), ("llama_tied", hf_models.llama_tied)):
        torch.manual_seed(7)
        directory = tmp_path_factory.mktemp(name)
        factory().save_pretrained(directory)
        out[name] = (directory, load_file(directory / "model.safetensors"))
    return out


def digest(directory: Path) -> str:
    return hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()


def meta(factory=hf_models.llama):
    with torch.device("meta"):
        return factory()


def local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


def test_at_tp2_replicated_and_dim0_shards_view_the_file_and_dim1_shards_are_copied(saved):
    directory, tensors = saved["llama"]
    file = str(directory / "model.safetensors")
    with simulated_world(2, rank=1):
        from torch.distributed.device_mesh import init_device_mesh

        model = meta()
        load_plan(PLAN).apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        load_checkpoint(model, directory)
        params = dict(model.named_parameters())
        kinds = {}
        for name, p in params.items():
            full = tensors[name]
            placement = p.placements[0] if isinstance(p, DTensor) else Replicate()  # norms: plain parameters
            if isinstance(placement, Replicate):
                want, kind = full, "replicate"
            else:
                rows = full.shape[placement.dim] // 2
                want, kind = full.narrow(placement.dim, rows, rows), f"shard({placement.dim})"  # rank 1's half
            assert (tuple(p.shape), p.stride(), p.dtype) == (tuple(full.shape), full.stride(), full.dtype), name
            assert torch.equal(local(p), want), name
            assert backing_file(p) == (None if kind == "shard(1)" else file), (name, kind)
            kinds[kind] = kinds.get(kind, 0) + 1
        assert set(kinds) == {"replicate", "shard(0)", "shard(1)"}
        q = params["model.layers.0.self_attn.q_proj.weight"]
        assert q.placements == (Shard(0),) and isinstance(q, torch.nn.Parameter) and q.requires_grad
        assert torch.equal(q.to_local(), tensors["model.layers.0.self_attn.q_proj.weight"][32:])  # what it computes with


def test_an_optimizer_step_changes_the_parameters_not_the_file(saved):
    directory, tensors = saved["llama"]
    before = digest(directory)
    model = meta()
    load_checkpoint(model, directory)
    weight = model.model.layers[0].mlp.gate_proj.weight
    assert backing_file(weight) == str(directory / "model.safetensors")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.arange(8).view(1, 8)).logits.sum().backward()
    optimizer.step()
    assert not torch.equal(weight, tensors["model.layers.0.mlp.gate_proj.weight"])
    assert digest(directory) == before
    again = meta()
    load_checkpoint(again, directory)
    assert torch.equal(again.model.layers[0].mlp.gate_proj.weight, tensors["model.layers.0.mlp.gate_proj.weight"])


def test_tied_weights_stay_one_mapped_parameter(saved):
    directory, tensors = saved["llama_tied"]
    model = meta(hf_models.llama_tied)
    load_checkpoint(model, directory)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert backing_file(model.lm_head.weight) == str(directory / "model.safetensors")
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_a_dtype_conversion_and_a_materialized_model_are_copied(saved):
    directory, tensors = saved["llama"]
    converted = meta()
    load_checkpoint(converted, directory, dtype=torch.bfloat16)
    assert all(backing_file(p) is None and p.dtype == torch.bfloat16 for p in converted.parameters())
    torch.manual_seed(0)
    materialized = hf_models.llama()
    pointers = {n: p.data_ptr() for n, p in materialized.named_parameters()}
    load_checkpoint(materialized, directory)
    for name, p in materialized.named_parameters():  # filled in place: its storage may be aliased
        assert p.data_ptr() == pointers[name] and backing_file(p) is None and torch.equal(p, tensors[name])


def test_saving_over_the_files_a_model_views_keeps_its_values(saved, tmp_path):
    model = meta()
    load_checkpoint(model, saved["llama"][0])
    save_checkpoint(model, tmp_path, format="hf")  # tpplan's own file names
    reloaded = meta()
    load_checkpoint(reloaded, tmp_path)
    files = {backing_file(p) for p in reloaded.parameters()}
    assert len(files) == 1 and files.pop().startswith(str(tmp_path))
    save_checkpoint(reloaded, tmp_path, format="hf")  # rewrites the very files it views
    assert {backing_file(p) for p in reloaded.parameters()} == {None}
    last = meta()
    load_checkpoint(last, tmp_path)
    for name, p in last.named_parameters():
        assert torch.equal(p, saved["llama"][1][name]), name


def test_rank_1s_mapped_dim0_shards_stage_for_an_asynchronous_save(saved, monkeypatch):
    """Rank 1's rows start inside the tensor's bytes in the file; its DTensor must not
    carry that offset (torch's deepcopy, in DCP's staging, fails on a wrapper with one)."""
    directory, tensors = saved["llama"]
    monkeypatch.setitem(asyncsave._STAGED, "layout", None)  # this test's staging buffers go with it
    monkeypatch.setitem(asyncsave._STAGED, "buffers", None)
    with simulated_world(2, rank=1):
        from torch.distributed.device_mesh import init_device_mesh

        model = meta()
        load_plan(PLAN).apply(model, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
        load_checkpoint(model, directory)
        state = state_to_save(model)
        q = state["model.layers.0.self_attn.q_proj.weight"]
        assert q.placements == (Shard(0),) and backing_file(q) == str(directory / "model.safetensors")
        staged = asyncsave.stage(state)
        assert sorted(staged) == sorted(state) and all(backing_file(t) is None for t in staged.values())
        for name, t in state.items():
            assert torch.equal(local(staged[name]), local(t)), name
        assert torch.equal(local(staged["model.layers.0.self_attn.q_proj.weight"]), tensors["model.layers.0.self_attn.q_proj.weight"][32:])
