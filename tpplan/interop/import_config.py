"""Another framework's parallelism config read back as a version 2 plan (SPEC §7,
Interop): transformers' `DistributedConfig` JSON, accelerate's `ParallelismConfig`
JSON, or torchtitan's job TOML (its `[parallelism]` and `[training]` tables).

The format is told by `source_format`, else by the file: a JSON object by the
fields only one of the two JSON configs has, TOML by its `[parallelism]` table.
Every problem is located in the input file: TP001 unreadable, TP142 no known
format, TP143 a field of bad type or value (or one the framework does not
have), TP144 a field a plan does not hold (left out, with why). The plan
written is checked by the loader as `tpplan validate` would. No torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from typing import Any, Callable

from ..core.aliases import TRANSFORMERS_NO_RULE, TRANSFORMERS_STYLES, TRANSFORMERS_WITHOUT_EQUIVALENT
from ..core.loader import load_plan, read_text
from ..core.problems import PlanError, Problem, error, warning
from ..core.schema_file import schema_comment
from ..core.yamltext import group_siblings, plan_yaml
from . import frameworks as fw

UNREADABLE, NO_FORMAT, BAD_FIELD, LEFT_OUT = "TP001", "TP142", "TP143", "TP144"


@dataclass
class Imported:
    """`text` the plan (empty where an error stopped it); `problems` the input's (TP001,
    TP142-TP144) and, where the plan was written, the loader's on it."""

    format: str | None = None
    text: str = ""
    problems: list[Problem] = field(default_factory=list)


class _Input:
    """One config file's data, where each key is, and the problems found in it."""

    def __init__(self, file: str, data: dict, locate: Callable[[tuple[str, ...]], tuple[int, int]]):
        self.file, self.data, self.locate = file, data, locate
        self.problems: list[Problem] = []

    def bad(self, key: tuple[str, ...], message: str) -> None:
        self.problems.append(error(BAD_FIELD, f"{'.'.join(key)}: {message}", self.file, *self.locate(key)))

    def left_out(self, key: tuple[str, ...], message: str) -> None:
        self.problems.append(warning(LEFT_OUT, f"{'.'.join(key)}: left out of the plan: {message}", self.file, *self.locate(key)))

    # typed reads: the value, or None (and a TP143) where it is of the wrong kind
    def size(self, table: dict, key: tuple[str, ...], *, rest: bool = False) -> int | None:
        value = table.get(key[-1])
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value == 0 or value < (-1 if rest else 1):
            self.bad(key, f"a size is a whole number >= 1{' (or -1 for the rest of the world)' if rest else ''}, not {value!r}")
            return None
        return value

    def choice(self, table: dict, key: tuple[str, ...], choices: tuple) -> Any:
        value = table.get(key[-1])
        if value is not None and value not in choices:
            self.bad(key, f"one of {', '.join(map(repr, choices))}, not {value!r}")
            return None
        return value

    def flag(self, table: dict, key: tuple[str, ...]) -> bool | None:
        value = table.get(key[-1])
        if value is not None and not isinstance(value, bool):
            self.bad(key, f"true or false, not {value!r}")
            return None
        return value

    def plan(self, table: dict, key: tuple[str, ...]) -> dict[str, str] | None:
        value = table.get(key[-1])
        if value is None:
            return None
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            self.bad(key, f"a mapping of module-name globs to style strings, not {value!r}")
            return None
        return value

    def known(self, table: dict, path: tuple[str, ...], fields: tuple[str, ...], framework: str) -> None:
        for key in table:
            if key not in fields:
                near = get_close_matches(str(key), fields, n=1)
                hint = f": did you mean '{near[0]}'?" if near else ""
                self.bad((*path, str(key)), f"{framework}'s config has no field {key!r}{hint}")


def import_config(path: str | os.PathLike, source_format: str | None = None, *, output: str | os.PathLike | None = None) -> Imported:
    """The config at `path` as a version 2 plan (`output`: where the plan will be written,
    for the `$schema` pointer and the file named in the loader's problems)."""
    file = str(path)
    try:
        text = read_text(path, UNREADABLE, "config", "a config file")
        kind, source = _parse(text, file, source_format)
    except PlanError as exc:
        return Imported(problems=exc.problems)
    top, rules, sections = _BUILDERS[kind](source)
    imported = Imported(kind, problems=source.problems)
    if any(p.severity == "error" for p in source.problems):
        return imported
    header = [schema_comment(output), f"# imported from {os.path.basename(file)} ({kind}) by tpplan import-config"]
    imported.text = plan_yaml({"version": 2, **top}, group_siblings(rules), after=sections, header=header)
    try:
        load_plan(text=imported.text, file=str(output) if output is not None else "<imported plan>")
    except PlanError as exc:  # the sizes break a plan's check (mesh.ep not dividing, say): the config's own mistake
        imported.problems += [_at_origin(problem, imported.text, source, kind) for problem in exc.problems]
    return imported


def _at_origin(problem: Problem, text: str, source: _Input, kind: str) -> Problem:
    """A problem of the written plan located at the config field its key came from (a mesh
    axis: that axis's size field; torchtitan's training keys: its [training] fields), where
    there is one; else left in the plan."""
    lines = text.splitlines()
    if not 0 < problem.line <= len(lines) or not lines[problem.line - 1].startswith("  "):
        return problem
    parent = next((line.split(":")[0] for line in reversed(lines[: problem.line - 1]) if line[:1].isalpha()), None)
    name = lines[problem.line - 1].strip().split(":")[0]
    key = _ORIGINS[kind].get((parent, name))
    if key is None:
        return problem
    line, column = source.locate(key)
    return replace(problem, message=f"{problem.message} (from {'.'.join(key)})", file=source.file, line=line, column=column)


# (plan section, key) -> the config field it is read from
_ORIGINS: dict[str, dict[tuple[str | None, str], tuple[str, ...]]] = {
    "transformers": {("mesh", axis): (field,) for axis, field in fw.TRANSFORMERS_SIZES.items()},
    "accelerate": {("mesh", axis): (field,) for axis, field in fw.ACCELERATE_SIZES.items()},
    "torchtitan": {**{("mesh", axis): ("parallelism", field) for axis, field in fw.TORCHTITAN_SIZES.items()},
                   **{("training", key): ("training", field) for key, field in fw.TORCHTITAN_TRAINING.items()}},
}


# -- reading -----------------------------------------------------------------------------------


_JSON_FORMATS = ("transformers", "accelerate")


def _parse(text: str, file: str, source_format: str | None) -> tuple[str, _Input]:
    """(format, its data): the named format, else the one the text is."""
    looks_json = text.lstrip().startswith("{") or file.endswith(".json")
    if source_format in _JSON_FORMATS or (source_format is None and looks_json):
        data = _json(text, file)
        kind = source_format or _json_kind(data, file)
        return kind, _Input(file, data, _json_locator(text, file))
    if source_format not in (None, "torchtitan"):
        raise ValueError(f"unknown config format {source_format!r}: one of {', '.join(fw.TARGETS)}")
    data = _toml(text, file, named=source_format is not None)
    return "torchtitan", _Input(file, data, _toml_locator(text))


def _json(text: str, file: str) -> dict:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError([error(NO_FORMAT, f"not valid JSON: {exc.msg}", file, exc.lineno, exc.colno)]) from None
    if not isinstance(data, dict):
        raise PlanError([error(NO_FORMAT, f"a config is a JSON object, not a {type(data).__name__}", file)])
    return data


def _json_kind(data: dict, file: str) -> str:
    shared = {"tp_size", "dp_replicate_size"}
    transformers = set(data) & (set(fw.TRANSFORMERS_FIELDS) - shared)
    accelerate = set(data) & (set(fw.ACCELERATE_FIELDS) - shared)
    if transformers and not accelerate:
        return "transformers"
    if accelerate and not transformers:
        return "accelerate"
    why = (f"it has fields of both ({', '.join(sorted(transformers))}; {', '.join(sorted(accelerate))})" if transformers
           else "it has none of the fields only one of them has (fsdp_size, tp_plan, ...; dp_shard_size, cp_size, ...)")
    raise PlanError([error(NO_FORMAT, f"cannot tell transformers' DistributedConfig from accelerate's ParallelismConfig: {why}; "
                                      "name it with --from", file)])


def _json_locator(text: str, file: str) -> Callable[[tuple[str, ...]], tuple[int, int]]:
    """JSON is YAML: the plan's own position-keeping parser locates its keys."""
    from ..core.yamlsource import parse_yaml

    try:
        _, source = parse_yaml(text, file)
    except PlanError:  # JSON that PyYAML reads otherwise (a tab, say): problems at the top
        return lambda key: (1, 1)
    return lambda key: source.locate(key, key=True)


def _toml(text: str, file: str, *, named: bool) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser, as the tomli package
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise PlanError([error(NO_FORMAT, "reading TOML needs Python 3.11 or the tomli package (pip install tomli)", file)]) from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        at = re.search(r"line (\d+), column (\d+)", str(exc))
        what = "not valid TOML" if named or text.lstrip().startswith("[") else "not a JSON object, nor TOML"
        raise PlanError([error(NO_FORMAT, f"{what}: {str(exc).split(' (at')[0]}", file,
                               *((int(at[1]), int(at[2])) if at else (1, 1)))]) from None
    if not isinstance(data.get("parallelism"), dict):
        raise PlanError([error(NO_FORMAT, "no known config: a torchtitan job config has a [parallelism] table, "
                                          "transformers' DistributedConfig and accelerate's ParallelismConfig are JSON objects", file)])
    return data


def _toml_locator(text: str) -> Callable[[tuple[str, ...]], tuple[int, int]]:
    """(table, key) -> the line of `key = ` inside `[table]` (TOML's parser keeps no positions)."""
    lines = text.splitlines()

    def locate(key: tuple[str, ...]) -> tuple[int, int]:
        table, at_table = None, None  # the key's line, else its table's header, else the top
        for number, line in enumerate(lines, 1):
            header = re.match(r"\s*\[([^\[\]]+)\]\s*(#.*)?$", line)
            if header:
                table = header[1].strip()
                if key[:1] == (table,):
                    at_table = (number, line.index("[") + 1)
            elif len(key) > 1 and table == key[0]:
                match = re.match(rf"\s*({re.escape(key[1])})\s*=", line)
                if match:
                    return number, match.start(1) + 1
        return at_table or (1, 1)

    return locate


# -- building the plan ---------------------------------------------------------------------------

Built = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]  # (top-level keys, rules, sections after rules)


def _mesh(sizes: dict[str, int | None]) -> dict[str, int]:
    """Every axis written, in the plan's order (tp left out only where it takes the rest)."""
    return {axis: size for axis, size in sizes.items() if size is not None}


def _transformers(source: _Input) -> Built:
    data = source.data
    source.known(data, (), fw.TRANSFORMERS_FIELDS, "transformers' DistributedConfig")
    sizes = {field: source.size(data, (field,)) for field in fw.TRANSFORMERS_SIZES.values()}
    tp_plan = data.get("tp_plan")
    if tp_plan == "auto":
        source.left_out(("tp_plan",), "'auto' is the model's own base_model_tp_plan: `tpplan import-hf MODEL` imports it as rules")
        tp_plan = None
    else:
        tp_plan = source.plan(data, ("tp_plan",))
    if source.flag(data, ("enable_sequence_parallel",)):
        source.left_out(("enable_sequence_parallel",), "reserved in transformers (not wired up): sequence_parallel rules say it in a plan")
    if source.flag(data, ("enable_expert_parallel",)) and sizes["ep_size"] is None:
        sizes["ep_size"] = sizes["tp_size"] or 1  # transformers' deprecated spelling of ep_size = tp_size
    implementation = source.choice(data, ("ep_implementation",), (*fw.TRANSFORMERS_EP_IMPLEMENTATIONS, "deepgemm_megamoe"))
    # tp_size unset with a tp_plan: transformers derives it from WORLD_SIZE, as a plan's unset tp takes the rest
    tp = sizes["tp_size"] if sizes["tp_size"] is not None or tp_plan is not None else 1
    mesh = _mesh({"pp": sizes["pp_size"] or 1, "dp_replicate": sizes["dp_replicate_size"] or 1,
                  "dp_shard": sizes["fsdp_size"] or 1, "cp": 1, "tp": tp, "ep": sizes["ep_size"] or 1})
    rules: dict[str, Any] = {}
    for key, style in (tp_plan or {}).items():
        if style in TRANSFORMERS_STYLES:
            rules[key] = TRANSFORMERS_STYLES[style]
        else:
            source.left_out(("tp_plan", key), f"{style}: {_transformers_reason(style)}")
    sections: dict[str, Any] = {}
    experts = _transformers_experts(source, implementation)
    if experts:
        sections["experts"] = experts
    fsdp = _transformers_fsdp(source, mesh)
    if fsdp:
        sections["fsdp"] = fsdp
    return {"mesh": mesh}, rules, sections


def _transformers_reason(style: str) -> str:
    if style in TRANSFORMERS_NO_RULE:
        return f"{TRANSFORMERS_NO_RULE[style][0]}: no rule needed"
    return TRANSFORMERS_WITHOUT_EQUIVALENT.get(style, "transformers has no such style")


def _transformers_experts(source: _Input, implementation: str | None) -> dict[str, Any]:
    ep_plan = source.plan(source.data, ("ep_plan",)) or {}
    dispatch = fw.TRANSFORMERS_EP_IMPLEMENTATIONS.get(implementation or "auto")
    experts = {}
    for key, style in ep_plan.items():
        if style != fw.TRANSFORMERS_EP_DISPATCH:
            source.left_out(("ep_plan", key), f"{style}: {_transformers_reason(style)}" if style != "grouped_gemm"
                            else "grouped_gemm: a parameter entry of an experts module, which expert_parallel lays out itself")
        elif dispatch is None:
            source.left_out(("ep_implementation",), f"{implementation}: a kernel's own exchange, which no tpplan dispatch is")
        else:
            experts[key] = {"style": "expert_parallel", "dispatch": dispatch}
    return experts


def _transformers_fsdp(source: _Input, mesh: dict[str, int]) -> dict[str, Any]:
    data = source.data
    fsdp_plan = source.plan(data, ("fsdp_plan",))
    offload = source.flag(data, ("fsdp_cpu_offload",))
    mixed = source.flag(data, ("fsdp_mixed_precision",))
    fsdp: dict[str, Any] = {}
    if fsdp_plan:
        styles = {value: key for key, value in fw.TRANSFORMERS_FSDP_STYLES.items()}
        reshards = set()
        for key, style in fsdp_plan.items():
            if style not in styles:
                source.bad(("fsdp_plan", key), f"one of {', '.join(map(repr, styles))}, not {style!r}")
            else:
                reshards.add(styles[style])
        fsdp["units"] = [*fsdp_plan, ""]
        if len(reshards) > 1:
            source.left_out(("fsdp_plan",), "units that free and units that keep their full weight: a plan's reshard_after_forward is one "
                                            "for every unit (written true)")
        fsdp["reshard_after_forward"] = reshards.pop() if len(reshards) == 1 else True
    elif mesh["dp_replicate"] * mesh["dp_shard"] > 1:
        source.left_out(("fsdp_size",), "no fsdp_plan: transformers shards the model's own base_model_fsdp_plan units, "
                                        "which this config does not name (the plan's default: each block of the largest "
                                        "ModuleList, then the root)")
    if mixed:
        fsdp["mixed_precision"] = dict(fw.TRANSFORMERS_MIXED_PRECISION)
    if offload:
        fsdp["offload"] = True
    return fsdp


def _accelerate(source: _Input) -> Built:
    data = source.data
    source.known(data, (), (*fw.ACCELERATE_FIELDS, fw.ACCELERATE_DERIVED), "accelerate's ParallelismConfig")
    sizes = {axis: source.size(data, (field,)) or 1 for axis, field in fw.ACCELERATE_SIZES.items()}
    derived = data.get(fw.ACCELERATE_DERIVED)
    if derived is not None:  # to_json()'s copy of the sizes: a hand edit of one and not the other is a mistake
        differ = sorted(axis for axis in sizes if isinstance(derived, dict) and axis in derived and derived[axis] != sizes[axis])
        if not isinstance(derived, dict) or differ:
            source.bad((fw.ACCELERATE_DERIVED,), f"to_json()'s copy of the sizes disagrees with the size fields"
                                                  f"{' on ' + ', '.join(differ) if differ else ''}: fix one, or delete {fw.ACCELERATE_DERIVED}")
    async_tp = data.get("tp_handler")
    if async_tp is not None:
        if not isinstance(async_tp, dict):
            source.bad(("tp_handler",), f"TorchTensorParallelConfig's fields as a mapping ({{enable_async_tp: ...}}), not {async_tp!r}")
        else:
            source.known(async_tp, ("tp_handler",), ("enable_async_tp",), "accelerate's TorchTensorParallelConfig")
            if source.flag(async_tp, ("tp_handler", "enable_async_tp")):
                source.left_out(("tp_handler", "enable_async_tp"), "async TP is a compile-time option of the run, which no plan key says")
    source.choice(data, ("cp_backend",), (fw.ACCELERATE_CP_BACKEND,))
    handler = data.get("cp_handler")
    if handler is not None:
        if not isinstance(handler, dict):
            source.bad(("cp_handler",), f"TorchContextParallelConfig's fields as a mapping ({{cp_comm_strategy: ...}}), not {handler!r}")
        else:
            source.known(handler, ("cp_handler",), ("cp_comm_strategy",), "accelerate's TorchContextParallelConfig")
            strategy = source.choice(handler, ("cp_handler", "cp_comm_strategy"), fw.ACCELERATE_CP_STRATEGIES)
            if strategy not in (None, fw.ACCELERATE_CP_STRATEGIES[0]):
                source.left_out(("cp_handler", "cp_comm_strategy"), f"{strategy}: a plan's rotate lives in context_parallel, which names "
                                                                    "the attention modules this config does not: add the section with rotate: "
                                                                    f"{strategy}")
    sp = source.size(data, ("sp_size",))
    if sp is not None and sp > 1:
        source.left_out(("sp_size",), f"{sp}: DeepSpeed's Ulysses sequence parallelism has no tpplan axis (context parallelism is cp)")
    source.choice(data, ("sp_backend",), ("deepspeed",))
    mesh = _mesh({"pp": 1, "dp_replicate": sizes["dp_replicate"], "dp_shard": sizes["dp_shard"], "cp": sizes["cp"], "tp": sizes["tp"], "ep": 1})
    return {"mesh": mesh}, {}, {}


def _torchtitan(source: _Input) -> Built:
    parallelism, training = source.data["parallelism"], source.data.get("training") or {}
    fields = (*fw.TORCHTITAN_PARALLELISM_FIELDS, *fw.TORCHTITAN_022_PARALLELISM_FIELDS)
    source.known(parallelism, ("parallelism",), fields, "torchtitan's [parallelism] (0.3, or 0.2.2)")
    sizes: dict[str, int | None] = {}
    for axis, name in fw.TORCHTITAN_SIZES.items():
        rest = axis == fw.TORCHTITAN_REST_AXIS
        value = source.size(parallelism, ("parallelism", name), rest=rest)
        sizes[axis] = value if value is not None else (-1 if rest and name not in parallelism else 1)
    mesh = _mesh({axis: sizes[axis] for axis in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")})
    used = {*fw.TORCHTITAN_SIZES.values(), "fsdp_reshard_after_forward", "context_parallel_load_balancer", "enable_sequence_parallel"}
    for name in parallelism:
        if name not in used and name in fields:
            source.left_out(("parallelism", name), f"{parallelism[name]!r}: no plan key says it (pipeline schedules: SPEC §8)")
    if source.flag(parallelism, ("parallelism", "enable_sequence_parallel")) and mesh["tp"] != 1:
        source.left_out(("parallelism", "enable_sequence_parallel"), "torchtitan's sequence parallelism is in its model code: the plan's rules "
                                                                     "say which modules (tpplan init, or its sequence_parallel rules)")
    balancer = source.choice(parallelism, ("parallelism", "context_parallel_load_balancer"), ("headtail", "ptrr"))
    if balancer == "ptrr":
        source.left_out(("parallelism", "context_parallel_load_balancer"), "ptrr (FlexAttention's) has no tpplan load_balance")
    sections: dict[str, Any] = {}
    fsdp: dict[str, Any] = {}
    policy = source.choice(parallelism, ("parallelism", "fsdp_reshard_after_forward"), ("default", *fw.TORCHTITAN_RESHARD.values()))
    if policy in fw.TORCHTITAN_RESHARD.values():
        fsdp["reshard_after_forward"] = next(key for key, value in fw.TORCHTITAN_RESHARD.items() if value == policy)
    spellings = {value: key for key, value in fw.TORCHTITAN_DTYPES.items()}
    precision = {}
    for key, name in fw.TORCHTITAN_MIXED_PRECISION.items():
        value = source.choice(training, ("training", name), tuple(fw.TORCHTITAN_DTYPES[c] for c in fw.TORCHTITAN_DTYPE_CHOICES[name]))
        if value is not None:
            precision[key] = spellings[value]
    if precision:
        fsdp["mixed_precision"] = precision
    if source.flag(training, ("training", fw.TORCHTITAN_OFFLOAD)):
        fsdp["offload"] = True
    if fsdp:
        sections["fsdp"] = fsdp
    plan_training: dict[str, Any] = {}
    for key, name in fw.TORCHTITAN_TRAINING.items():
        if key == "dtype":
            value = source.choice(training, ("training", name), tuple(fw.TORCHTITAN_DTYPES[c] for c in fw.TORCHTITAN_DTYPE_CHOICES[name]))
            value = spellings.get(value) if value is not None else None
        else:
            value = source.size(training, ("training", name), rest=key == "global_batch")
            value = None if value == -1 else value  # global_batch_size -1: local_batch_size times the dp degree
        if value is not None:
            plan_training[key] = value
    if plan_training:
        sections["training"] = plan_training
    return {"mesh": mesh}, {}, sections


_BUILDERS: dict[str, Callable[[_Input], Built]] = {"transformers": _transformers, "accelerate": _accelerate, "torchtitan": _torchtitan}
