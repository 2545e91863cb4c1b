"""Torch's and transformers' log records silenced around one call of tpplan's, never
for the rest of the user's program: the loggers' levels are restored on exit.

What is silenced is noise on a run that succeeds (a traceback torch logs for a fake
kernel the caller falls back from, a remark of transformers about a configuration
tpplan only reads shapes from); a record that means something for the user's result
is reworded as a tpplan problem or note by the caller instead.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator


@contextlib.contextmanager
def loggers_quiet(*names: str, level: int = logging.CRITICAL) -> Iterator[None]:
    """The loggers `names` (and their children that set no level of their own) drop
    records below `level` while the body runs."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, previous in zip(loggers, levels):
            logger.setLevel(previous)


# Remarks on how fast the model would run, not on what it computes, that a simulation
# on the CPU (the dry run, the lint's shape run) gets from every model whose optimized
# kernels this machine lacks (transformers' Mamba kernels: "falling back to its
# reference PyTorch implementation ... correct but much slower").
SIMULATION_REMARKS = ("transformers.integrations.hub_kernels",)


def simulation_remarks_off():
    """`SIMULATION_REMARKS` off (their errors still show); a decorator too."""
    return loggers_quiet(*SIMULATION_REMARKS, level=logging.ERROR)
