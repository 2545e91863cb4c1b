"""torchtitan 0.2.2's MoE forward edited so that spmd_types 0.3.1 can type it: what its
user would have to change in the model for the checker to reach the router.

spmd_types has no rule that takes a partial sum (P) through an integer index
(`__setitem__`, `__getitem__` and `index_select` all refuse it) nor through a dtype
cast (`float()`, `to()`), and the MoE's unsort does the first and its scoring the
second on the experts' partial output. The edit: the unsort runs unchecked and its
result is declared P (what it is: a permutation of a partial sum), and the two casts,
no-ops on the float32 test models, are dropped. Six lines of the model.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import textwrap
from collections.abc import Iterator

import spmd_types as spmd

_UNSORT = re.compile(r"routed_output_unsorted = torch\.zeros\(.*?\)\n\s*"
                     r"routed_output_unsorted\[token_indices_experts_sorted\] = routed_output", re.S)
_CHECKED_UNSORT = ("with spmd.no_typecheck():\n"
                   "        routed_output_unsorted = torch.zeros((bs * slen * self.router.top_k, dim), dtype=routed_output.dtype)\n"
                   "        routed_output_unsorted[token_indices_experts_sorted] = routed_output\n"
                   "    spmd.assert_type(routed_output_unsorted, spmd.P)")
_CASTS = (("routed_output_unsorted.float(),", "routed_output_unsorted,"), (".to(x.dtype)\n            .squeeze(1)", ".squeeze(1)"))


@contextlib.contextmanager
def edited_titan_moe() -> Iterator[None]:
    """torchtitan's MoE.forward, edited as above, for the duration."""
    from tpplan.models.titan import titan  # torchtitan's modules without triton (CPU)

    moe = titan("models.moe.moe")
    original = moe.MoE.forward
    source, count = _UNSORT.subn(_CHECKED_UNSORT, textwrap.dedent(inspect.getsource(original)))
    for old, new in _CASTS:
        count += source.count(old)
        source = source.replace(old, new)
    if count != 3:
        raise RuntimeError(f"torchtitan's MoE.forward is not the 0.2.2 one this edit is for ({count} of 3 places found)")
    namespace: dict = {}
    # the module's own globals (its torch is the one tpplan.models.titan swaps in for CPU), plus spmd_types
    moe.spmd = spmd
    exec(compile(source, moe.__file__, "exec"), moe.__dict__, namespace)  # noqa: S102  (the edited method)
    moe.MoE.forward = namespace["forward"]
    try:
        yield
    finally:
        moe.MoE.forward = original
        del moe.spmd
