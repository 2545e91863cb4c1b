"""transformers' attention masks on fake tensors as on the real run's tensors.

Without an attention mask and a cache (training), transformers 5 looks for packed
sequences in the position ids (`masking_utils.find_packed_sequence_indices`): where
none is packed it lets SDPA run causal with no mask at all. On fake tensors it cannot
read the ids, takes them as packed, and builds a (q, kv) mask per call that the real
run never makes: a dry run of a transformers model at seq 1024 then planned 20.2 MiB
of activations for the 11.7 MiB one device measures (Qwen3-MoE tiny, AdamW), and the
experts-over-ep layout 2.09× its measured peak.

`real_run_masks()` answers the question as the real run of the dry run's inputs does:
those are token ids alone, so the model numbers the positions itself (0, 1, ...) and
nothing is packed. Position ids with values are still looked at, so nothing changes
outside fake tensors, and the replacement stays for the rest of the process (as
hf.grouped_mm's kernel does). A model fed packed position ids by `--inputs` would be
planned without their mask.
"""

from __future__ import annotations

import sys


def real_run_masks() -> None:
    """Take fake position ids as unpacked (see the module's docstring), once transformers'
    masks are loaded; nothing where they are not (called again after a model is built)."""
    masking = sys.modules.get("transformers.masking_utils")
    original = getattr(masking, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "tpplan_real_run", False):
        return
    from torch._subclasses.fake_tensor import is_fake

    def find_packed_sequence_indices(position_ids):
        return None if is_fake(position_ids) else original(position_ids)

    find_packed_sequence_indices.tpplan_real_run = True
    masking.find_packed_sequence_indices = find_packed_sequence_indices
