"""tpplan: declarative tensor-parallel plans for PyTorch DTensor.

`import tpplan` does not import torch (plan-only validation must stay fast);
the torch styles are loaded on first use.
"""

from .loader import load_plan
from .plan import Plan, Rule
from .problems import PlanError, Problem

__all__ = [
    "load_plan",
    "Plan",
    "Rule",
    "PlanError",
    "Problem",
    "NoParallel",
    "ColwiseParallel",
    "RowwiseParallel",
    "SequenceParallel",
    "PrepareModuleInput",
    "PrepareModuleOutput",
    "PrepareModuleInputOutput",
    "ParallelStyle",
]
__version__ = "0.1.0"

_STYLES = set(__all__[5:])


def __getattr__(name: str):
    if name in _STYLES:
        from . import styles

        return getattr(styles, name)
    raise AttributeError(f"module 'tpplan' has no attribute {name!r}")
