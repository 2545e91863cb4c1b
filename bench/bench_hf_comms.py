"""Collectives per training step: transformers' own TP plan vs tpplan's shipped plans.

For each model family (tiny random-weight configs from tpplan.models.hf, 2
layers) and TP degree, one forward and one backward are run in one process
under torch's fake process group, and the collectives are counted:

- `transformers`: transformers' plan on transformers' own runtime
  (`tpplan.hf.transformers_runtime.apply_transformers_plan`), as `from_pretrained(tp_plan="auto")`;
- `hf->tpplan`: the same plan imported with `tpplan.hf.importer.import_hf`;
- `ours`: plans/hf/<family>_tp.yaml (and `ours SP`: <family>_tp_sp.yaml).

Prints a table and the backward ratio transformers / ours. Run:
    python bench/bench_hf_comms.py [--tp 2 4] [--family llama ...]
"""

from __future__ import annotations

import sys
import tempfile

from _common import ROOT, arguments

from tpplan.models import hf as hf_models  # no torch at import: the factories import it when called

PLANS = ROOT / "plans" / "hf"
FAMILIES = ("llama", "qwen2", "mistral", "qwen2_moe")
SHORT = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A", "broadcast": "BC"}


def step_collectives(family: str, tp: int, apply) -> tuple[dict, dict]:
    """(forward, backward) collectives of one step of `family` parallelized by `apply(model, mesh)`."""
    import torch

    from tpplan.simulation.simulate import count_collectives, default_inputs, simulated_world, tp_mesh

    torch.manual_seed(0)
    with simulated_world(tp):
        model = hf_models.FACTORIES[family]("sdpa")
        apply(model, tp_mesh(tp))
        # Summed by SPEC name: transformers mixes functional (all_reduce) and c10d (allreduce_) ops.
        comms = count_collectives(model, default_inputs(model, generator=torch.Generator().manual_seed(0)))
    return comms["forward"], comms["backward"]


def _fmt(counts: dict) -> str:
    return " ".join(f"{counts[k]}{SHORT[k]}" for k in SHORT if counts.get(k)) or "-"


def _total(counts: dict) -> int:
    return sum(counts.values())


def main() -> int:
    parser = arguments(__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--family", nargs="+", default=list(FAMILIES), choices=sorted(hf_models.FACTORIES))
    args = parser.parse_args()

    from tpplan import load_plan
    from tpplan.hf.importer import import_hf
    from tpplan.hf.transformers_runtime import apply_transformers_plan

    columns = ["transformers", "hf->tpplan", "ours", "ours SP"]
    print(f"collectives per step (forward / backward), {hf_models.TINY['num_hidden_layers']} layers")
    print(f"{'family':<11}{'tp':>3}  " + "".join(f"{c:<28}" for c in columns) + "bwd ratio (transformers/ours)")
    for family in args.family:
        with tempfile.TemporaryDirectory() as config_dir:
            hf_models.FACTORIES[family]().config.save_pretrained(config_dir)
            imported = load_plan(text=import_hf(config_dir).text)
        shipped = {
            "ours": PLANS / f"{family.removesuffix('_tied')}_tp.yaml",
            "ours SP": PLANS / f"{family.removesuffix('_tied')}_tp_sp.yaml",
        }
        appliers = {
            "transformers": apply_transformers_plan,
            "hf->tpplan": lambda m, mesh: imported.apply(m, mesh),
        }
        for column, path in shipped.items():
            if path.exists():
                plan = load_plan(path)
                appliers[column] = lambda m, mesh, plan=plan: plan.apply(m, mesh)
        for tp in args.tp:
            cells, results = [], {}
            for column in columns:
                if column not in appliers:
                    cells.append("n/a")
                    continue
                try:
                    results[column] = step_collectives(family, tp, appliers[column])
                    fwd, bwd = results[column]
                    cells.append(f"{_fmt(fwd)} / {_fmt(bwd)}")
                except Exception as exc:  # a runtime that cannot run this family: say so, keep going
                    cells.append(f"fails: {type(exc).__name__}")
            ratio = (
                f"{_total(results['transformers'][1]) / _total(results['ours'][1]):.2f}x"
                if "transformers" in results and "ours" in results
                else "n/a"
            )
            print(f"{family:<11}{tp:>3}  " + "".join(f"{c:<28}" for c in cells) + ratio)
    print(
        "AR all_reduce, AG all_gather, RS reduce_scatter. Not counted: SP norm-weight gradients\n"
        "left Partial (reduced at the optimizer step). MoE: transformers shards the routed experts\n"
        "(+1 AR forward, +2 backward per layer); tpplan keeps them whole on every rank (no torch\n"
        "style shards fused 3-D expert weights). transformers' runtime cannot run tied models\n"
        "built this way (named_parameters() hides lm_head.weight, so it stays a plain tensor)."
    )
    return 0  # no goal: a comparison table


if __name__ == "__main__":
    sys.exit(main())
