"""The model's FLOPs per module for one training sequence, counted by torch.

`count_flops` builds the unsharded model on fake tensors (no memory, so a 405B
model costs nothing), runs one forward, the training loss and one backward of a
batch of one `seq`-token sequence under torch's `FlopCounterMode`, and returns
each module's forward and backward FLOPs (its whole subtree's, as torch counts
them: matmuls and attention; elementwise ops count 0).

Two things torch's counter does not do by itself, done here:
- the CPU's fused attention (`_scaled_dot_product_flash_attention_for_cpu`, what
  `F.scaled_dot_product_attention` runs on fake CPU tensors) has no formula in
  torch 2.13: it gets torch's own sdpa formulas (the full square, causal or not;
  the backward recomputes the scores: 5 batched matmuls to the forward's 2);
- torch's `ModuleTracker` closes a module's backward when its input's whole
  gradient is in, so modules that read one tensor (wq, wk, wv) would each be
  charged the others' backward: every module gets its own alias of its inputs.

The same forward, and one more of two sequences, also weigh what autograd saves
for backward in each block (its activations, the model's own tensors left out):
the difference is what one more sequence adds, leaving out what a forward makes
once whatever the batch (a rotary table, a mask) or keeps across forwards. Without
activation checkpointing a rank holds that for every block, sequence and
microbatch in flight when backward starts, which bounds its memory from below
(bounds.py).

Identical consecutive blocks (simulation.blocks' identity, as memory's reuse)
cost the same FLOPs and save the same bytes: the run's middle blocks are left out
of the run and credited with its first block's figures, so a 126-block model costs
what 2 blocks cost.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModuleFlops:
    """FLOPs of one forward and one backward, per module FQN ("" the root; every
    module of the model is a key), each the module's whole subtree.
    `total_*` is everything counted, the loss outside the model included."""

    forward: dict[str, int]
    backward: dict[str, int]
    total_forward: int
    total_backward: int
    saved_per_sequence: dict[str, int] = field(default_factory=dict)  # block FQN -> bytes autograd saves per sequence

    def of(self, modules: Iterable[str]) -> tuple[int, int]:
        """(forward, backward) of these units together: a unit inside another listed
        one is already in its figure, so it is counted once. An unknown name is a KeyError."""
        names = set(modules)
        for name in names:
            self.forward[name]  # a typo would otherwise add 0
        tops = [n for n in names if not any(_inside(n, other) for other in names if other != n)]
        return sum(self.forward[n] for n in tops), sum(self.backward[n] for n in tops)

    @property
    def total(self) -> tuple[int, int]:
        return self.total_forward, self.total_backward


def _inside(name: str, unit: str) -> bool:
    return unit == "" or name.startswith(unit + ".")


def count_flops(factory: Callable[[], Any] | str, seq: int, dtype: str | None = "bf16", *, reuse: bool = True) -> ModuleFlops:
    """FLOPs of one training sequence (batch 1, `seq` tokens) of the model `factory()`
    builds (a callable, or a `MOD:FN` / `hf:SPEC` reference as `--model` takes it), in
    `dtype` (bf16, fp16, fp32: FLOPs do not depend on it, the ops it picks may).
    `reuse`: identical blocks counted once (exact for them; see the module's doc)."""
    from ..simulation.modelref import build_model, default_dtype, load_callable, make_inputs
    from ..simulation.simulate import fake_tensors
    from ..simulation.training import make_targets, torch_dtype, training_loss

    ref = factory if isinstance(factory, str) else f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', factory)}"
    build = load_callable(factory) if isinstance(factory, str) else factory
    with fake_tensors():
        with default_dtype(torch_dtype(dtype)):
            model = build_model(ref, "cpu", build)
        names = [name for name, _ in model.named_modules()]
        run = _identical_run(model) if reuse else None
        one, two = {}, {}  # block -> bytes saved with one sequence, with two
        with _hidden(model, run):
            inputs = make_inputs(None, model, "cpu", batch=1, seq=seq)
            targets = make_targets(model, inputs)
            counter = _counter()
            with _own_inputs(), counter, _saved_by_block(model, one):
                loss = training_loss(model(*inputs), targets)
                forward = _by_fqn(counter.get_flop_counts())
                loss.backward()
            both = _by_fqn(counter.get_flop_counts())
            with _saved_by_block(model, two):
                model(*make_inputs(None, model, "cpu", batch=2, seq=seq))
    backward = {name: both.get(name, 0) - forward.get(name, 0) for name in both}
    flops = [_credit(run, _subtrees(names, counts)) for counts in (forward, backward)]
    per_sequence = {block: max(0, two[block] - one[block]) for block in one}
    if run is not None:  # a hidden block saves what its template saves
        per_sequence.update(dict.fromkeys(run.hidden, per_sequence.get(run.template, 0)))
    return ModuleFlops(*flops, flops[0][""] + forward["Global"] - forward.get("", 0),
                       flops[1][""] + backward["Global"] - backward.get("", 0), per_sequence)


@contextlib.contextmanager
def _saved_by_block(model: "nn.Module", saved: dict[str, int]) -> Iterator[None]:
    """Fill `saved` with the bytes of the storages autograd saves for backward inside
    each block's forward (fsdp.blocks: the list FSDP wraps), each storage once (a view
    keeps its whole storage alive) and the model's parameters and buffers left out:
    what the block's activations hold from its forward until its backward."""
    import torch
    from torch.autograd.graph import saved_tensors_hooks

    from ..simulation.fsdp import blocks

    own = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    seen: set[int] = set()
    inside: list[str] = []
    handles = []

    def enter(fqn: str) -> Callable[..., None]:
        def hook(module, args) -> None:
            inside.append(fqn)
        return hook

    def leave(module, args, output) -> None:  # returns nothing: the block's output stays its own
        inside.pop()

    for fqn in blocks(model):
        block = model.get_submodule(fqn)
        saved.setdefault(fqn, 0)
        handles += [block.register_forward_pre_hook(enter(fqn)), block.register_forward_hook(leave)]

    def pack(tensor: "torch.Tensor") -> "torch.Tensor":
        if inside and isinstance(tensor, torch.Tensor):
            storage = tensor.untyped_storage()
            if storage._cdata not in own and storage._cdata not in seen:
                seen.add(storage._cdata)
                saved[inside[-1]] += storage.nbytes()
        return tensor

    try:
        with saved_tensors_hooks(pack, lambda tensor: tensor):
            yield
    finally:
        for handle in handles:
            handle.remove()


def _counter() -> Any:
    """torch's FlopCounterMode, with torch's sdpa formulas for the CPU's fused attention."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

    def cpu_sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:  # shapes: FlopCounterMode passes them
        return sdpa_flop_count(query, key, value)

    def cpu_sdpa_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    aten = torch.ops.aten
    return FlopCounterMode(display=False, custom_mapping={
        aten._scaled_dot_product_flash_attention_for_cpu: cpu_sdpa,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: cpu_sdpa_backward,
    })


def _by_fqn(counts: dict[str, dict[Any, int]]) -> dict[str, int]:
    """FlopCounterMode's keys ("Global", "Transformer", "Transformer.layers.0") as FQNs
    ("Global", "", "layers.0"): its names start with the root's class name."""
    return {("Global" if key == "Global" else key.partition(".")[2]): sum(ops.values()) for key, ops in counts.items()}


def _subtrees(names: list[str], counts: dict[str, int]) -> dict[str, int]:
    """Every module's figure: a module never called (a ModuleList) or with no op counted
    (a norm) is not among torch's keys; its subtree's FLOPs are its children's."""
    children: dict[str, list[str]] = {}
    for name in names[1:]:  # named_modules: the root first, parents before children
        children.setdefault(name.rpartition(".")[0], []).append(name)
    out: dict[str, int] = {}
    for name in reversed(names):
        out[name] = counts[name] if name in counts else sum(out[child] for child in children.get(name, ()))
    return out


@contextlib.contextmanager
def _own_inputs() -> Iterator[None]:
    """Each module call reads its own alias (a view: no FLOPs, no memory) of its input
    tensors. Registered before FlopCounterMode's tracker, so the tracker hooks the alias,
    whose gradient is complete when this module's backward is, not its siblings'."""
    import torch
    from torch.nn.modules.module import register_module_forward_pre_hook

    def alias(module: "nn.Module", args: tuple) -> tuple:
        return tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)

    handle = register_module_forward_pre_hook(alias)
    try:
        yield
    finally:
        handle.remove()


@dataclass(frozen=True)
class _Run:
    container: str  # "layers"
    template: str  # the run's first block, "layers.0"
    hidden: tuple[str, ...]  # the blocks left out, each credited with the template's figures


def _identical_run(model: "nn.Module") -> _Run | None:
    """The longest run of identical blocks (simulation.blocks) in the list FSDP wraps,
    when it is long enough (3) to leave any out: all but its first and last."""
    from ..simulation.blocks import runs, shared, signatures
    from ..simulation.fsdp import blocks

    fqns = blocks(model)
    if len(fqns) < 3:
        return None
    best = max(runs(signatures([(f, model.get_submodule(f)) for f in fqns], exact=True, held_twice=shared(model))), key=len)
    if len(best) < 3:
        return None
    return _Run(fqns[0].rpartition(".")[0], fqns[best.start], tuple(fqns[best.start + 1:best.stop - 1]))


@contextlib.contextmanager
def _hidden(model: "nn.Module", run: _Run | None) -> Iterator[None]:
    """The model with the run's hidden blocks out of their list, every name kept."""
    from ..simulation.blocks import only_children

    if run is None:
        yield
        return
    hidden = {fqn.rpartition(".")[2] for fqn in run.hidden}
    with only_children(model.get_submodule(run.container), lambda key: key not in hidden):
        yield


def _credit(run: _Run | None, flops: dict[str, int]) -> dict[str, int]:
    """Each hidden block (and its submodules) gets the template's figures, and every
    module around the list (the list, its ancestors, the root) their sum."""
    if run is None:
        return flops
    out = dict(flops)
    for block in run.hidden:
        for name, value in flops.items():
            if name == run.template or name.startswith(run.template + "."):
                out[block + name[len(run.template):]] = value
    added = len(run.hidden) * flops[run.template]
    for name in out:
        if name == run.container or _inside(run.container, name):
            out[name] += added
    return out
