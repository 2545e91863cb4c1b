"""`--check` compares a sharded run with a single-device one; dropout would draw
different masks on the two sides (and on each rank) and fail a correct plan.
Both sides therefore run in eval mode, which turns off every dropout (nn.Dropout
modules and the functional dropout of transformers' attention, which reads
`self.training`) and any other training-only randomness (router jitter); the
report says so, naming the dropout that was turned off.
"""

from __future__ import annotations

from torch import nn

_DROPOUT_TYPES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def active_dropout(model: nn.Module) -> list[str]:
    """The dropout `model` would apply in training mode: `Dropout modules (N, p=0.1)`,
    `attention_dropout=0.1` for each dropout-like float attribute of its modules or config."""
    found: dict[str, None] = {}
    probabilities = sorted({m.p for m in model.modules() if isinstance(m, _DROPOUT_TYPES) and m.p > 0})
    count = sum(1 for m in model.modules() if isinstance(m, _DROPOUT_TYPES) and m.p > 0)
    if count:
        found[f"{count} Dropout module{'s' if count > 1 else ''} (p={', '.join(f'{p:g}' for p in probabilities)})"] = None
    sources = [getattr(model, "config", None), *model.modules()]
    for source in sources:
        for name, value in (vars(source).items() if source is not None else ()):
            if ("dropout" in name or "jitter" in name) and isinstance(value, float) and not isinstance(value, bool) and value > 0:
                found[f"{name}={value:g}"] = None
    return list(found)


def for_check(model: nn.Module) -> str | None:
    """Put `model` in eval mode for `--check`; the note for the report, None when
    the model has no dropout to turn off."""
    dropout = active_dropout(model)
    model.eval()
    if not dropout:
        return None
    return (
        "--check ran both sides in eval mode, so dropout is off (it draws different masks on each side): "
        + ", ".join(dropout[:4]) + (" ..." if len(dropout) > 4 else "")
    )
