"""Every problem code tpplan reports, documented in one catalog: the model-aware
lint rules (TP3xx, from the registry) and the codes of the loader, resolution and
runtime, which are checks too but not lint rules (they run before or after it).

`tpplan rules` and docs/rules.md read this catalog; a test checks that every code
the package can report has an entry.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from .rules import RULES

# code -> (name, what it means and what to do[, severity]). Errors unless a severity is given;
# TP001 and TP130 exit 2 (unreadable input, a usage error).
_PLAN_CODES = {
    "TP001": ("unreadable-plan", """
        The plan file cannot be read: it does not exist, is not readable, is a
        binary file, or is not UTF-8 text. `validate` exits 2 (unreadable input)
        rather than 1.
    """),
    "TP010": ("yaml-syntax", """
        The plan is not valid YAML. The position is the mistake's, which is not
        always where the parser stopped (the message says where it did): an
        unclosed `{`, `[` or quote at its opening, a key written without its
        ':' at that key, a ',' missing at the end of a line inside `{...}` or
        `[...]` at that line's end.
    """),
    "TP011": ("duplicate-key", """
        A mapping has the same key twice. PyYAML would silently keep the last one,
        so a rule written twice loses its first version without a word: merge or
        remove one.
    """),
    "TP012": ("yaml-tag", """
        A YAML tag (`!!python/object`, a custom `!tag`), a `<<` merge key, or a
        key that is not a plain scalar. Plans hold only plain strings, numbers,
        booleans, null, lists and mappings: loading a plan never constructs
        objects or runs code.
    """),
    "TP013": ("empty-plan", "The plan is empty, or its top level is not a mapping with `version` and `rules`."),
    "TP014": ("document-too-large", "The document expands (through aliases) to too many nodes, or is nested too deeply."),
    "TP100": ("unknown-key", """
        A key the plan format does not have, at the top level, in `mesh:` or in a
        rule's options; the message suggests the closest valid key and lists the
        options of the rule's style.
    """),
    "TP101": ("bad-value", """
        A value of the wrong type: a string where a number is expected (`"1"`),
        `yes` for a boolean, a list where a style is expected, a null rule in a
        plan without `extends:`.
    """),
    "TP102": ("missing-key", "A required key is missing: `version`, `rules`, or a rule mapping's `style:`."),
    "TP103": ("unknown-style", "A rule names a style that does not exist; the message suggests the closest one."),
    "TP104": ("bad-placement", """
        A layout is not a placement: use `replicate`, `shard(DIM)` (DIM may be
        negative), `partial` or `partial(sum|avg|max|min)`.
    """),
    "TP105": ("cross-field", """
        A rule's options contradict each other, as torch's constructors would
        assert at run time (`input_layouts` without `desired_input_layouts`,
        lists of different lengths, a keyword layout without its desired layout)
        or as tpplan's styles declare (colwise `packed` with `heads` or
        `output_layouts`, colwise `heads` with an output layout other than
        shard(-1), expert_parallel `dispatch: all_to_all` with a layout other
        than shard(0)). Reported at the offending option; the JSON Schema states
        the same rules (both read each style's one declaration).
    """),
    "TP106": ("plan-version", "The plan's `version` is not 1 or 2, the versions this tpplan reads (an integer: not `2.0`, not `true`)."),
    "TP107": ("extends-target", """
        The plan named by `extends:` cannot be used: the path (relative to the
        extending plan's directory) cannot be read, is empty, or leads back to a
        plan already being extended (a cycle). Problems inside the parent plan
        are reported in the parent's file, with their own codes.
    """),
    "TP108": ("null-deletes-nothing", """
        A rule is null, which deletes the inherited rule of the same key, but the
        parent plan has no rule with that key (a typo, or a rule the parent
        names differently); the message suggests the closest inherited key.
    """),
    "TP109": ("pipeline-reserved", """
        No longer raised: pipelines (SPEC §8) are read. A `pipeline:` section
        was refused by earlier tpplans; the code stays retired so that it
        never names anything else.
    """),
    "TP110": ("glob-syntax", "A rule key is not a valid module-path glob (unbalanced `[` or `{`, `**` inside a segment, an empty segment)."),
    "TP120": ("mesh-rest-axes", """
        More than one axis of a version 2 plan's `mesh:` is `-1`. `-1` means
        "world / (product of the other axes)", which only one axis can take:
        give the others their sizes. (An axis size of 0, or `-1` on `ep`, whose
        ranks are borrowed from dp_shard·cp·tp, is TP101.)
    """),
    "TP121": ("mesh-world-size", """
        With `validate --world N`: the axes pp·dp_replicate·dp_shard·cp·tp of a
        version 2 plan do not multiply to N, or the `-1` axis does not resolve
        to a whole number (N is not divisible by the product of the others).
        The message shows the product, e.g. `mesh: dp_replicate 2 × dp_shard 3
        × tp 2 = 12, not the world size 8`. With a list of TP degrees, one of
        them must fit. `tp` left out takes the rest when no axis is `-1`.
    """),
    "TP122": ("expert-degree", """
        `mesh.ep` does not divide dp_shard·cp·tp. Expert parallelism borrows
        its ranks from these axes (the expert FSDP degree is dp_shard·cp·tp /
        ep), so a degree that does not divide them leaves a truncated or empty
        group: pick a divisor (the message lists them), or raise dp_shard.
    """),
    "TP123": ("global-batch-split", """
        `training.global_batch` is not divisible by dp_replicate·dp_shard, the
        data-parallel ranks it is split over: each rank's batch would not be a
        whole number of sequences. The message gives the nearest multiples.
    """),
    "TP124": ("sequence-split", """
        `training.seq` is not divisible by `cp` (by 2·cp with
        `context_parallel.load_balance: headtail`, the default: each cp rank
        holds a head and a tail chunk of the sequence).
    """),
    "TP125": ("reshard-group", """
        `fsdp.reshard_after_forward` is an int (the group size parameters are
        resharded to after forward) that does not divide `mesh.dp_shard`.
    """),
    "TP126": ("section-on-degree-1", """
        A version 2 section whose axis has degree 1 does nothing: `experts` with
        `mesh.ep: 1`, `context_parallel` with `mesh.cp: 1`, `fsdp` with
        dp_replicate and dp_shard both 1. Likely a size left out: set it, or
        remove the section.
    """, "warning"),
    "TP150": ("pipeline-stage-count", """
        A version 2 plan's `pipeline.stages` lists another number of stages
        than `mesh.pp` × `pipeline.virtual_stages`: each pp rank runs
        virtual_stages stages. Located at `pipeline.stages`, with both counts.
    """),
    "TP151": ("pipeline-schedule", """
        `pipeline.schedule` cannot run `pipeline.virtual_stages` stages per
        rank: GPipe and 1F1B run one; ZBVZeroBubble and DualPipeV exactly two
        (in a V); the interleaved schedules run any number.
    """),
    "TP152": ("pipeline-microbatches", """
        `pipeline.microbatches` breaks its schedule's rule: 1F1B needs at least
        pp microbatches (a rank would otherwise wait with nothing to run);
        the multi-stage schedules send microbatches round the ranks in groups
        of pp, so they need a multiple of pp.
    """),
    "TP153": ("pipeline-local-batch", """
        Each data-parallel rank's batch (`training.global_batch` /
        dp_replicate·dp_shard) does not split into `pipeline.microbatches`
        microbatches, or into microbatches of `pipeline.microbatch_size`.
    """),
    "TP154": ("pipeline-stage-unit", """
        An entry of `pipeline.stages` (its `{a..b}` ranges expanded) names no
        unit the stages are cut from: the blocks of the model's largest module
        list and, around them, the other children of its ancestors (the
        embeddings, the final norm, the head). A module inside a block, a
        path above the blocks, or no module at all; the message says which
        and what to name. Checked by `validate --model`.
    """),
    "TP155": ("pipeline-stage-order", """
        A unit is in two stages, or the stages do not follow the model's order
        (a stage takes the units after the previous stage's).
    """),
    "TP156": ("pipeline-stage-missing", """
        Modules with parameters are in no stage of `pipeline.stages`: each runs
        in exactly one. Modules without parameters (a rotary table) are kept in
        every stage.
    """),
    "TP157": ("pipeline-layers-per-stage", """
        `pipeline.layers_per_stage` does not cut the model's blocks into
        pp·virtual_stages stages (the blocks are not that many stages of that
        many), or the model has no module list of blocks to cut.
    """),
    "TP159": ("pipeline-tied-across-stages", """
        Modules of two pipeline stages share one parameter (tied weights: a
        head tied to the embeddings, as transformers' `tie_word_embeddings`).
        Each stage would hold and train its own copy, so the model would not
        be the one-device model after the first step. Untie them, or put both
        modules in one stage. Located at `pipeline.stages` (or
        `layers_per_stage`), with `validate --model` and under torchrun.
    """),
    "TP158": ("pipeline-stage-forward", """
        Under torchrun, a pipeline stage cannot run the model's own forward
        with the other stages' modules removed: it raised on the hidden states
        the stage before hands on (located at `pipeline`, with the stage, its
        modules and the error). A model whose forward reads the sequence length
        from its input (a rotary table built per call) cannot take a
        sequence-parallel stage boundary, where each rank hands on its shard of
        the sequence: end the TP rules' sequence parallelism before the
        boundary, or build the table as torchtitan does (once, sliced where the
        attention sees the whole sequence).
    """),
    "TP127": ("expert-count", """
        A module an `experts` rule matches holds no stacked experts, or
        `mesh.ep` does not divide its expert count. With `validate --model`:
        each module an `experts` rule matches must hold stacked experts (its
        own parameters all have the expert dim first, as transformers' fused
        `experts` and torchtitan's `GroupedExperts`; located at the rule), and
        `mesh.ep` must divide the number of experts E of each module an
        `expert_parallel` rule matches (each ep rank holds E / ep whole
        experts; located at `mesh.ep`, the message naming the module, the rule
        and the degrees that work: `mesh.ep: 8 does not divide the 6 experts of
        'layers.1.moe.experts' ... make ep one of 1, 2, 3, 6`). E is read as
        the expert styles read it (the parameters' first dim).
    """),
    "TP128": ("cp-without-attention", """
        A `context_parallel` module calls no attention that context
        parallelism can shard. With `validate --model`: a module
        `context_parallel.modules` matches does not call
        `torch.nn.functional.scaled_dot_product_attention` in the model's
        traced forward (itself or a submodule). torch's
        `context_parallel` shards the sequence only through SDPA's flash,
        efficient and cudnn CUDA kernels; an eager attention (matmul, softmax)
        or a module that is no attention has no CP rule. Located at the glob
        that names the module: name the attention modules, or make them call
        SDPA (transformers: `attn_implementation="sdpa"`). Not decided when the
        forward cannot be traced (TP329 says so).
    """),
    "TP129": ("fsdp-unit-order", """
        `fsdp.units` of a version 2 plan do not nest innermost first: a unit
        glob matches a module inside a module of a glob listed before it (or
        one glob matches both), or `""` (the root) is listed before another
        unit. FSDP2's `fully_shard` groups a unit's parameters when it is
        applied, so an outer unit wrapped first would already hold the inner
        one's: list inner units first and the root last (or leave `""` out, it
        is always wrapped last). Checked by `validate --model` and before
        `apply` shards anything, at the glob.
    """),
    "TP130": ("not-applied-yet", """
        `tpplan apply` (and `Plan.apply`) was given a version 2 plan that sets
        an axis (to anything but 1) or a section beyond what that runner
        applies (under torchrun: `cp`, `context_parallel`, and
        `experts` beside a `pipeline`; `Plan.apply`: `pp`, `pipeline`; the
        dry run: `experts` or `context_parallel` beside a
        `pipeline`), or an
        `experts` rule other than `expert_parallel` with `dispatch:
        all_to_all` (the one way the ep axis places experts). This tpplan checks them
        (`tpplan validate`) but does not apply them yet, and applying the
        rest alone would silently ignore them: it is refused as a usage
        error (exit 2) located at the first such key. A
        version 2 plan with only `mesh.tp` and `rules` applies exactly as the
        same version 1 plan.
    """),
    "TP131": ("cp-needs-cuda", """
        A version 2 plan's `context_parallel` (with `mesh.cp` above 1) is applied
        on a device other than CUDA: `tpplan apply` under torchrun on CPU, or
        `Plan.apply` with a CPU mesh. torch 2.13's context parallelism shards the
        sequence through SDPA's flash, efficient and cuDNN CUDA kernels only; the
        CPU kernel has no context-parallel rule. Refused before anything is
        applied, located at `context_parallel`: run it on CUDA GPUs
        (`Plan.apply` on a cuda mesh), simulate it with `tpplan apply
        --dry-run` (one CUDA rank: shapes and collectives), or set `mesh.cp`
        to 1 and remove the section.
    """),
    "TP132": ("cp-buffer", """
        A name in `context_parallel.buffers` cannot be sharded on the sequence
        when the plan is applied: it names no buffer of the model, the buffer
        has no such dim, its length there is not a multiple of 2·cp
        (`load_balance: headtail`) or cp, or it is not `training.seq` (a
        positional table is cut as the batch's sequence is, so it must hold the
        whole sequence). Located at the buffer's name.
    """),
    "TP140": ("not-expressed", """
        `tpplan export --to FRAMEWORK`: a key of the plan that the framework's
        config has no field for (transformers has no context parallelism,
        accelerate no pipeline or expert parallelism, torchtitan's TP plans are
        Python code, a style with no transformers string, a glob that is no
        list of transformers' plan keys, fsdp units, checkpointing). Listed at
        the key, never dropped: the exported config leaves it out, so set it in
        the framework's own way. `--strict` makes it exit 1.
    """, "warning"),
    "TP141": ("export-size-unknown", """
        `tpplan export`: the framework needs a size the plan leaves to the run:
        a `-1` axis (torchtitan keeps `data_parallel_shard_degree = -1` itself),
        a `tp` left out, or several promised TP degrees. Give `--world N`, or
        pick the degree with `--tp N`.
    """),
    "TP142": ("config-format-unknown", """
        `tpplan import-config`: the file is no config tpplan reads: not a JSON
        object with the fields of transformers' `DistributedConfig` or of
        accelerate's `ParallelismConfig`, nor TOML with torchtitan's
        `[parallelism]` table (or invalid JSON / TOML, at the mistake). Name
        the framework with `--from` where the fields do not tell. Exits 2
        (unreadable input).
    """),
    "TP143": ("config-bad-field", """
        `tpplan import-config`: a field of the config has the wrong type or
        value (`"tp_size": "2"`, a size of 0, a dtype the framework does not
        take), or is no field of that framework's config (its constructor
        would refuse it; transformers' `from_dict` would drop it silently).
    """),
    "TP144": ("config-left-out", """
        `tpplan import-config`: a field that no plan key says (accelerate's
        DeepSpeed `sp_size`, torchtitan's pipeline schedule, a transformers
        style with no tpplan equivalent, `tp_plan: "auto"`), or one whose plan
        key needs what the config does not name (a CP rotate needs the
        attention modules). Left out of the plan and listed here.
    """, "warning"),
    "TP200": ("rule-matches-nothing", """
        A rule matches no module of the model (torch would only warn). The
        message names the first segment that matches nothing and the closest
        real module paths. The same holds for every glob of a version 2 plan's
        sections (`experts` keys, `context_parallel.modules`, `fsdp.units`
        but `""`, the root, and `checkpointing.modules`), each located at the
        glob.
    """),
    "TP201": ("module-matched-twice", """
        A module is matched by two rules: a module takes one style, so narrow
        one of the globs. (torch would apply both and fail deep inside.) In a
        version 2 plan, likewise a module two globs of one section match (two
        `experts` rules, two `checkpointing.modules` globs, ...), at the later
        glob.
    """),
    "TP210": ("tied-layout-at-apply", """
        `Plan.apply` keeps tied parameters tied after sharding, and refuses when
        the plan lays the owners of one tied parameter out differently. The
        lint finds the same before launch as TP350.
    """),
}


@dataclass(frozen=True)
class Entry:
    code: str
    name: str
    severity: str
    summary: str
    doc: str  # Markdown, starting with a '## CODE name (severity)' heading


def _plain(code: str, name: str, text: str, severity: str = "error") -> Entry:
    body = textwrap.dedent(text).strip()
    flat = " ".join(body.split())
    first = re.match(r"(.*?(?<!e\.g)(?<!i\.e)\.)(?:\s|$)", flat)
    return Entry(code, name, severity, first.group(1) if first else flat, f"## {code} {name} ({severity})\n\n{body}\n")


# code -> (name, what it means): the problems found while applying and running a plan (tpplan.runtime).
_RUNTIME_CODES = {
    "TP500": ("model-factory", "The model (or inputs) factory named by --model / --inputs raised, or returned something else than an nn.Module (or tensors), "
              "or the model fails on one device without the plan (the dry run looks before blaming a rule for a failing forward, at any size: "
              "with real values under the values limit, shape-only on fake tensors above it, in memory planning's --dtype); "
              "located at the line of the model's code that raised."),
    "TP501": ("apply-failed", "Applying a rule's style to a module raised (e.g. colwise on a module that is not a Linear or Embedding). "
              "tpplan's own styles say what is wrong and the fix (expert_parallel on experts the degree does not divide, "
              "colwise with heads on out_features that are not whole heads, local_params naming a parameter the module lacks)."),
    "TP502": ("forward-failed", "The forward or backward of the parallelized model fails at this TP degree, typically a shape that the degree does not divide (heads, sequence). "
              "When a tpplan style's own hook finds input it cannot take (expert_parallel called without routing indices, "
              "no_parallel called without a positional tensor), the problem is at that style's rule, with the fix."),
    "TP503": ("ranks-disagree", "The ranks of a torchrun job disagree before sharding: different plans, different models, or errors on some ranks only."),
    "TP504": ("collective-failed", "A collective failed or timed out (--timeout): another rank died, hung or never started."),
    "TP505": ("check-mismatch", "--check: the outputs or gradients of the parallelized model differ from the single-device reference; "
              "the message names the first differing tensor and the problem is located at the rule of its module "
              "(or its closest planned ancestor), or, when that module computes right from the single-device run's own "
              "inputs, at the rule of the first enclosing module that still computes wrong (a fused qkv sharded plain "
              "colwise: the qkv rule, not the proj rule after it)."),
    "TP506": ("replicas-diverge", "A parameter replicated over the TP mesh (or its gradient) holds different values on different ranks "
              "after backward or an optimizer step (--check; the dry run sees every rank's values): it computes on sharded "
              "activations whose gradient is never reduced (e.g. a learnable scale between a colwise and a rowwise Linear, "
              "or a norm inside a sequence-parallel region without sequence_parallel on it). Training would silently diverge: "
              "shard the module, give it a rule that makes its input replicated (prepare_module_input), or move it out of "
              "the sharded region."),
    "TP507": ("no-dtensor-rule", "torch has no DTensor sharding rule for an op that DTensors reach, on the target device (CUDA) as on the simulating "
              "CPU: e.g. `aten.renorm` on the output of a rule with use_local_output: false. This is a limit of torch, not a mistake of the plan, "
              "and the plan fails on the cluster too; located at the rule whose DTensor output reached the op. Hand the module plain tensors "
              "before the op (use_local_output: true). Ops whose CUDA form has a rule but whose CPU form has none get the CUDA rule in every "
              "simulation (simulation/device_rules.py: `aten._scaled_dot_product_flash_attention_for_cpu` and its backward, as the flash / "
              "efficient attention rules), so they never report TP507."),
}


def _runtime_entries() -> list[Entry]:
    return [_plain(code, name, text) for code, (name, text) in _RUNTIME_CODES.items()]


def _checkpoint_entries() -> list[Entry]:
    from ..checkpoint.errors import CODE_DOCS  # no torch at import

    return [_plain(code, name, text) for code, (name, text) in CODE_DOCS.items()]


def catalog() -> list[Entry]:
    """Every documented code, in code order."""
    entries = [_plain(code, *doc) for code, doc in _PLAN_CODES.items()]
    entries += [Entry(rule.code, rule.name, rule.severity, rule.summary, rule.doc()) for rule in RULES.values()]
    entries += _runtime_entries()
    entries += _checkpoint_entries()
    return sorted(entries, key=lambda entry: entry.code)


def find(code_or_name: str) -> Entry | None:
    wanted = code_or_name.strip()
    for entry in catalog():
        if wanted.upper() == entry.code or wanted.lower() == entry.name:
            return entry
    return None
