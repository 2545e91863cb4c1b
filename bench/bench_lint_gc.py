"""The cyclic garbage collector during model-aware validate, side by side in one run:
paused for the whole `check_model` call (tpplan before issue 9), paused only around the
trace and the flow analysis (now: `lint.context.collector_paused`), or never paused.

    python bench/bench_lint_gc.py [--layers 250 1000] [--runs 3]

Same plan and models as bench_lint.py; a fresh meta-device model per run, the three
variants alternating, medians. Prints each variant's time and its ratio to the first.
"""

from __future__ import annotations

import contextlib
import gc
import sys

from _common import arguments, median, seconds
from bench_lint import TP_SIZES, build, plan_text


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--layers", type=int, nargs="+", default=[250, 1000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from tpplan import load_plan
    from tpplan.lint import context
    from tpplan.lint.checks import check_model

    paused = context.collector_paused
    plan = load_plan(text=plan_text(), file="bench.yaml")
    check_model(plan, build(10), TP_SIZES)  # warm-up

    def whole(model):
        with paused():
            check_model(plan, model, TP_SIZES)

    def scoped(model):
        check_model(plan, model, TP_SIZES)

    def never(model):
        context.collector_paused = contextlib.nullcontext
        try:
            check_model(plan, model, TP_SIZES)
        finally:
            context.collector_paused = paused

    variants = {"whole call": whole, "trace+flow": scoped, "never": never}
    for n_layers in args.layers:
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.runs):
            for name, run in variants.items():
                model = build(n_layers)
                gc.collect()
                times[name].append(seconds(lambda: run(model)))
                del model
        base = median(times["whole call"])
        print(f"{n_layers:5d} layers: " + ", ".join(
            f"{name} {median(t):5.2f} s (x{median(t) / base:.2f})" for name, t in times.items()
        ), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
