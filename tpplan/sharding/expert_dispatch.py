"""Token dispatch for the expert-parallel styles (expert_parallel.py): which rows each
rank's experts compute, and how their results come back.

all_reduce (`route_local` / `combine_local`): every rank holds every token. Of the T*k
(token, expert) pairs the rank computes only those routed to its E/n experts, as
transformers' experts forward does on one device (gather each expert's tokens, index_add
the weighted results back): summed over the ranks, the experts compute T*k rows, not
T*E. The rank's sum is partial; the style all-reduces it.

all_to_all (`dispatch` / `combine`), torchtitan-style
(`torchtitan/distributed/expert_parallel.py`: `_token_dispatch` / `_token_combine`).
Each rank holds its own tokens (e.g. a sequence shard) and E/n whole experts. One call:

1. the rank's (token, expert) pairs, T*k of them, are sorted by expert; per-expert counts
   go to every rank with one `all_to_all_single` (rank r learns how many rows of each of
   its local experts every source rank sends);
2. the rows (copies of the token's hidden state) travel with one `all_to_all_single` of
   uneven splits to the rank holding their expert (autograd-aware: its backward is the
   reverse all-to-all);
3. the module's own forward runs its local experts on the rows it received (top-1, weight 1);
4. the results travel back with one more `all_to_all_single`, are unsorted and combined
   with the routing weights on the rank that owns the tokens.

Per call: forward 3 all-to-alls (counts, tokens, results), backward 2. Every gradient is
exact without a further collective: expert weights get the gradient of every token routed
to them on the rank that holds them, hidden states and routing weights stay local.

A simulated world (torch's fake process group, the dry run and the lint) moves no data,
so the other ranks' counts are unknown there: routing is taken as balanced (each rank
sends an equal share of its rows to every rank) for shapes and collective counts.
LocalTensorMode (one process holding every rank's values) cannot run it at all: the
split sizes differ per rank; parity is checked on real ranks (torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from ..core.problems import ModelError

__all__ = [
    "Routed", "dispatch", "combine", "UnsimulatableDispatch", "rank_values", "route_local", "combine_local",
    "counts_argument", "route_sorted", "combine_sorted",
]


class UnsimulatableDispatch(ModelError, NotImplementedError):
    """all_to_all dispatch under LocalTensorMode: per-rank split sizes cannot be simulated."""


@dataclass
class Routed:
    """What `combine` needs from `dispatch`: the sort of the (token, expert) pairs,
    the split sizes of the token all-to-all and the routing weights [T, k]."""

    order: torch.Tensor
    input_splits: list[int] | None
    output_splits: list[int] | None
    weights: torch.Tensor


def rank_values(mesh: DeviceMesh, values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A 1-element tensor holding values[rank] on each rank, without a collective
    (each rank cuts its own element), so that it works in a simulated world too."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.tensor(values, dtype=like.dtype, device=like.device)
    return distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None).to_local()


def _values_unknown(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


def _capacity(counts: torch.Tensor, pairs: int, num_experts: int) -> int | None:
    """Rows per local expert where every rank must run one program with the same shapes,
    else None (a real rank computes exactly its rows). Without values (fake or meta
    tensors: the dry run's shapes) routing is taken as balanced, as `dispatch` does;
    under LocalTensorMode (every rank's values in one process) it is the largest count
    of any rank's expert, the others padded with rows of weight 0."""
    if _values_unknown(counts):
        return -(-pairs // num_experts)
    from torch.distributed._local_tensor import LocalTensor, enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is None:
        return None
    peaks: list[int] = []

    def peak(rank: int, value: torch.Tensor) -> torch.Tensor:
        peaks.append(int(value.max()) if value.numel() else 0)
        return value

    if isinstance(counts, LocalTensor):
        mode.tensor_map(counts, peak)  # read each rank's counts; no collective
    else:
        peak(0, counts)
    return max(peaks)


def route_local(
    hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, mesh: DeviceMesh, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """all_reduce dispatch: of the tokens `hidden` [T, H] routed to `index` [T, k] with
    `weights` [T, k], the rows this rank's experts compute, grouped by expert: (rows
    [N, H], local expert [N, 1], routing weight [N, 1], token of each row [N])."""
    ranks, top_k = mesh.size(), index.shape[-1]
    local = num_experts // ranks
    pairs = index.reshape(-1)  # [T*k], token-major
    offset = rank_values(mesh, [float(r * local) for r in range(ranks)], weights).to(pairs.dtype)
    expert = pairs - offset
    mine = (expert >= 0) & (expert < local)
    key = torch.where(mine, expert, torch.full_like(expert, local))  # other ranks' pairs sort last
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(local + 1, dtype=torch.int64, device=pairs.device)
    counts = counts.scatter_add(0, key.to(torch.int64), torch.ones_like(key, dtype=torch.int64))[:local]
    flat_weights = weights.reshape(-1)
    per = _capacity(counts, pairs.numel(), num_experts)
    if per is None:
        chosen = order[: int(counts.sum())]
        local_expert = key[chosen]
        weight = flat_weights[chosen]
    else:
        slot = torch.arange(per, device=pairs.device)
        starts = counts.cumsum(0) - counts
        valid = (slot < counts[:, None]).reshape(-1)
        chosen = order[(starts[:, None] + slot).reshape(-1).clamp(max=pairs.numel() - 1)]
        local_expert = torch.arange(local, device=pairs.device).repeat_interleave(per)
        weight = torch.where(valid, flat_weights[chosen], torch.zeros_like(flat_weights[chosen]))
    token = chosen // top_k
    rows = hidden.reshape(-1, hidden.shape[-1])[token]
    return rows, local_expert.to(index.dtype).unsqueeze(-1), weight.unsqueeze(-1), token


def combine_local(output: torch.Tensor, token: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """This rank's share of the experts' output, shaped like `hidden`: each row's weighted
    result [N, H] added to its token (as transformers' experts forward does)."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    total = torch.zeros(flat.shape, dtype=hidden.dtype, device=hidden.device)
    return total.index_add(0, token, output.to(hidden.dtype)).view(hidden.shape)


def _in_local_tensor_mode() -> bool:
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    return enabled_local_tensor_mode() is not None


def _balanced(rows: int, ranks: int) -> list[int]:
    base, extra = divmod(rows, ranks)
    return [base + (1 if r < extra else 0) for r in range(ranks)]


def dispatch(
    hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, mesh: DeviceMesh, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, Routed]:
    """Send this rank's tokens [T, H] (routed to experts `index` [T, k]) to the ranks holding
    their experts. Returns (rows received [N, H], their local expert [N], state for `combine`)."""
    if _in_local_tensor_mode():
        raise UnsimulatableDispatch(
            "expert_parallel with dispatch all_to_all cannot run with per-rank values in one process "
            "(LocalTensorMode): its split sizes differ per rank; check its parity under torchrun "
            "(tpplan apply --check without --dry-run)"
        )
    ranks, group = mesh.size(), mesh.get_group()
    local = num_experts // ranks
    tokens, top_k = index.shape
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = hidden[order // top_k]  # [T*k, H], grouped by expert, so by destination rank
    if dist.get_backend(group) == "fake":
        splits = _balanced(tokens * top_k, ranks)
        received = funcol.all_to_all_single(torch.zeros(ranks * local, dtype=torch.int64, device=flat.device), None, None, group)
        funcol.wait_tensor(received)  # the count exchange, as on real ranks
        expert = torch.arange(sum(splits), device=flat.device) % local
        routed = Routed(order, splits, splits, weights)
    else:
        counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))
        with torch.no_grad():
            received = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, group))  # [source rank, local expert]
        input_splits = counts.view(ranks, local).sum(1).tolist()
        output_splits = received.view(ranks, local).sum(1).tolist()
        experts = torch.arange(local, device=flat.device).repeat(ranks)
        expert = torch.repeat_interleave(experts, received)
        routed = Routed(order, input_splits, output_splits, weights)
    rows = funcol.all_to_all_single_autograd(rows, routed.output_splits, routed.input_splits, group)
    return rows, expert, routed


def combine(output: torch.Tensor, routed: Routed, mesh: DeviceMesh) -> torch.Tensor:
    """Send the experts' results [N, H] back to the ranks owning the tokens and sum each
    token's k results weighted by its routing weights: [T, H]."""
    back = funcol.all_to_all_single_autograd(output, routed.input_splits, routed.output_splits, mesh.get_group())
    tokens, top_k = routed.weights.shape
    inverse = torch.argsort(routed.order)
    pairs = back[inverse].view(tokens, top_k, -1)
    return (pairs * routed.weights.unsqueeze(-1).to(pairs.dtype)).sum(1)


def counts_argument(args: tuple, kwargs: dict, num_experts: int) -> bool:
    """Called as torchtitan's GroupedExperts: (x sorted by expert, num_tokens_per_expert),
    told by the second argument, a 1-D integer tensor of E counts."""
    counts = kwargs.get("num_tokens_per_expert", args[1] if len(args) > 1 else None)
    return (
        isinstance(counts, torch.Tensor)
        and counts.dim() == 1
        and counts.shape[0] == num_experts
        and not counts.is_floating_point()
        and not counts.is_complex()
    )


def route_sorted(
    x: torch.Tensor, counts: torch.Tensor, mesh: DeviceMesh, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """all_reduce dispatch of tokens already sorted by expert (torchtitan's call): every rank
    holds all of `x` [N, D] and `counts` [E]; its E/n experts' tokens are one slice of x.
    Returns (rows, local counts [E/n], row of x per row, 1/0 mask per row). Where every rank
    must run one program (LocalTensorMode) each local expert gets as many rows as the
    largest count of any rank's expert, the extra rows masked out; a real rank takes its
    slice exactly."""
    ranks = mesh.size()
    local = num_experts // ranks
    counts = counts.to(torch.int64)
    me = rank_values(mesh, [float(r) for r in range(ranks)], x).to(torch.int64)  # [1]
    starts = (counts.cumsum(0) - counts).view(ranks, local)[me].reshape(local)
    mine = counts.view(ranks, local)[me].reshape(local)
    per = _capacity(mine, x.shape[0], num_experts)
    if per is None:  # a real rank: exactly its rows
        start, total = int(starts[0]), int(mine.sum())
        row = torch.arange(start, start + total, device=x.device)
        return x[start : start + total], mine, row, torch.ones(total, 1, dtype=x.dtype, device=x.device)
    slot = torch.arange(per, device=x.device)
    valid = (slot < mine[:, None]).reshape(-1, 1).to(x.dtype)
    row = (starts[:, None] + slot).reshape(-1).clamp(max=max(x.shape[0] - 1, 0))
    padded = torch.full((local,), per, dtype=counts.dtype, device=x.device)
    return x[row], padded, row, valid


def combine_sorted(output: torch.Tensor, row: torch.Tensor, valid: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """This rank's share of the experts' output, shaped like x: its rows' results written
    to their places in a zero output (padding rows masked out); the style all-reduces it."""
    out = output[: row.shape[0]] * valid.to(output.dtype)
    total = torch.zeros((x.shape[0], output.shape[-1]), dtype=output.dtype, device=output.device)
    return total.index_add(0, row, out)
