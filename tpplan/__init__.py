"""tpplan: declarative tensor-parallel plans for PyTorch DTensor.

Exports load on first use (PEP 562): `import tpplan` imports neither torch nor
pydantic, so the CLI decides what its command needs, and plan-only validation
never pays for torch.
"""

__version__ = "0.1.0"

_EXPORTS = {
    "load_plan": "core.loader",
    "Plan": "core.plan",
    "Rule": "core.plan",
    "PlanError": "core.problems",
    "Problem": "core.problems",
    "load_checkpoint": "checkpoint.load",
    "save_checkpoint": "checkpoint.save",
    "meta_parameters": "checkpoint.meta",
    "infer_plan": "init",
    "build_model": "simulation.modelref",
    "CheckpointError": "checkpoint.errors",
    "AsyncSave": "checkpoint.training.asyncsave",
    "param_groups": "simulation.training",
    "fit": "fitting.search",
    "FitResult": "fitting.result",
    **dict.fromkeys(
        [
            "NoParallel",
            "ColwiseParallel",
            "RowwiseParallel",
            "SequenceParallel",
            "PrepareModuleInput",
            "PrepareModuleOutput",
            "PrepareModuleInputOutput",
            "ParallelStyle",
        ],
        "sharding.styles",
    ),
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'tpplan' has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_EXPORTS])
