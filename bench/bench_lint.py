"""Model-aware validate at depth: a 50-rule plan against Llama models of 250, 500
and 1,000 layers, at TP 2, 4 and 8.

    python bench/bench_lint.py [--layers 250 500 1000] [--runs 3] [--check]

Times `check_model` (what `tpplan validate --model` runs after building the
model: strict resolution, every lint rule, the traced forward and the dry run)
on a fresh meta-device model per run, so nothing is cached across runs; the
model build is timed apart. Prints the time per size, the time per layer, and
how the time grows from the smallest to the largest size (linear: the ratio of
times equals the ratio of layers). Goal: under 5 s at 1,000 layers, growing
linearly (--check exits 1 when the largest size takes more than GOAL_S, or
grows more than 1.5x faster than linearly).
"""

from __future__ import annotations

import sys

from _common import arguments, exit_code, median, timed, within

GOAL_S = 5.0
TP_SIZES = [2, 4, 8]

# Eight disjoint groups of layers by last digit: the plan works at any depth >= 10.
LAYER_GROUPS = ["*0", "*1", "*2", "*3", "*4", "*5", "*[67]", "*[89]"]
PER_LAYER_RULES = {
    "attention": "{style: prepare_module_input, input_layouts: [replicate, null], desired_input_layouts: [replicate, null], use_local_output: false}",
    "attention.w{q,k,v}": "colwise",
    "attention.wo": "rowwise",
    "feed_forward": "{style: prepare_module_input, input_layouts: replicate, desired_input_layouts: replicate, use_local_output: false}",
    "feed_forward.w{1,3}": "colwise",
    "feed_forward.w2": "rowwise",
}


def plan_text() -> str:
    rules = [f"  layers.{group}.{target}: {style}" for group in LAYER_GROUPS for target, style in PER_LAYER_RULES.items()]
    rules += ["  tok_embeddings: {style: rowwise, input_layouts: replicate}", "  output: {style: colwise, output_layouts: replicate}"]
    return "\n".join(["version: 1", "name: bench-lint", "rules:", *rules]) + "\n"


def build(n_layers: int):
    import torch

    from tpplan.models.llama import LlamaConfig, Transformer

    with torch.device("meta"):
        return Transformer(LlamaConfig(dim=128, n_heads=16, n_kv_heads=8, ffn_hidden=256, vocab_size=128, n_layers=n_layers))


def main() -> int:
    parser = arguments(__doc__, check=f"above {GOAL_S:.0f} s or on super-linear growth")
    parser.add_argument("--layers", type=int, nargs="+", default=[250, 500, 1000])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from tpplan import load_plan
    from tpplan.lint.checks import check_model

    plan = load_plan(text=plan_text(), file="bench.yaml")
    print(f"plan: {len(plan.rules)} rules; TP degrees {TP_SIZES}; median of {args.runs} runs, fresh model each")
    check_model(plan, build(10), TP_SIZES)  # warm-up: imports, first-call costs
    results = {}
    for n_layers in args.layers:
        builds, lints, problems = [], [], None
        for _ in range(args.runs):
            model, build_s = timed(lambda: build(n_layers))
            problems, lint_s = timed(lambda: check_model(plan, model, TP_SIZES))
            builds.append(build_s)
            lints.append(lint_s)
        errors = [p for p in problems if p.severity == "error"]
        assert not errors, f"the bench plan should validate cleanly: {errors[0]}"
        lint, modules = median(lints), sum(1 for _ in model.named_modules())
        results[n_layers] = lint
        print(
            f"{n_layers:5d} layers ({modules:6d} modules): validate {lint:6.2f} s = {lint / n_layers * 1e3:5.2f} ms/layer"
            f"   (model build {median(builds):5.2f} s, {len(problems)} warnings)"
        )
    small, large = min(results), max(results)
    growth = (results[large] / results[small]) / (large / small)
    print(f"growth {small} -> {large} layers: x{results[large] / results[small]:.2f} for x{large / small:.0f} layers "
          f"({growth:.2f} of linear)")
    print(f"goal: < {GOAL_S:.0f} s at {large} layers -> {results[large] / GOAL_S:.2f} of the goal")
    return exit_code(args.check, within(results[large], GOAL_S) and within(growth, 1.5))


if __name__ == "__main__":
    sys.exit(main())
