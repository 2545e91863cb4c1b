"""Strict resolution at scale: a 50-rule plan against a 1,000-layer model (12,005 modules).

    python bench/bench_resolve.py [--runs 20] [--torch] [--check]

Times `load_plan` of the plan text and `Plan.match` over the module names
(median of --runs). --torch also builds the same module tree as a real
1,000-layer Llama on the meta device (tpplan.models.llama) and times
`Plan.match(model)`, which walks `named_modules()` too. Goal: match well under
a second (--check exits 1 above GOAL_MS).
"""

from __future__ import annotations

import sys

from _common import arguments, exit_code, median_seconds, within

GOAL_MS = 1000.0
N_LAYERS = 1000

# Disjoint layer ranges as glob segments: 0-9, 10-49, 50-99, 100-399, 400-699, 700-999.
LAYER_RANGES = ["[0-9]", "[1-4]?", "[5-9]?", "[1-3]??", "[4-6]??", "[7-9]??"]
PER_LAYER_RULES = {
    "attention": "{style: prepare_module_input, input_layouts: [shard(1), null], desired_input_layouts: [replicate, null]}",
    "attention.w{q,k,v}": "colwise",
    "attention.wo": "{style: rowwise, output_layouts: shard(1)}",
    "attention_norm": "sequence_parallel",
    "ffn_norm": "sequence_parallel",
    "feed_forward": "{style: prepare_module_input, input_layouts: shard(1), desired_input_layouts: replicate}",
    "feed_forward.w{1,3}": "colwise",
    "feed_forward.w2": "{style: rowwise, output_layouts: shard(1)}",
}


def plan_text() -> str:
    rules = [f"  layers.{layers}.{target}: {style}" for layers in LAYER_RANGES for target, style in PER_LAYER_RULES.items()]
    rules += ["  tok_embeddings: {style: rowwise, input_layouts: replicate, output_layouts: shard(1)}", "  '**.norm': sequence_parallel"]
    return "\n".join(["version: 1", "name: bench-1000-layers", "rules:", *rules]) + "\n"


def module_names(n_layers: int = N_LAYERS) -> list[str]:
    """`named_modules()` order of tpplan.models.llama.Transformer with `n_layers` layers."""
    names = ["", "tok_embeddings", "layers"]
    for i in range(n_layers):
        layer = f"layers.{i}"
        names += [layer, f"{layer}.attention_norm", f"{layer}.attention", *(f"{layer}.attention.w{x}" for x in "qkvo")]
        names += [f"{layer}.ffn_norm", f"{layer}.feed_forward", *(f"{layer}.feed_forward.w{x}" for x in "123")]
    return names + ["norm", "output"]


def median_ms(fn, runs: int) -> float:
    return median_seconds(fn, runs) * 1000


def main() -> int:
    parser = arguments(__doc__, check=f"if match takes more than {GOAL_MS:.0f} ms")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--torch", action="store_true", help="also time match() on a real meta-device model")
    args = parser.parse_args()

    from tpplan import load_plan

    text, names = plan_text(), module_names()
    plan = load_plan(text=text, file="bench.yaml")
    matched = plan.match(names)  # raises if any rule matched nothing or two rules overlap
    print(f"plan: {len(plan.rules)} rules; model: {len(names)} modules, {len(matched)} matched")

    load_ms = median_ms(lambda: load_plan(text=text, file="bench.yaml"), args.runs)
    match_ms = median_ms(lambda: plan.match(names), args.runs)
    print(f"load_plan:            {load_ms:8.2f} ms (median of {args.runs})")
    print(f"match(names):         {match_ms:8.2f} ms = {match_ms * 1000 / len(names):.2f} us/module")
    worst = match_ms
    if args.torch:
        import torch

        from tpplan.models.llama import LlamaConfig, Transformer

        with torch.device("meta"):
            model = Transformer(LlamaConfig(n_layers=N_LAYERS))
        assert [n for n, _ in model.named_modules()] == names, "the synthetic names drifted from the Llama model"
        model_ms = median_ms(lambda: plan.match(model), args.runs)
        print(f"match(meta model):    {model_ms:8.2f} ms = {model_ms * 1000 / len(names):.2f} us/module (incl. named_modules)")
        worst = max(worst, model_ms)
    print(f"goal: match < {GOAL_MS:.0f} ms -> {worst / GOAL_MS:.3f} of the goal")
    return exit_code(args.check, within(worst, GOAL_MS))


if __name__ == "__main__":
    sys.exit(main())
