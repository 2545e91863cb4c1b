"""core/local_shapes: every rank's share of a DTensor is torch's own cut
(`_compute_local_shape_and_global_offset`), asked once per placement cut rather than
once per rank (FSDP over thousands of dp_shard ranks times tp)."""

import itertools
import random

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from tpplan.core.local_shapes import shapes_on_mesh


def _torch_shapes(shape, mesh, placements):
    return tuple(tuple(_compute_local_shape_and_global_offset(shape, mesh, list(coord), list(placements), skip_offset=True)[0])
                 for coord in itertools.product(*(range(extent) for extent in mesh)))


def test_every_rank_as_torch_cuts_it_uneven_and_packed_shards_included():
    rng = random.Random(0)
    checked = 0
    for _ in range(1000):
        shape = tuple(rng.choice([1, 2, 3, 5, 7, 8, 12, 16, 48, 100]) for _ in range(rng.randint(1, 3)))
        mesh = tuple(rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 3)))
        placements = []
        for _ in mesh:
            kind, dim = rng.random(), rng.randrange(len(shape))
            placements.append(Replicate() if kind < 0.25 else Partial() if kind < 0.3 else Shard(dim) if kind < 0.65
                              else _StridedShard(dim, split_factor=rng.choice([2, 3, 4, 8])))
        assert shapes_on_mesh(shape, mesh, placements) == _torch_shapes(shape, mesh, placements), (shape, mesh, placements)
        checked += 1
    assert checked == 1000


def test_fsdp_over_tp_at_thousands_of_ranks():
    # the 405B's embedding rows (128256, not a multiple of 2048 x 8) under FSDP over dp_shard 2048 x tp 8
    placements = (_StridedShard(0, split_factor=8), Shard(0))
    shapes = shapes_on_mesh((128256, 16384), (2048, 8), placements)
    assert len(shapes) == 16384 and set(shapes) == {(8, 16384), (0, 16384)}
    # torch's own answer at a few coordinates
    for coord in [(0, 0), (1, 7), (1002, 3), (2047, 7)]:
        want = _compute_local_shape_and_global_offset((128256, 16384), (2048, 8), list(coord), list(placements), skip_offset=True)[0]
        assert shapes[coord[0] * 8 + coord[1]] == tuple(want)
