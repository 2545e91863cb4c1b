"""Interop (SPEC §7): `tpplan export --to torchtitan|transformers|accelerate` and
`tpplan import-config`. The exported configs are built with the frameworks' own
classes where they import (transformers' DistributedConfig, accelerate's
ParallelismConfig); torchtitan 0.3 does not import on torch 2.13, so its TOML is
read with tomllib and its field names checked against torchtitan's source. Each
round trip plan -> export -> import gives the same sizes and rules; what a target
cannot say is listed at its key; bad input is a located code, never a traceback."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan import load_plan
from tpplan.cli.app import app
from tpplan.core.aliases import TRANSFORMERS_STYLES
from tpplan.interop import frameworks as fw
from tpplan.interop.export import export_plan, transformers_keys
from tpplan.interop.import_config import import_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

runner = CliRunner()

# Every axis and section: what each target says and what it lists as not expressed.
FULL = """\
version: 2
name: llama-4d
mesh:
  dp_replicate: 2
  dp_shard: -1
  cp: 2
  tp: 2
  ep: 2
rules:
  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise
  model.layers.*.self_attn.o_proj: rowwise
  model.embed_tokens: {style: rowwise, input_layouts: replicate, output_layouts: replicate}
  model.norm: sequence_parallel
  lm_head: {style: colwise, output_layouts: replicate}
experts:
  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_to_all}
context_parallel:
  modules: model.layers.*.self_attn
  rotate: alltoall
fsdp:
  units: [model.layers.*, ""]
  mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}
checkpointing:
  modules: model.layers.*
training:
  global_batch: 64
  seq: 4096
  dtype: bf16
  optimizer: adamw
"""

# What transformers expresses whole: HSDP x TP x EP with its plans (no cp, no checkpointing, no training).
TRANSFORMERS_PLAN = """\
version: 2
mesh: {pp: 1, dp_replicate: 2, dp_shard: 2, cp: 1, tp: 2, ep: 4}
rules:
  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise
  model.layers.*.self_attn.o_proj: rowwise
  model.layers.*.mlp.{gate_proj,up_proj}: colwise
  model.layers.*.mlp.down_proj: rowwise
  model.embed_tokens: {style: rowwise, input_layouts: replicate, output_layouts: replicate}
  model.layers.*.input_layernorm: {style: sequence_parallel, use_local_output: true}
  lm_head: {style: colwise, output_layouts: replicate}
experts:
  model.layers.*.mlp.experts: {style: expert_parallel, dispatch: all_to_all}
fsdp:
  units: [model.layers.*, model.embed_tokens, ""]
  reshard_after_forward: false
  mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}
  offload: true
"""

# What accelerate expresses whole: HSDP x CP x TP sizes.
ACCELERATE_PLAN = "version: 2\nmesh: {dp_replicate: 2, dp_shard: 2, cp: 2, tp: 2}\nrules: {}\n"

# What torchtitan's [parallelism] and [training] express whole.
TORCHTITAN_PLAN = """\
version: 2
mesh: {pp: 2, dp_replicate: 2, dp_shard: -1, cp: 2, tp: 2, ep: 4}
rules: {}
fsdp:
  reshard_after_forward: false
  mixed_precision: {param_dtype: bf16, reduce_dtype: fp32}
  offload: true
training: {global_batch: 64, seq: 8192, dtype: bf16}
"""


def plan_at(tmp_path: Path, text: str, name: str = "plan.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return load_plan(path)


def round_trip(tmp_path: Path, plan, target: str, **sizes):
    exported = export_plan(plan, target, **sizes)
    assert exported.text and not [p for p in exported.problems if p.severity == "error"]
    path = tmp_path / f"exported.{'toml' if target == 'torchtitan' else 'json'}"
    path.write_text(exported.text)
    imported = import_config(path, output=tmp_path / "imported.yaml")
    assert imported.format == target
    (tmp_path / "imported.yaml").write_text(imported.text)
    return exported, imported, load_plan(tmp_path / "imported.yaml")


def rule_meaning(plan) -> dict[str, object]:
    """{each transformers key the rules spell out: its spec}: the rules as what they claim."""
    return {key: rule.spec for rule in plan.rules for key in transformers_keys(rule.pattern)}


def test_transformers_round_trip_through_distributed_config(tmp_path):
    from transformers.distributed import DistributedConfig

    plan = plan_at(tmp_path, TRANSFORMERS_PLAN)
    exported, imported, back = round_trip(tmp_path, plan, "transformers")
    assert exported.not_expressed == []
    config = DistributedConfig(**json.loads(exported.text))  # transformers' own checks: ep % tp, ep | fsdp·tp
    assert (config.tp_size, config.fsdp_size, config.dp_replicate_size, config.pp_size, config.ep_size) == (2, 2, 2, 1, 4)
    assert config.efsdp_size == 1  # fsdp·tp / ep: every expert whole on one rank of its group
    assert config.tp_plan["model.layers.*.self_attn.k_proj"] == "colwise"
    assert config.tp_plan["model.embed_tokens"] == "embedding_rowwise"
    assert config.tp_plan["model.layers.*.input_layernorm"] == "sequence_parallel"
    assert config.ep_plan == {"model.layers.*.mlp.experts": "ep_dispatch_experts"} and config.ep_implementation == "all_to_all"
    assert config.fsdp_plan == {"model.layers.*": "keep_full_weight", "model.embed_tokens": "keep_full_weight"}
    assert config.fsdp_cpu_offload and config.fsdp_mixed_precision
    # its own serialisation reads back to the same plan
    again = tmp_path / "again.json"
    again.write_text(config.to_json_string())
    assert import_config(again).text.split("\n", 2)[2] == imported.text.split("\n", 2)[2]

    assert imported.problems == []
    assert back.mesh.sizes == plan.mesh.sizes
    assert rule_meaning(back) == rule_meaning(plan)
    assert back.experts == plan.experts
    assert back.fsdp == plan.fsdp


def test_accelerate_round_trip_through_parallelism_config(tmp_path):
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import TorchContextParallelConfig

    plan = plan_at(tmp_path, ACCELERATE_PLAN)
    exported, imported, back = round_trip(tmp_path, plan, "accelerate")
    assert exported.not_expressed == []
    kwargs = json.loads(exported.text)
    kwargs["cp_handler"] = TorchContextParallelConfig(**kwargs["cp_handler"])
    config = ParallelismConfig(**kwargs)
    assert config.total_size == 16
    assert config._sizes == {"dp_replicate": 2, "dp_shard": 2, "tp": 2, "cp": 2, "sp": 1}
    assert config.cp_handler.cp_comm_strategy == "allgather"
    assert imported.problems == []
    assert back.mesh.sizes == {**plan.mesh.sizes, "tp": 2} and back.rules == []
    # accelerate's own serialisation (to_json: its handlers and a copy of the sizes) reads back the same
    own = tmp_path / "own.json"
    own.write_text(json.dumps(config.to_json()))
    assert import_config(own).text.split("\n", 2)[2] == imported.text.split("\n", 2)[2]
    edited = config.to_json()
    edited["tp_size"] = 4
    own.write_text(json.dumps(edited))
    [problem] = import_config(own).problems
    assert problem.code == "TP143" and "disagrees with the size fields on tp" in problem.message


def test_torchtitan_round_trip_through_its_toml(tmp_path):
    plan = plan_at(tmp_path, TORCHTITAN_PLAN)
    exported, imported, back = round_trip(tmp_path, plan, "torchtitan")
    assert exported.not_expressed == []
    job = tomllib.loads(exported.text)
    assert set(job["parallelism"]) <= set(fw.TORCHTITAN_PARALLELISM_FIELDS)
    assert job["parallelism"]["data_parallel_shard_degree"] == -1  # torchtitan sizes the rest itself
    assert job["parallelism"]["expert_parallel_degree"] == 4 and job["parallelism"]["pipeline_parallel_degree"] == 2
    assert job["parallelism"]["fsdp_reshard_after_forward"] == "never"
    assert job["training"] == {"enable_cpu_offload": True, "mixed_precision_param": "bfloat16", "mixed_precision_reduce": "float32",
                               "global_batch_size": 64, "seq_len": 8192, "dtype": "bfloat16"}
    assert imported.problems == []
    assert back.mesh.sizes == plan.mesh.sizes
    assert back.fsdp == plan.fsdp and back.training == plan.training


def test_torchtitan_0_2_2_reads_the_exported_toml(tmp_path):
    """torchtitan 0.2.2 (CI's; 0.3 reads no TOML and does not import on torch 2.13) parses the
    exported job TOML with its own ConfigManager, which refuses a field it does not have."""
    if importlib.util.find_spec("torchtitan") is None:
        pytest.skip("torchtitan is not installed")
    from tpplan.models.titan import titan  # torchtitan without triton (its CUDA kernels)

    plan = plan_at(tmp_path, TORCHTITAN_PLAN)
    path = tmp_path / "job.toml"
    path.write_text(export_plan(plan, "torchtitan").text)
    job = titan("config").ConfigManager().parse_args(["--job.config_file", str(path)])
    parallelism = {name: getattr(job.parallelism, name) for name in fw.TORCHTITAN_SIZES.values()}
    assert parallelism == {"data_parallel_replicate_degree": 2, "data_parallel_shard_degree": -1, "context_parallel_degree": 2,
                           "tensor_parallel_degree": 2, "expert_parallel_degree": 4, "pipeline_parallel_degree": 2}
    assert job.parallelism.fsdp_reshard_after_forward == "never"
    assert (job.training.global_batch_size, job.training.seq_len, job.training.dtype) == (64, 8192, "bfloat16")
    assert (job.training.mixed_precision_param, job.training.mixed_precision_reduce, job.training.enable_cpu_offload) == ("bfloat16", "float32", True)


def _torchtitan_fields(cls_name: str) -> set[str] | None:
    """The annotated fields of torchtitan's config class `cls_name`, read from its source
    without importing it (torchtitan 0.3 does not import on torch 2.13)."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    for source in (root / "config" / "configs.py", root / "config" / "job_config.py"):
        if source.exists():
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.ClassDef) and node.name == cls_name:
                    return {item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    return None


def test_torchtitan_degree_names_are_torchtitans():
    """The installed torchtitan's source (0.3: ParallelismConfig; 0.2.2, which CI installs:
    Parallelism) names every degree field the export writes."""
    fields = _torchtitan_fields("ParallelismConfig") or _torchtitan_fields("Parallelism")
    if fields is None:
        pytest.skip("torchtitan is not installed")
    assert set(fw.TORCHTITAN_SIZES.values()) <= fields
    assert {"fsdp_reshard_after_forward", "context_parallel_load_balancer"} <= fields  # (enable_sequence_parallel: 0.3's, not 0.2.2's)
    assert set(fw.TORCHTITAN_SIZES.values()) <= set(fw.TORCHTITAN_PARALLELISM_FIELDS)


def test_every_transformers_string_export_writes_is_one_import_reads():
    from tpplan.interop.export import transformers_specs, transformers_style

    for name, spec in transformers_specs().items():
        written = transformers_style(spec)
        assert written in TRANSFORMERS_STYLES and transformers_specs()[written] == spec  # the first of the strings meaning it


@pytest.mark.parametrize("target, lost", [
    ("transformers", {"mesh.cp", "rules.model.norm", "context_parallel", "checkpointing", "training"}),
    ("accelerate", {"mesh.ep", "context_parallel.modules", "rules", "experts", "fsdp", "checkpointing", "training"}),
    ("torchtitan", {"rules", "experts", "context_parallel.modules", "context_parallel.rotate", "fsdp.units", "training.optimizer", "checkpointing"}),
])
def test_what_a_target_cannot_express_is_listed_at_its_key(tmp_path, target, lost):
    plan = plan_at(tmp_path, FULL)
    exported = export_plan(plan, target, world=32)
    assert {p.message.split(": not expressed")[0] for p in exported.not_expressed} == lost
    lines = FULL.splitlines()
    for problem in exported.not_expressed:  # each at its key's line
        key = problem.message.split(": not expressed")[0]
        last = key.split(".")[-1] if not key.startswith("rules.") else key.split(".", 1)[1]
        assert last.split(".")[0] in lines[problem.line - 1], (problem, lines[problem.line - 1])


def test_sequence_parallel_without_local_output_names_transformers_spelling(tmp_path):
    plan = plan_at(tmp_path, FULL)
    [problem] = [p for p in export_plan(plan, "transformers", world=32).not_expressed if "model.norm" in p.message]
    assert "'sequence_parallel' is {style: sequence_parallel, use_local_output: true}" in problem.message


def test_a_version_1_plan_exports_its_tp_axis(tmp_path):
    plan = plan_at(tmp_path, "version: 1\nmesh: {sizes: [2, 4]}\nrules:\n  layers.*.attn.{wq,wk}: colwise\n")
    for world in (None, 4):
        [problem] = export_plan(plan, "transformers", world=world).problems
        assert (problem.code, problem.line) == ("TP141", 2) and "pick it with --tp" in problem.message
    exported = export_plan(plan, "transformers", tp=4)
    assert json.loads(exported.text) == {
        "tp_size": 4, "fsdp_size": 1, "dp_replicate_size": 1, "pp_size": 1, "ep_size": 1,
        "tp_plan": {"layers.*.attn.wq": "colwise", "layers.*.attn.wk": "colwise"},
    }
    assert tomllib.loads(export_plan(plan, "torchtitan", tp=2).text)["parallelism"]["tensor_parallel_degree"] == 2
    [problem] = export_plan(plan, "accelerate", world=8, tp=4).problems  # a version 1 plan is its TP axis alone
    assert problem.code == "TP141" and "multiply to 4, not the world size 8" in problem.message


def test_sizes_the_target_needs_are_asked_for(tmp_path):
    plan = plan_at(tmp_path, FULL)
    [problem] = export_plan(plan, "accelerate").problems
    assert problem.code == "TP141" and (problem.line, problem.column) == (5, 3) and "--world" in problem.message
    [problem] = export_plan(plan, "transformers", world=12).problems
    assert problem.code == "TP141" and "12 / 8 is not a whole number" in problem.message
    assert export_plan(plan, "accelerate", world=32).config["dp_shard_size"] == 4


def test_globs_transformers_cannot_key_are_listed(tmp_path):
    plan = plan_at(tmp_path, "version: 2\nmesh: {tp: 2}\nrules:\n  '**.q_proj': colwise\n  layers.*.w[12]: colwise\n  layers.*.wo: rowwise\n")
    exported = export_plan(plan, "transformers")
    assert json.loads(exported.text)["tp_plan"] == {"layers.*.wo": "rowwise"}
    assert [(p.code, p.line) for p in exported.not_expressed] == [("TP140", 4), ("TP140", 5)]


# -- the command line ------------------------------------------------------------------------------


def test_cli_export_prints_config_and_lists_the_rest_on_stderr(tmp_path):
    path = tmp_path / "plan.yaml"
    path.write_text(FULL)
    result = runner.invoke(app, ["export", "--to", "transformers", "--world", "32", str(path)])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["fsdp_size"] == 4
    assert f"{path}:6:3: TP140 mesh.cp: not expressed in transformers" in result.stderr
    strict = runner.invoke(app, ["export", "--to", "transformers", "--world", "32", "--strict", str(path)])
    assert strict.exit_code == 1
    as_json = json.loads(runner.invoke(app, ["export", "--to", "accelerate", "--world", "32", "--format", "json", str(path)]).stdout)
    assert as_json["ok"] and as_json["config"]["cp_handler"] == {"cp_comm_strategy": "alltoall"}
    assert {p["code"] for p in as_json["not_expressed"]} == {"TP140"} and as_json["problems"] == []


def test_cli_import_config_writes_a_plan_validate_accepts(tmp_path):
    source = tmp_path / "plan.yaml"
    source.write_text(TORCHTITAN_PLAN)
    config = tmp_path / "job.toml"
    assert runner.invoke(app, ["export", "--to", "torchtitan", str(source), "-o", str(config)]).exit_code == 0
    out = tmp_path / "back.yaml"
    result = runner.invoke(app, ["import-config", str(config), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("# yaml-language-server: $schema=")
    validated = runner.invoke(app, ["validate", "--world", "32", str(out)])
    assert validated.exit_code == 0, validated.output


def test_import_lists_what_no_plan_key_says(tmp_path):
    path = tmp_path / "dist.json"
    path.write_text(json.dumps({"tp_size": 2, "tp_plan": {"model.layers.*.mlp.gate_up_proj": "packed_colwise", "lm_head": "colwise_rep"},
                                "ep_size": 2, "fsdp_size": 2, "ep_plan": {"model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm"}}, indent=1))
    imported = import_config(path)
    assert [p.code for p in imported.problems] == ["TP144", "TP144", "TP144"]
    packed = imported.problems[0]
    assert packed.line == 4 and "packed_colwise" in packed.message and "strided shard" in packed.message
    assert "lm_head: {style: colwise, output_layouts: replicate}" in imported.text
    accelerate = tmp_path / "acc.json"
    accelerate.write_text('{"dp_shard_size": 2, "sp_size": 2, "sp_backend": "deepspeed"}')
    assert [p.message.split(":")[0] for p in import_config(accelerate).problems] == ["sp_size"]


@pytest.mark.parametrize("name, text, args, code, at, words", [
    ("bad.json", '{\n  "tp_size": "2",\n  "fsdp_size": 2\n}\n', [], "TP143", (2, 3), "a size is a whole number >= 1, not '2'"),
    ("zero.json", '{"dp_shard_size": 0}', [], "TP143", (1, 2), "not 0"),
    ("typo.json", '{"fsdp_size": 2, "tp_sizes": 2}', [], "TP143", (1, 18), "did you mean 'tp_size'"),
    ("both.json", '{"fsdp_size": 2, "cp_size": 2}', [], "TP142", (1, 1), "name it with --from"),
    ("broken.json", '{"tp_size": 2,,}', [], "TP142", (1, 15), "not valid JSON"),
    ("notes.txt", "just words\n", [], "TP142", (1, 6), "not a JSON object, nor TOML"),
    ("job.toml", "[training]\nseq_len = 4096\n", [], "TP142", (1, 1), "[parallelism] table"),
    ("dtype.toml", "[parallelism]\ntensor_parallel_degree = 2\n[training]\ndtype = \"float16\"\n", [], "TP143", (4, 1), "'bfloat16', 'float32'"),
    ("ep.toml", "[parallelism]\ndata_parallel_shard_degree = 2\ntensor_parallel_degree = 2\nexpert_parallel_degree = 3\n", [],
     "TP122", (4, 1), "mesh.ep: 3 does not divide"),
    ("missing.json", None, [], "TP001", (1, 1), "cannot read the config"),
    ("latin1.json", '{\n  "tp_size": 2, "name": "caf\xe9"\n}\n'.encode("latin-1"), [], "TP001", (2, 29), "the config is not UTF-8 text (byte 0xe9)"),
    ("weights.json", b"PK\x03\x04\0\0", [], "TP001", (1, 1), "this is a binary file, not a config file"),
])
def test_bad_input_is_a_located_code_without_a_traceback(tmp_path, name, text, args, code, at, words):
    path = tmp_path / name
    if text is not None:
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    result = runner.invoke(app, ["import-config", str(path), "--format", "json", *args])
    assert result.exit_code == (2 if code in ("TP001", "TP142") else 1), result.output
    assert "Traceback" not in result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    problems = json.loads(result.stdout)["problems"]
    [problem] = [p for p in problems if p["severity"] == "error"]
    assert (problem["code"], (problem["line"], problem["column"])) == (code, at), problem
    assert words in problem["message"]


def test_unknown_target_is_a_usage_error():
    result = runner.invoke(app, ["export", "--to", "megatron", "plan.yaml"])
    assert result.exit_code == 2 and "'megatron' is not one of" in result.output
    result = runner.invoke(app, ["import-config", "--from", "deepspeed", "x.json"])
    assert result.exit_code == 2


def test_tp_given_where_the_plan_fixes_another_degree_is_refused(tmp_path):
    plan = plan_at(tmp_path, "version: 2\nmesh: {dp_shard: -1}\nrules: {}\n")  # tp left out with dp_shard -1: tp 1
    [problem] = export_plan(plan, "torchtitan", tp=4).problems
    assert problem.code == "TP141" and "TP degree is 1" in problem.message
    open_tp = plan_at(tmp_path, "version: 1\nrules: {}\n", "v1.yaml")
    assert export_plan(open_tp, "accelerate", tp=4).config["tp_size"] == 4
    assert export_plan(open_tp, "accelerate", world=8).config["tp_size"] == 8
    [problem] = export_plan(open_tp, "accelerate", world=8, tp=4).problems
    assert problem.code == "TP141"


def test_experts_transformers_cannot_say_are_listed(tmp_path):
    plan = plan_at(tmp_path, "version: 2\nmesh: {tp: 2, ep: 2}\nrules: {}\nexperts:\n"
                             "  a.*.experts: expert_tp\n  b.*.experts: {style: expert_parallel, dispatch: all_to_all}\n"
                             "  c.*.experts: {style: expert_parallel, dispatch: all_reduce}\n")
    exported = export_plan(plan, "transformers")
    config = json.loads(exported.text)
    assert config["ep_plan"] == {"b.*.experts": "ep_dispatch_experts", "c.*.experts": "ep_dispatch_experts"}
    assert "ep_implementation" not in config
    assert sorted((p.line, p.message.split(":")[0]) for p in exported.not_expressed) == [(4, "experts"), (5, "experts.a.*.experts")]


def test_a_plan_check_on_an_imported_training_key_is_located_in_the_config(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[parallelism]\ndata_parallel_shard_degree = 4\ncontext_parallel_degree = 2\n\n[training]\nglobal_batch_size = 6\nseq_len = 102\n")
    problems = {p.code: p for p in import_config(path).problems}
    assert (problems["TP123"].file, problems["TP123"].line) == (str(path), 6)
    assert (problems["TP124"].line, problems["TP124"].column) == (7, 1) and "(from training.seq_len)" in problems["TP124"].message


def test_transformers_takes_the_exported_plans_for_its_own_model(tmp_path):
    """transformers resolves the exported tp_plan and fsdp_plan against a Llama it builds (on
    meta): every key names its modules (it refuses a key that matches nothing), every style is
    one of its own."""
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    plan = plan_at(tmp_path, "version: 2\nmesh: {dp_shard: 2, tp: 2}\nrules:\n"
                             "  model.layers.*.self_attn.{q_proj,k_proj,v_proj}: colwise\n  model.layers.*.self_attn.o_proj: rowwise\n"
                             "  model.layers.*.mlp.{gate_proj,up_proj}: colwise\n  model.layers.*.mlp.down_proj: rowwise\n"
                             "  model.embed_tokens: {style: rowwise, input_layouts: replicate, output_layouts: replicate}\n"
                             "  lm_head: {style: colwise, output_layouts: replicate}\n"
                             "fsdp: {units: [model.layers.*, model.embed_tokens, \"\"]}\n")
    exported = export_plan(plan, "transformers")
    assert exported.problems == []
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tp_plan, _, fsdp_plan = model._resolve_parallel_plans(DistributedConfig(**json.loads(exported.text)))
    assert tp_plan["model.layers.1.self_attn.k_proj"] == "colwise" and tp_plan["model.embed_tokens"] == "embedding_rowwise"
    assert tp_plan["lm_head"] == "colwise_rep" and tp_plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert fsdp_plan["model.layers.1"] == "free_full_weight" and fsdp_plan["model.embed_tokens"] == "free_full_weight"


def test_default_fsdp_units_are_torchtitans_and_listed_for_transformers(tmp_path):
    """Without fsdp.units tpplan wraps each block, then the root: torchtitan's own choice;
    transformers would use the model's base_model_fsdp_plan instead, so it is listed."""
    plan = plan_at(tmp_path, "version: 2\nmesh: {dp_shard: 2, tp: 2}\nrules: {}\nfsdp: {offload: true}\n")
    assert export_plan(plan, "torchtitan").not_expressed == []
    [problem] = export_plan(plan, "transformers").not_expressed
    assert problem.message.startswith("fsdp: not expressed in transformers: tpplan's default fully_shard units") and problem.line == 4
    bare = plan_at(tmp_path, "version: 2\nmesh: {dp_shard: 2, tp: 2}\nrules: {}\n", "bare.yaml")
    [problem] = export_plan(bare, "transformers").not_expressed
    assert problem.message.startswith("mesh.dp_shard: not expressed")
