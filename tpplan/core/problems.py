"""Problems are data: every finding, from YAML syntax to model checks, is a Problem
until the edge (CLI, exception message) prints it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Fix:
    """An edit to a plan's rules that fixes what a finding says, carried by the finding (as
    ruff's `Diagnostic.fix`): the rule that finds the problem decides its fix, and the tools
    that write plans (`tpplan init`, `init --from`, `import-hf --minimal`) apply it as given.

    `add`: `key` is a module's fqn and `options` the whole value of the rule it gets;
    else `key` is the pattern of an existing rule and `options` the options set on it."""

    key: str
    options: Any
    add: bool
    why: str


@dataclass(frozen=True)
class Problem:
    code: str
    severity: Severity
    message: str
    file: str
    line: int  # 1-based
    column: int  # 1-based
    # the edits that fix it, where the rule is sure of them; not part of a problem's identity
    fixes: tuple[Fix, ...] = field(default=(), compare=False)

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}: {self.code} {self.message}"

    def to_dict(self) -> dict:
        out = asdict(self)
        if not self.fixes:
            del out["fixes"]  # SPEC §4's six keys, `fixes` only where a rule knows one
        return out


def error(code: str, message: str, file: str, line: int = 1, column: int = 1) -> Problem:
    return Problem(code, "error", message, file, line, column)


def warning(code: str, message: str, file: str, line: int = 1, column: int = 1) -> Problem:
    return Problem(code, "warning", message, file, line, column)


def sort_problems(problems: list[Problem]) -> list[Problem]:
    return sorted(problems, key=lambda p: (p.file, p.line, p.column, p.code))


class PlanError(Exception):
    """A plan (or the plan against a model) has problems. `.problems` holds them all."""

    def __init__(self, problems: list[Problem]):
        self.problems = sort_problems(list(problems))
        super().__init__("\n".join(str(p) for p in self.problems) or "invalid plan")

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]


def first_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The exception's first non-blank line, at most 300 characters. Prefixed with
    its class when `with_type`, or when that class is not a builtin one, whose name
    says more than its message (DataDependentOutputException: aten.x)."""
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    # A StyleInputError's message is whole (what is wrong; the fix): its class adds nothing.
    if lines and (with_type or (type(exc).__module__ != "builtins" and not isinstance(exc, StyleInputError))):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 300 else text[:297] + "..."


class ModelError(Exception):
    """Raised on purpose by tpplan code about the user's model or plan (a style given
    an input it cannot take, a model output without floats): located like the
    errors torch raises, never shown as a tpplan bug."""


class StyleInputError(ModelError, ValueError):
    """A style given a module or an input it cannot take (expert_parallel on experts
    that the degree does not divide, colwise with heads on a module that is not a
    Linear, experts called without routing indices): the plan's or the model's
    error. The runtime reports it at the rule that names the style (TP501 while
    sharding, TP502 in the forward), exit 1. A ValueError too, for callers of the
    styles' helpers that catch one.

    `what`: what is wrong, naming the module; `fix`: what to change."""

    def __init__(self, what: str, fix: str):
        super().__init__(f"{what}; {fix}")
        self.what, self.fix = what, fix

    def __reduce__(self):  # pickled with both fields (torchrun ranks send errors to each other)
        return type(self), (self.what, self.fix)


_MODELS = "tpplan.models"  # the one place of the package whose code is model code, not tpplan's


def raised_by_tpplan(exc: BaseException) -> bool:
    """Whether `exc` is a tpplan bug: not one of the typed errors tpplan raises on
    purpose about the user's plan or model (`ModelError`: a `StyleInputError` from a
    style, a model output without floats), and raised by tpplan's own code, that is,
    its innermost frame runs in a module of the tpplan package outside `tpplan.models`.
    The reference models shipped there are models like the user's, by where they live
    (docs/layout.md): a torch op failing on a line of their forward is the model's."""
    if isinstance(exc, ModelError):
        return False
    tb = exc.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals
    package = module.get("__package__") or module.get("__name__") or ""
    model_code = package == _MODELS or package.startswith(_MODELS + ".")
    return package.split(".")[0] == "tpplan" and not model_code


def reason(exc: BaseException) -> str:
    """What went wrong, for a problem's message: a StyleInputError's whole message
    (what is wrong and the fix, never cut), else the exception's first line."""
    if isinstance(exc, StyleInputError):
        return f"{exc.what}; {exc.fix}"
    return first_line(exc)
