"""Block identity: when one module stands for another, so that it is simulated once.

Two callers ask "are these blocks identical?", and both ask it here:

- memory planning's block reuse (memory/reuse.py) simulates a run of identical
  blocks of the list FSDP wraps as two truncated copies and composes the whole
  step; blocks it merges must hold and allocate the same memory, so it asks
  `signatures(..., exact=True)`;
- the lint's trace (lint/trace.py) replays a module call whose structure and
  inputs equal an earlier one's, and its collapse (lint/collapse.py) dry-runs two
  blocks of each run; blocks it merges must reach the same verdicts, so it asks
  `Structures` (`exact=False`), interned once per module while tracing.

What a module is, apart from its submodules, is `aspects(module, exact)`, in one
place: its class; its parameters' and buffers' shapes, dtypes, tensor classes,
whether they train and whether a buffer is saved; the hooks registered on it;
and its attributes. The two strengths differ only in the attributes they read
and in how they tell an attribute that numbers a block (`layer_idx`, which must
not make the layers of a decoder differ):

- `exact=False` (the lint's): public attributes of plain types (`int`, `str`,
  a dtype...), a block's number told by its name. The trace interns it for every
  module it calls, at every depth, where no run of siblings says what a block's
  index is; and it patches each module's `forward` as an attribute, which an
  exact reading would count as each module's own object: every layer's call
  would run again, and a deep model's trace would cost its depth again.
- `exact=True` (memory's): every attribute the module holds, private ones too,
  containers by their items, tensors by shape, a module by its class and
  tensors (the kernels package's per-attention copy of one function module,
  `_kernel_funcs` in transformers 5.25, is no difference), any other object by
  identity: unknown state is never merged, since the plan's bytes must be those
  of the whole model. A block's number is told by its value, whatever its name:
  an attribute that equals its block's index in every block of the list that
  has it (`signatures`).

`runs` groups a list of such keys into runs of identical consecutive blocks.

lint/context.py's `fingerprint` answers another question: whether one model is
still the model it traced (identities, devices, names), not whether two blocks
compute alike.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import re
from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

# (module path inside the block, aspect, value): "attribute width", "parameter weight", "type", "rule", ...
Signature = list[tuple[str, str, Any]]

# Attributes that number a block rather than shape its computation (the lint's notion: by name).
INDEX_NAME = re.compile(r"(^|_)(idx|index|id|layer_id|layer_idx|layer_number|layer_num|block_idx)$")


@functools.cache
def _plain_types() -> frozenset:
    import torch

    return frozenset((int, float, bool, str, type(None), torch.dtype, torch.device))


@functools.cache
def _internals() -> frozenset:
    """nn.Module's own bookkeeping (`_parameters`, `_forward_hooks`, ...), which `aspects` reads
    as tensors and hooks; `training` stays an attribute."""
    from torch import nn

    return frozenset(vars(nn.Module())) - {"training"}


def aspects(module: "nn.Module", exact: bool) -> list[tuple[str, Any]]:
    """What of `module`, apart from its submodules, decides what it computes from its
    inputs: (aspect, value) pairs, its class first. Both strengths read its tensors and
    hooks alike; `exact` reads every attribute, else the plain public ones that do not
    number a block (see the module docstring)."""
    out: list[tuple[str, Any]] = [("type", type(module))]
    not_saved = module._non_persistent_buffers_set
    for kind, tensors in (("parameter ", module._parameters), ("buffer ", module._buffers)):
        for name, t in tensors.items():
            shape = None if t is None else (tuple(t.shape), t.dtype, t.requires_grad, type(t))
            out.append((kind + name, (shape, name in not_saved)))
    if exact:
        internals = _internals()
        out += [(f"attribute {name}", attribute_value(v)) for name, v in vars(module).items() if name not in internals]
    else:
        plain = _plain_types()
        index = INDEX_NAME.search
        out += [("attribute " + k, v) for k, v in sorted((k, v) for k, v in vars(module).items()
                                                         if k[0] != "_" and type(v) in plain and not index(k))]
    out.append(("hooks", (len(module._forward_hooks), len(module._forward_pre_hooks),
                          len(module._backward_hooks), len(module._backward_pre_hooks))))
    return out


def attribute_value(value: Any) -> Any:
    """An attribute as `exact` compares it between blocks: plain values by value, containers
    by their items, tensors by shape, modules by what they hold, other objects by identity.

    A module in an attribute is compared by its class and its parameters' and buffers' shapes, as
    its block's own submodules are, not by identity: each block holding its own copy of one
    function module (the kernels package's `_kernel_funcs`, which transformers 5.25 uses) is no
    difference, while a copy of another class or shape still is."""
    import torch
    from torch import nn

    if value is None or isinstance(value, (bool, int, str, float, complex, torch.dtype, torch.device, enum.Enum)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(attribute_value(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((attribute_value(k), attribute_value(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, nn.Module):
        tensors = (*value.named_parameters(), *value.named_buffers())
        return ("module", type(value), tuple((name, attribute_value(t)) for name, t in tensors))
    return ("object", id(value))


class Structures:
    """Interned structure ids, `exact=False`: a module's `aspects` and its children's ids, bottom-up,
    computed once per module (by identity). Equal ids: modules that compute alike from equal inputs."""

    def __init__(self) -> None:
        self.ids: dict[int, int] = {}  # id(module) -> structure id
        self.interned: dict[tuple, int] = {}

    def of(self, module: "nn.Module") -> int:
        sid = self.ids.get(id(module))
        if sid is None:
            children = tuple((k, self.of(c)) for k, c in module._modules.items() if c is not None)
            key = (tuple(aspects(module, exact=False)), children)
            sid = self.ids[id(module)] = self.interned.setdefault(key, len(self.interned))
        return sid


def shared(model: "nn.Module") -> set[int]:
    """Ids of the modules, parameters and buffers the model holds more than once (tied, or one block twice)."""
    seen = Counter(id(m) for _, m in model.named_modules(remove_duplicate=False))
    seen.update(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    seen.update(id(b) for _, b in model.named_buffers(remove_duplicate=False))
    return {key for key, n in seen.items() if n > 1}


def signature(block: "nn.Module", fqn: str, *, exact: bool = True, rule: Callable[[str], Hashable] | None = None,
              held_twice: "set[int] | frozenset[int]" = frozenset()) -> Signature:
    """What makes a block behave as it does, relative to the block: (module path, aspect, value)
    for it and each submodule. `rule(fqn)` names what the plan does to a module (None: nothing
    asked); a module holding something in `held_twice` (`shared(model)`: one module in every block,
    tied weights) is the block's own, so that no run counts it once per block."""
    out: Signature = []
    for rel, module in block.named_modules(remove_duplicate=False):
        own = aspects(module, exact)
        out.append((rel, *own[0]))  # the class first: the first difference named is the broadest
        if held_twice:
            held = [id(module), *(id(t) for t in (*module._parameters.values(), *module._buffers.values()) if t is not None)]
            out.append((rel, "sharing", fqn if any(i in held_twice for i in held) else None))
        if rule is not None:
            out.append((rel, "rule", rule(f"{fqn}.{rel}" if rel else fqn)))
        out += [(rel, *aspect) for aspect in own[1:]]
    return out


def signatures(blocks: Sequence[tuple[str, "nn.Module"]], *, exact: bool = True, rule: Callable[[str], Hashable] | None = None,
               held_twice: "set[int] | frozenset[int]" = frozenset()) -> list[Signature]:
    """`signature` of each (fqn, block) of one list, in order. With `exact`, an attribute that is
    its block's own index (the fqn's last key) in every block that has it (`layer_idx`, whatever
    its name) does not make blocks differ: it reads "index"."""
    found = [signature(block, fqn, exact=exact, rule=rule, held_twice=held_twice) for fqn, block in blocks]
    if not exact:
        return found  # INDEX_NAME left the block numbers out already
    indices = [int(k) if (k := fqn.rpartition(".")[2]).isdigit() else None for fqn, _ in blocks]
    not_index = {(rel, aspect) for sig, index in zip(found, indices)
                 for rel, aspect, value in sig if aspect.startswith("attribute ") and (value != index or isinstance(value, bool))}
    return [[(rel, aspect, "index" if aspect.startswith("attribute ") and (rel, aspect) not in not_index else value)
             for rel, aspect, value in sig] for sig in found]


def runs(keys: Sequence[Hashable]) -> list[range]:
    """The runs of equal consecutive keys (a block's signature or structure), in order: indices into `keys`."""
    out: list[range] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[i - 1]:
            out.append(range(start, i))
            start = i
    return out


def first_difference(fqns: Sequence[str], found: Sequence[Signature]) -> str:
    """Where the first block that differs from the one before it differs, in words."""
    for i in range(1, len(fqns)):
        if found[i] != found[i - 1]:
            ours, theirs = found[i], found[i - 1]
            where = next(((o[0], o[1]) for o, t in zip(ours, theirs) if o != t), None)
            if where is None:
                return f"'{fqns[i]}' has {'more' if len(ours) > len(theirs) else 'fewer'} submodules than '{fqns[i - 1]}'"
            return f"'{fqns[i]}' differs from '{fqns[i - 1]}' in the {where[1]} of '{where[0] or '<block>'}'"
    return "every block differs"


@contextlib.contextmanager
def only_children(container: "nn.Module", keep: Callable[[str], bool]) -> Iterator[None]:
    """`container` (a list of blocks) holding only the children whose key `keep` accepts,
    under their own names, while the body runs; whole again after. What a model simulated
    with fewer blocks is cut by: memory's truncated copies, the lint's collapsed copy, fit's
    FLOP count."""
    full = container._modules
    container._modules = {key: child for key, child in full.items() if keep(key)}
    try:
        yield
    finally:
        container._modules = full
