"""One training step, as the dry run's memory planning, `apply --steps` and
`examples/train.py` all run it: the loss (cross-entropy for a token model,
inside torch's `loss_parallel()` when the plan asks for it), backward, and the
optimizer step.

A token model (its first module an `Embedding`) is trained on next-token
cross-entropy against random token targets; any other model on mean squared
error against random targets of its output's shape. With `loss_parallel`, the
logits stay a DTensor sharded on the vocabulary dim and the loss and its
backward run inside `torch.distributed.tensor.parallel.loss_parallel()`: no
rank ever holds the full-vocabulary logits.

Nothing here imports torch at import time (the CLI builds `TrainOptions`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..core.axes_spec import DP_AXES, TORCH_DTYPES
from ..core.problems import ModelError

if TYPE_CHECKING:
    import torch
    from torch import nn

OPTIMIZERS = ("adamw", "sgd", "none")
LEARNING_RATE = 1e-3


class TrainingError(ModelError, ValueError):
    """The plan or model cannot be trained as asked (e.g. loss_parallel without a sharded head):
    about the user's plan, located like torch's errors, never shown as a tpplan bug."""


@dataclass(frozen=True)
class TrainOptions:
    """What a training step looks like. None means "not given": the dry run plans
    memory only when one of these is set, and then fills in the defaults."""

    batch: int | None = None
    seq: int | None = None
    dtype: str | None = None  # bf16, fp16, fp32: the parameters' dtype
    optimizer: str | None = None  # adamw, sgd, none
    fsdp: int | None = None  # FSDP2 degree of the data-parallel mesh dim
    memory_limit: int | None = None  # bytes per rank
    global_batch: int | None = None  # a version 2 plan's training.global_batch: `batch_at` splits it
    from_plan: tuple[str, ...] = ()  # the fields a plan's training section filled (runtime/options.py's `with_training`)

    @property
    def plans_memory(self) -> bool:
        return any(v is not None for v in (self.batch, self.seq, self.dtype, self.optimizer, self.fsdp, self.memory_limit,
                                           self.global_batch))

    def batch_at(self, sizes: "Mapping[str, int]") -> int | None:
        """The batch of each data-parallel rank of a mesh of `sizes` ({axis: size}, an
        axis left out is 1): `batch` where given, else the plan's global batch split over
        dp_replicate·dp_shard (the plan's checks, TP123, refused one that does not
        divide), else None (the default inputs' batch)."""
        if self.batch is not None or self.global_batch is None:
            return self.batch
        return self.global_batch // data_ranks(sizes)

    @property
    def optimizer_name(self) -> str:
        return self.optimizer or "adamw"

    @property
    def dp(self) -> int:
        return self.fsdp or 1


def data_ranks(sizes: "Mapping[str, int]") -> int:
    """dp_replicate·dp_shard of a mesh of `sizes` (an axis left out is 1): the ranks a global batch is split over."""
    return math.prod(sizes.get(axis, 1) for axis in DP_AXES)


def torch_dtype(name: str | None) -> "torch.dtype | None":
    import torch

    return None if name is None else getattr(torch, TORCH_DTYPES[name])


def param_groups(model: "nn.Module") -> list[dict]:
    """The model's trainable parameters as optimizer parameter groups: the DTensors
    in one, the plain tensors (what no rule shards: a norm outside sequence
    parallelism) in another.

    torch's foreach and fused optimizers, the default on CUDA, update a group's
    tensors of one device and dtype in one call, and DTensor refuses a call that
    mixes DTensors with plain tensors ("got mixed torch.Tensor and DTensor"): a
    plan that leaves any parameter whole fails at the first step on a GPU, and
    only there (the CPU default is one tensor at a time). A group each keeps
    those calls apart at the same speed."""
    from torch.distributed.tensor import DTensor

    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [[p for p in trainable if isinstance(p, DTensor)], [p for p in trainable if not isinstance(p, DTensor)]]
    return [{"params": params} for params in groups if params]


def make_optimizer(name: str, model: "nn.Module", lr: float = LEARNING_RATE) -> "torch.optim.Optimizer | None":
    """AdamW, SGD, or None (`none`: forward and backward only)."""
    import torch

    params = param_groups(model)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "none":
        return None
    raise TrainingError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, not {name!r}")


def token_vocab(model: "nn.Module") -> int | None:
    """The vocabulary of a token model (first module with parameters an Embedding), else None."""
    from torch import nn

    for module in model.modules():
        if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None:
            return module.num_embeddings if isinstance(module, nn.Embedding) else None
    return None


def make_targets(model: "nn.Module", inputs: tuple, generator: "torch.Generator | None" = None) -> "torch.Tensor | None":
    """Random next-token targets shaped like the token inputs (token models), drawn
    on CPU from `generator` so every rank draws the same; None for other models
    (their MSE targets follow the output's shape, see `training_loss`)."""
    import torch

    vocab = token_vocab(model)
    if vocab is None:
        return None
    tokens = inputs[0]
    on_fake = _is_fake(tokens) or tokens.device.type == "meta"
    targets = torch.randint(0, vocab, tuple(tokens.shape), generator=None if on_fake else generator, device="cpu" if not on_fake else tokens.device)
    return targets.to(tokens.device)


def _is_fake(t: "torch.Tensor") -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def logits_of(output: Any) -> "torch.Tensor":
    from .simulate import output_tensors

    if hasattr(output, "logits"):
        return output.logits
    if not hasattr(output, "shape"):
        tensors = output_tensors(output)
        if not tensors:
            raise TrainingError(f"the model output ({type(output).__name__}) holds no floating-point tensor to train on")
        return tensors[0]
    return output


def check_loss_parallel_output(logits: "torch.Tensor") -> None:
    """loss_parallel needs the logits as a DTensor sharded on the vocabulary (last) dim."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(logits, DTensor):
        raise TrainingError(
            "the plan sets loss_parallel: true, but the model's output is a plain tensor: the head's rule must keep it "
            "a DTensor sharded on the vocabulary dim (colwise with output_layouts: shard(-1), use_local_output: false)"
        )
    shards = [p.dim % logits.ndim for p in logits.placements if isinstance(p, Shard)]
    if shards != [logits.ndim - 1]:
        raise TrainingError(
            f"the plan sets loss_parallel: true, but the model's output has placements {tuple(logits.placements)}: "
            f"loss_parallel needs it sharded on the last (vocabulary) dim, shard({logits.ndim - 1})"
        )


@contextlib.contextmanager
def loss_context(loss_parallel: bool) -> Iterator[None]:
    """torch's `loss_parallel()` when asked: the loss and its backward both run inside."""
    if not loss_parallel:
        yield
        return
    from torch.distributed.tensor.parallel import loss_parallel as torch_loss_parallel

    with torch_loss_parallel():
        yield


def training_loss(output: Any, targets: "torch.Tensor | None", loss_parallel: bool = False, generator: "torch.Generator | None" = None) -> "torch.Tensor":
    """Cross-entropy of the logits against token `targets`, or (targets None) mean
    squared error of every floating output against random targets (drawn from
    `generator`). With `loss_parallel` the logits must stay vocabulary-sharded;
    call this inside `loss_context(True)`."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from .simulate import output_tensors

    if targets is not None:
        logits = logits_of(output)
        if loss_parallel:
            check_loss_parallel_output(logits)
        elif isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten().to(logits.device))
    outputs = [t.full_tensor() if isinstance(t, DTensor) else t for t in output_tensors(output)]
    if not outputs:
        raise TrainingError(f"the model output ({type(output).__name__}) holds no floating-point tensor to train on")
    total = None
    for out in outputs:
        on_fake = _is_fake(out) or out.device.type == "meta"
        want = torch.randn(tuple(out.shape), generator=None if on_fake else generator, dtype=out.dtype, device="cpu" if not on_fake else out.device)
        loss = F.mse_loss(out.float(), want.to(out.device).float())
        total = loss if total is None else total + loss
    return total


def train_step(
    model: "nn.Module",
    inputs: tuple,
    targets: "torch.Tensor | None",
    optimizer: "torch.optim.Optimizer | None",
    loss_parallel: bool = False,
    seed: int = 0,
    zero_grad: bool = True,
) -> "torch.Tensor":
    """Forward, loss, backward and optimizer step; returns the (detached) loss.
    MSE targets are drawn from `seed`, the same in every step. `zero_grad=False`
    keeps the step's gradients for the caller to look at (and clear)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with loss_context(loss_parallel):
        loss = training_loss(model(*inputs), targets, loss_parallel, generator)
        loss.backward()
    if optimizer is not None:
        optimizer.step()
    if zero_grad:
        model.zero_grad(set_to_none=True)
    return loss.detach()


def loss_value(loss: "torch.Tensor") -> float:
    """The loss as a float; NaN on fake or meta tensors, which hold no value."""
    from torch.distributed.tensor import DTensor

    local = loss.to_local() if isinstance(loss, DTensor) else loss
    if _is_fake(local) or local.device.type == "meta":
        return float("nan")
    return float((loss.full_tensor() if isinstance(loss, DTensor) else loss).item())


def train_steps(
    model: "nn.Module",
    inputs: tuple,
    steps: int,
    optimizer_name: str = "adamw",
    loss_parallel: bool = False,
    seed: int = 0,
    synchronize=lambda: None,
    lr: float = LEARNING_RATE,
    after_step: "Callable[[int], None] | None" = None,
) -> tuple[list[float], list[float]]:
    """`steps` training steps on fixed inputs and targets; (losses, step seconds).
    `after_step(n)` runs after step n (untimed), before its gradients are cleared."""
    import torch

    optimizer = make_optimizer(optimizer_name, model, lr)
    targets = make_targets(model, inputs, torch.Generator().manual_seed(seed + 2))
    model.zero_grad(set_to_none=True)  # gradients of an earlier pass must not reach the first step
    losses, times = [], []
    for step in range(1, steps + 1):
        synchronize()
        start = time.perf_counter()
        loss = train_step(model, inputs, targets, optimizer, loss_parallel, seed + 3, zero_grad=after_step is None)
        synchronize()
        times.append(time.perf_counter() - start)
        losses.append(loss_value(loss))
        if after_step is not None:
            after_step(step)
            model.zero_grad(set_to_none=True)
    return losses, times


OPTIMIZER_NAMES = {"adamw": "AdamW", "sgd": "SGD", "none": "forward-backward"}
