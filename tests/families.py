"""Every transformers causal-LM model type as a pytest parameter, for the sweeps over them
(test_hf_sweep, test_init_sweep, test_verdicts): `slow` unless named by the sweep's default list."""

from __future__ import annotations

from collections.abc import Collection, Iterator

import pytest


def family_params(default: Collection[str]) -> Iterator:
    pytest.importorskip("transformers")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        yield pytest.param(model_type, marks=() if model_type in default else (pytest.mark.slow,), id=model_type)
