"""The rules `tpplan init` proposes, in groups that stand or fall together.

From the data flow (dataflow.py) and the parameters' shapes:

- pair: the producers of one consumer colwise (whole heads: `heads: auto` when a
  degree exceeds their KV heads), the consumer rowwise: its all-reduce (or, with
  sequence parallelism, reduce-scatter) returns to the residual stream; a Linear
  left whole whose output's tail meets the heads as it is (MLA's rotary key)
  joins the pair with `sum_output_grad` (gradsum.py); a pair that fails its proof
  is tried once more gathered (`Group.gather`);
- embedding: the Embedding that reads the model's input, vocabulary-parallel;
- head: a Linear whose output is the model's output (the logits) itself, not summed
  into the residual stream (`Projection.head`), colwise and gathered (or kept sharded
  for `loss_parallel`);
- experts: a module holding two or more 3-D parameters with one leading (expert)
  dim, `expert_tp`, or `expert_parallel` with `ep`;
- norms (with `sp`): the modules with parameters that take the residual stream
  and hold no projection, `sequence_parallel`.

A Linear in none of these, and every other module with parameters, stays whole,
each with the reason (`Unplanned`). The lint's edits (packed fused projections,
local_params, shared inputs) are added later, when the plan is checked
(prove.py): they depend on which groups survive.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .dataflow import Dataflow, features, is_projection
from .gradsum import shared_tails

if TYPE_CHECKING:
    from torch import nn

CANDIDATE_DEGREES = tuple(range(2, 9))
# A degree that shards less than this share of what the default degrees shard is warned of.
WEAK_SHARE = 0.5


@dataclass
class Group:
    kind: str  # pair | embedding | head | experts | norm
    rules: dict  # concrete module fqn -> rule value
    note: str  # what was inferred, for the plan's comment
    divides: list = field(default_factory=list)  # sizes every degree must divide
    kv_heads: dict = field(default_factory=dict)  # producer fqn -> (KV heads, query heads)
    params: int = 0  # parameters the group shards (the bulk decides the degrees)
    gathered: bool = False  # a pair whose activations are gathered (its sharded-activation form failed)
    by_rows: tuple | None = None  # a head's (columns, inputs, rule, note): split on its inputs where a degree splits its columns unevenly
    columns: int = 0  # a head's columns: a degree that divides neither them nor (by_rows) its inputs splits it unevenly

    def gather(self) -> "Group | None":
        """The pair with its column half's output gathered and its row half taking the whole
        input (weights still sharded; activations whole between them, so whatever sits
        between them, a norm over every head's features, computes as on one device); None
        for a group that is no pair or is gathered already."""
        if self.kind != "pair" or self.gathered:
            return None
        from ..core.placements import PlacementSpec
        from ..core.schema import rule_spec
        from ..lint.edits import with_options

        # which half a rule is, by where the style table puts a Linear's weight [out, in]
        gathered = {PlacementSpec("shard", 0): {"output_layouts": "replicate"}, PlacementSpec("shard", 1): {"input_layouts": "replicate"}}
        rules = {}
        for fqn, value in self.rules.items():
            options = gathered.get(rule_spec(value).semantics.contract.tp.placement("Linear", "weight"))
            if options is not None:
                rules[fqn] = with_options(value, options)
            # sum_output_grad and gathers of a shared input: the whole activations need neither
        return Group(self.kind, rules, f"{self.note}; gathered between them", self.divides, self.kv_heads, self.params, True)

    def evenly(self, degree: int) -> bool:
        """Whether `degree` splits the group into equal shares (a head's columns may split
        unevenly where its rule gathers them: allowed, but not a degree to pick by default)."""
        if not self.allows(degree):
            return False
        return not self.columns or self.columns % degree == 0 or (self.by_rows is not None and self.by_rows[1] % degree == 0)

    def sizes(self) -> list[int]:
        """The sizes a degree must divide to shard the group: its features, heads and KV heads, rows."""
        return sorted(set(self.divides) | {kv for kv, _ in self.kv_heads.values()})

    def allows(self, degree: int) -> bool:
        if any(size % degree for size in self.divides):
            return False
        return all(kv % degree == 0 or (degree % kv == 0 and q % degree == 0) for kv, q in self.kv_heads.values())

    def rules_at(self, degrees) -> dict:
        """The rules for `degrees`: `heads: auto` on a KV projection a degree replicates; a head
        split on its inputs where a degree does not divide its columns and every degree its inputs."""
        if self._by_rows(degrees):
            return {fqn: self.by_rows[2] for fqn in self.rules}
        out = {}
        for fqn, value in self.rules.items():
            kv = self.kv_heads.get(fqn)
            if kv is not None and any(d > kv[0] for d in degrees):
                value = {**({"style": value} if isinstance(value, str) else value), "heads": "auto"}
            out[fqn] = value
        return out

    def note_at(self, degrees) -> str:
        return self.by_rows[3] if self._by_rows(degrees) else self.note

    def _by_rows(self, degrees) -> bool:
        if self.by_rows is None:
            return False
        columns, inputs = self.by_rows[:2]
        return any(columns % d for d in degrees) and not any(inputs % d for d in degrees)


def sharded_params(groups: list[Group], degree: int, *, evenly: bool = False) -> int:
    """The parameters the groups that `degree` divides hold (`evenly`: into equal shares)."""
    return sum(g.params for g in groups if (g.evenly(degree) if evenly else g.allows(degree)))


def default_degrees(groups: list[Group]) -> list[int]:
    """The degrees init proves at when none is given: those in 2..8 that shard the most
    parameters evenly, i.e. that divide every size of all a degree can shard (pairs'
    features, heads and KV heads, the embedding's and head's vocabulary, experts); [2]
    when nothing can be sharded."""
    shared = {d: sharded_params(groups, d, evenly=True) for d in CANDIDATE_DEGREES}
    best = max(shared.values())
    return [d for d, n in shared.items() if n == best] if best else [CANDIDATE_DEGREES[0]]


def weak_degree(groups: list[Group], degree: int, total: int) -> str | None:
    """Why `degree` (asked for) is a poor one, when it shards less than WEAK_SHARE of what
    the default degrees shard: the share it shards, the sizes it does not divide, the degrees
    that would shard more; None when it is not."""
    from ..core.globs import generalize

    defaults = default_degrees(groups)
    best, here = sharded_params(groups, defaults[0], evenly=True), sharded_params(groups, degree)
    if not best or here >= WEAK_SHARE * best:
        return None
    def named(group: Group) -> str:  # blocks.*: in_proj -> out_proj
        parent = generalize(next(iter(group.rules))).rpartition(".")[0]
        what = group.note.split(":")[0]
        return f"{parent}: {what}" if parent else what

    missed = dict.fromkeys(f"{named(g)} ({', '.join(map(str, g.sizes()))})" for g in groups if not g.allows(degree))
    share = lambda n: f"{100 * n / total:.0f}%" if total else "0%"  # noqa: E731
    return (f"TP {degree} shards {share(here)} of the parameters, where TP {', '.join(map(str, defaults))} shard "
            f"{share(best)}: {degree} does not divide the sizes of {'; '.join(missed)}")


@dataclass(frozen=True)
class Unplanned:
    fqn: str
    why: str


@dataclass
class Proposal:
    groups: list
    unplanned: list
    loss_parallel: bool = False


def propose(model: "nn.Module", flow: Dataflow, *, sp: bool = False, ep: bool = False, loss_parallel: bool = False,
            stream_modules: "set[str] | None" = None) -> Proposal:
    from torch import nn

    modules = dict(model.named_modules())
    projs = flow.projections
    # One consumer, which is not the head (BERT's transform.dense reaches only the decoder).
    # Not one whose output is added into the residual stream: the last layer's row half reaches
    # only the head (or the head's first Linear), through the residual add and a norm.
    producers = {f for f, p in projs.items() if len(p.consumers) == 1 and not p.to_output and not p.to_stream
                 and not projs[next(iter(p.consumers))].head}
    producers -= {f for f in producers if next(iter(projs[f].consumers)) in producers}  # a chain: only its last link pairs
    by_consumer: dict[str, list[str]] = {}
    for f in sorted(producers, key=list(modules).index):
        by_consumer.setdefault(next(iter(projs[f].consumers)), []).append(f)
    groups: list[Group] = []
    claimed: set[str] = set()
    for consumer, prods in by_consumer.items():
        claimed.update(prods, [consumer])
    for consumer, prods in by_consumer.items():
        groups.append(_pair(modules, flow, consumer, prods, sp, claimed))
        claimed.update(groups[-1].rules)
    groups += _embeddings_and_head(modules, flow, claimed, sp, loss_parallel)
    claimed.update(f for g in groups for f in g.rules)
    groups += _experts(modules, claimed, ep)
    claimed.update(f for g in groups for f in g.rules)
    if sp:
        groups += _norms(modules, stream_modules or set(), claimed)
        claimed.update(f for g in groups for f in g.rules)
    unplanned = _unplanned(modules, flow, claimed, groups)
    return Proposal(groups, unplanned, loss_parallel and any(g.kind == "head" for g in groups))


def _leaf(fqn: str) -> str:
    return fqn.rpartition(".")[2]


def _pair(modules, flow: Dataflow, consumer: str, prods: list[str], sp: bool, claimed: set) -> Group:
    projs = flow.projections
    rules: dict[str, Any] = {}
    divides = [features(modules[consumer])[0]]
    kv: dict[str, tuple] = {}
    heads = {f: projs[f].heads for f in prods if projs[f].heads}
    query = max((h for h, _ in heads.values()), default=None)
    for f in prods:
        rules[f] = "colwise"
        if f in heads and heads[f][0] != query:
            kv[f] = (heads[f][0], query)
        elif f in heads:
            divides.append(heads[f][0])
        else:
            divides.append(features(modules[f])[1])
    rules[consumer] = {"style": "rowwise", "output_layouts": "shard(1)", "use_local_output": False} if sp else "rowwise"
    shown = ", ".join(_leaf(f) for f in prods)
    if heads:
        dims = {d for _, d in heads.values()}
        note = f"{shown} -> {_leaf(consumer)}: {query} heads of {'/'.join(map(str, sorted(dims)))}"
        kv_counts = sorted({h for h, _ in kv.values()})
        if kv_counts:
            note += f", {'/'.join(map(str, kv_counts))} KV heads"
    else:
        note = f"{shown} -> {_leaf(consumer)}: {features(modules[consumer])[0]} features, column then row parallel"
    params = sum(modules[f].weight.numel() for f in [*prods, consumer])
    # a whole projection (MLA's kv_a_proj_with_mqa) whose rotary tail meets the heads as it is
    for fqn, last in shared_tails(modules, flow, consumer, prods, claimed).items():
        width = features(modules[fqn])[1]
        rules[fqn] = {"style": "sum_output_grad"} if last == width else {"style": "sum_output_grad", "last": last}
        what = "output" if last == width else f"last {last} of {width} output features"
        note += f"; {_leaf(fqn)} whole, its {what} meeting the heads whole: that gradient summed"
    if sp:
        rules = {**_gather_once(flow, prods), **rules}
    return Group("pair", rules, note, divides, kv, params)


def _gather_once(flow: Dataflow, prods: list[str]) -> dict[str, Any]:
    """With sequence parallelism, the parent that hands the producers their one shared input
    gathers it once (shard(1) to replicate), instead of each producer gathering its own copy."""
    parents = {f.rpartition(".")[0] for f in prods}
    node = flow.shared_input(prods)
    if len(parents) != 1 or node is None:
        return {}
    parent = parents.pop()
    where = flow.argument(parent, node)
    if not parent or where is None:
        return {}
    from ..lint.rules.shared_input_comms import replicating_input

    return {parent: replicating_input(*where, "shard(1)")}


def _embeddings_and_head(modules, flow: Dataflow, claimed: set, sp: bool, loss_parallel: bool) -> list[Group]:
    from torch import nn

    from ..sharding.tied import shared_parameters

    groups: dict[str, Group] = {}
    for fqn, reads_input in flow.embeddings.items():
        if not reads_input or fqn in claimed:
            continue
        value: dict[str, Any] = {"style": "rowwise", "input_layouts": "replicate"}
        value.update({"output_layouts": "shard(1)", "use_local_output": False} if sp else {"output_layouts": "replicate"})
        emb = modules[fqn]
        groups[fqn] = Group("embedding", {fqn: value}, f"{_leaf(fqn)}: vocabulary-parallel, {emb.num_embeddings} rows",
                            [emb.num_embeddings], params=emb.weight.numel())
    for fqn, proj in flow.projections.items():
        if fqn in claimed or not proj.head:
            continue
        value = {"style": "colwise"}
        if sp:
            value["input_layouts"] = "shard(1)"
        value.update({"use_local_output": False} if loss_parallel else {"output_layouts": "replicate"})
        head = modules[fqn]
        inputs, columns = features(head)
        how = "sharded for loss_parallel" if loss_parallel else "gathered"
        # gathered, the columns may split unevenly (DTensor's uneven shards; the proof checks it); loss_parallel's may not.
        # Where a degree splits them unevenly and every degree divides the inputs, the inputs are split instead: as
        # few bytes per rank, evenly (a forward all-reduce of the logits for the all-gather of their columns)
        by_rows = None
        if not (sp or loss_parallel):
            by_rows = (columns, inputs, {"style": "rowwise", "input_layouts": "replicate"},
                       f"{_leaf(fqn)}: the output head, split on its {inputs} inputs (a degree does not divide its "
                       f"{columns} columns), its partial logits all-reduced")
        groups[fqn] = Group("head", {fqn: value}, f"{_leaf(fqn)}: the output head, {columns} columns {how}",
                            [columns] if loss_parallel else [], params=head.weight.numel(), by_rows=by_rows,
                            columns=columns)
    # Tied weights are one parameter: laid out one way, so their rules stand or fall together.
    home = {fqn: fqn for fqn in groups}  # module -> the key of the group its rule is in
    for tie in shared_parameters(modules[""]):
        keys = list(dict.fromkeys(home[fqn] for fqn, _ in tie if fqn in home))
        first = groups[keys[0]] if keys else None
        for other in keys[1:]:
            merged = groups.pop(other)
            first.rules.update(merged.rules)
            first.divides += merged.divides
            first.note += f"; {merged.note} (tied to it)"
            first.by_rows = None  # one parameter, laid out as the embedding's rows
            home.update((fqn, keys[0]) for fqn in merged.rules)
        if first is None:
            continue
        loose = [(fqn, name) for fqn, name in tie if fqn not in home]
        if all(fqn in modules and not isinstance(modules[fqn], nn.Embedding) and not is_projection(modules[fqn]) and fqn not in claimed
               for fqn, _ in loose):
            # a module that only holds the tensor (BERT's LMPredictionHead.bias, tied to its decoder's):
            # the same rows of it on each rank, as the vocabulary-parallel rule lays them out
            for fqn, name in loose:
                value = first.rules.get(fqn, {"style": "local_params", "params": {}})
                first.rules[fqn] = {**value, "params": {**value["params"], name: "shard(0)"}}
                home[fqn] = keys[0]
        else:
            for key in keys:  # tied to a module that stays whole: it stays whole too
                groups.pop(key, None)
    return list(groups.values())


def _experts(modules, claimed: set, ep: bool) -> list[Group]:
    from torch import nn

    out = []
    for fqn, module in modules.items():
        if fqn in claimed or isinstance(module, nn.Embedding) or is_projection(module):
            continue
        cubes = [p for p in module._parameters.values() if p is not None and p.dim() == 3]
        experts = {p.shape[0] for p in cubes}
        if len(cubes) < 2 or len(experts) != 1 or next(iter(experts)) < 2:
            continue
        count = next(iter(experts))
        if ep:
            value: Any = {"style": "expert_parallel", "dispatch": "all_reduce"}
            note, divides = f"{_leaf(fqn)}: {count} experts, whole experts per rank", [count]
        else:
            value = "expert_tp"  # it finds each parameter's inner dim; the lint judges its divisibility
            note, divides = f"{_leaf(fqn)}: {count} experts, each sharded on its inner dim", []
        out.append(Group("experts", {fqn: value}, note, divides, params=sum(p.numel() for p in cubes)))
    return out


def _norms(modules, stream: set, claimed: set) -> list[Group]:
    from torch import nn

    rules = {}
    for fqn in sorted(stream, key=list(modules).index):
        module = modules[fqn]
        if fqn in claimed or isinstance(module, nn.Embedding) or is_projection(module) or not list(module.parameters()):
            continue
        if any(isinstance(m, nn.Embedding) or is_projection(m) for m in module.modules()):
            continue  # a container (a decoder layer): its projections are planned inside it
        rules[fqn] = "sequence_parallel"
    if not rules:
        return []
    return [Group("norm", rules, "norms on the residual stream: sequence-parallel, shard(1)")]


def _unplanned(modules, flow: Dataflow, claimed: set, groups: list) -> list[Unplanned]:
    from torch import nn

    planned = set(claimed)
    out = []
    for fqn, module in modules.items():
        if fqn in planned or any(fqn.startswith(p + ".") for p in planned if p):
            continue
        own = [p for p in module._parameters.values() if p is not None]
        if not own:
            continue
        if is_projection(module):
            proj = flow.projections.get(fqn)
            if proj is None:
                why = "did not run in the traced forward"
            elif proj.to_output and proj.consumers:
                why = "its output reaches the model's output and other projections"
            elif len(proj.consumers) > 1:
                many = f"{len(proj.consumers)}{' or more' if len(proj.consumers) > 2 else ''}"
                why = f"its output reaches {many} projections ({', '.join(sorted(map(_leaf, proj.consumers))[:2])}, ...), not one column-row pair"
            elif proj.consumers and next(iter(proj.consumers)) in flow.projections and len(flow.projections[next(iter(proj.consumers))].consumers) == 1:
                why = f"its one consumer '{_leaf(next(iter(proj.consumers)))}' is itself column-parallel"
            elif not proj.consumers and not proj.to_output:
                why = "its output reaches no projection and not the model's output"
            else:
                why = "its output returns to the residual stream without a column-parallel producer"
        elif isinstance(module, nn.Embedding):
            why = "it does not read the model's input (positions, not tokens)" if fqn in flow.embeddings else "did not run in the traced forward"
        elif fqn in flow.stream:
            continue  # a norm on the replicated residual stream: whole, as it should be
        else:
            why = f"{type(module).__name__}: no column or row split of it is proven"
        out.append(Unplanned(fqn, why))
    return out
