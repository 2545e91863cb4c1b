"""`tpplan init` over transformers' causal-LM families, the way tests/test_hf_sweep.py
sweeps transformers' own plans: for each model type, a tiny model (tpplan.models.hf_any),
`init` at TP 2 and 4, and where transformers has a TP plan, that plan dry-run beside it.

A family passes when the inferred plan passes `--check` at both degrees, prove dropped
no rule for a module that transformers' plan shards, and at TP 4 the inferred plan
holds no more parameter bytes per rank and runs no more backward collectives (their
total count, over every kind: what the dry run counts) than transformers' plan (init's
default keeps to that plan where it leaves a module whole: tpplan/init/within.py).
Otherwise the sweep records the first gap; OUTCOMES lists the known true ones (with
transformers 5.24), so a regression, or a gap that closes, fails here. Families
transformers cannot build or run on a tiny config skip with the reason.

One family runs by default (FAST); every other is `slow` (`pytest -m slow`): 0.5-80 s a
family on a quiet machine once transformers is imported (all 196 in 10 min 21 s, one
process); `python tests/test_init_sweep.py [--shard-more] [--timeout S] [TYPE...]` prints the table.
"""

from __future__ import annotations

import sys
import time
import warnings
from dataclasses import dataclass, field

import pytest

transformers = pytest.importorskip("transformers")

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402
from families import family_params  # noqa: E402

SKIPS = ("does not build", "does not run", "needs --inputs")
PASS = "pass"

# model type -> the gap the sweep finds (its `gap` text starts so); a family not listed must pass
OUTCOMES: dict[str, str] = {
    # transformers' own plan is wrong here (activation sparsity takes the mean and std over the features it
    # shards: TP321, confirmed by --check's TP505, tests/test_hf_sweep.py): init rightly leaves those MLPs whole
    "gemma3n_text": "dropped 10 module(s) transformers shards",
}
SHARD_MORE = False  # the table's `--shard-more`: init sharding all it proves, not keeping to transformers' plan
FAST = ["llama"]  # ~1-3 s once transformers is imported (test_hf_sweep's default families import it)


@dataclass
class Row:
    model_type: str
    status: str = PASS  # pass | a skip reason | the first gap found
    text: str = ""
    passed: dict = field(default_factory=dict)  # degree -> whether --check passed
    rank_bytes: int | None = None  # at TP 4
    total_bytes: int | None = None
    backward: int | None = None  # backward collectives (count, every kind) at TP 4
    theirs_bytes: int | None = None  # transformers' plan at TP 4
    theirs_backward: int | None = None
    theirs: str = ""  # "no TP plan" | "fails: ..." | ""
    dropped: list = field(default_factory=list)
    lint: list = field(default_factory=list)  # the lint's warning codes on init's own plan
    seconds: float = 0.0

    @property
    def fraction(self) -> float | None:
        return self.rank_bytes / self.total_bytes if self.rank_bytes is not None and self.total_bytes else None


def backward_collectives(comms: dict) -> int:
    return sum((comms or {}).get("backward", {}).values())


def sweep(model_type: str) -> Row:
    import torch

    from tpplan.core.problems import PlanError
    from tpplan.models.hf_any import build, tiny_config
    from tpplan.init import run_init
    from tpplan.simulation.modelref import ModelRefError

    row = Row(model_type)
    start = time.perf_counter()
    try:
        return _sweep(row, model_type, torch, PlanError, build, tiny_config, run_init, ModelRefError)
    finally:
        row.seconds = time.perf_counter() - start


def _sweep(row, model_type, torch, PlanError, build, tiny_config, run_init, ModelRefError) -> Row:
    from tpplan.init.within import sharded_modules

    try:  # transformers' own config checks and constructor on a shrunk config: not tpplan's to judge
        tiny_config(model_type)
        with torch.device("meta"):
            meta = build(model_type)
    except Exception as exc:  # whatever transformers raises for its own config: recorded as the skip's reason
        row.status, row.text = "does not build", f"{type(exc).__name__}: {exc}"
        return row
    ref = f"tpplan.models.hf_any:{model_type.replace('-', '_')}"
    try:
        inferred = run_init(lambda: build(model_type), ref=ref, tp=[2, 4], shard_more=SHARD_MORE)
    except ModelRefError as exc:  # a multimodal model's first module is no Embedding: a usage error, true
        row.status, row.text = "needs --inputs", str(exc)
        return row
    except PlanError as exc:
        first = exc.problems[0]
        if first.code == "TP500":  # the tiny model fails on one device: no plan to judge
            row.status = "does not run"
        elif first.code == "TP329" and "cannot make default inputs" in first.message:
            row.status = "needs --inputs"  # a multimodal model's first module is no Embedding
        elif first.code == "TP329":  # its forward fails on the default inputs without any plan (meta, fake, real)
            row.status = "does not run"
        else:
            row.status = f"init {first.code}"
        row.text = str(first)
        return row
    results = inferred.proven.results
    row.passed = {d: bool(results.get(d) and results[d].check and results[d].check.get("passed")) for d in (2, 4)}
    row.dropped = [(d.rule, d.why) for d in inferred.proven.dropped]
    row.lint = [p.code for p in inferred.proven.lint_warnings]
    if 4 in results:
        ours = results[4]
        row.rank_bytes, row.total_bytes, row.backward = ours.rank_bytes, ours.total_bytes, backward_collectives(ours.comms)
    theirs, their_text = _transformers_at_4(meta, ref, model_type, build)
    gaps = []
    if not all(row.passed.values()):
        gaps.append(f"--check fails at TP {[d for d, ok in row.passed.items() if not ok]}")
    if theirs is None:
        row.theirs = "no TP plan"
    elif theirs.check is not None and theirs.check.get("passed") is False:
        row.theirs = f"fails: {theirs.check.get('error', '')}"
    else:
        row.theirs_bytes, row.theirs_backward = theirs.rank_bytes, backward_collectives(theirs.comms)
    if theirs is not None and not row.theirs:  # transformers' plan runs: what it shards is what init must keep
        shard = sharded_modules(their_text, meta)
        lost = sorted({m for d in inferred.proven.dropped for m in d.modules if m in shard})
        if lost:
            why = next(d.why for d in inferred.proven.dropped if set(d.modules) & shard)
            gaps.append(f"dropped {len(lost)} module(s) transformers shards ({lost[0]}, ...): {' '.join(why.split())[:200]}")
        if row.theirs_bytes is not None and row.rank_bytes is not None:
            if row.rank_bytes > row.theirs_bytes:
                gaps.append(f"more bytes per rank at TP 4 ({row.rank_bytes} > {row.theirs_bytes})")
            if row.backward > row.theirs_backward:
                gaps.append(f"more backward collectives at TP 4 ({row.backward} > {row.theirs_backward})")
    if "TP328" in row.lint:  # the flow stopped: part of init's own plan unchecked by the lint (coverage, TP360, is a judgement)
        gaps.append(f"TP328 on init's own plan ({row.lint.count('TP328')})")
    if gaps:
        row.status, row.text = "gap", "; ".join(gaps)
    return row


def _transformers_at_4(meta, ref, model_type, build):
    """The figures of transformers' own plan at TP 4 (init's compare, at the one degree
    compared: a dry run on fake tensors) and its text; (None, None) when it has no plan."""
    from tpplan.init.compare import figures, transformers_plan
    from tpplan.init.prove import Target

    if not getattr(getattr(meta, "config", None), "base_model_tp_plan", None):
        return None, None
    text = transformers_plan(meta)
    if text is None:
        return None, None
    return figures(Target(meta, ref, lambda: build(model_type), check=False), text, [4], lambda event: None)[4], text


@pytest.mark.usefixtures("no_process_group_leaks")
@pytest.mark.parametrize("model_type", family_params(FAST))
def test_init_proves_a_plan_no_costlier_than_transformers(model_type):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = sweep(model_type)
    if row.status in SKIPS and model_type not in OUTCOMES:
        pytest.skip(f"{model_type}: {row.status} ({row.text[:200]})")
    expected = OUTCOMES.get(model_type)
    if expected is None:
        assert row.status == PASS, row.text
    else:
        assert row.status == "gap" and row.text.startswith(expected), row.text


def _cell(value) -> str:
    return "" if value is None else str(value)


class _Timeout(BaseException):  # not an Exception: the dry run's own handlers must not take it for the model's failure
    pass


def _alarm(signum, frame):
    raise _Timeout()


if __name__ == "__main__":  # python tests/test_init_sweep.py [--shard-more] [--timeout S] [TYPE...]: a table row per family
    import signal

    args = sys.argv[1:]
    if args[:1] == ["--shard-more"]:
        SHARD_MORE, args = True, args[1:]
    limit = 0
    if args[:1] == ["--timeout"]:
        limit, args = int(args[1]), args[2:]
    signal.signal(signal.SIGALRM, _alarm)
    print("| type | status | TP2 | TP4 | rank/total bytes TP4 | bwd ours/transformers | bytes ours/transformers | lint | s | detail |")
    for model_type in args or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        start = time.perf_counter()
        signal.alarm(limit)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                row = sweep(model_type)
        except _Timeout:
            row = Row(model_type, "timeout", f"over {limit} s", seconds=time.perf_counter() - start)
        except BaseException as exc:  # noqa: BLE001 -- the table records a crash and goes on to the next family
            if isinstance(exc, KeyboardInterrupt):
                raise
            row = Row(model_type, "crash", f"{type(exc).__name__}: {exc}", seconds=time.perf_counter() - start)
        finally:
            signal.alarm(0)
        frac = f"{row.rank_bytes}/{row.total_bytes} ({row.fraction:.3f})" if row.fraction is not None else ""
        bwd = f"{_cell(row.backward)}/{_cell(row.theirs_backward) or row.theirs[:40]}"
        byt = f"{_cell(row.rank_bytes)}/{_cell(row.theirs_bytes)}"
        detail = row.text.splitlines()[0][:240] if row.text else (f"dropped: {[d[0] for d in row.dropped]}" if row.dropped else "")
        print(f"| {model_type} | {row.status} | {_cell(row.passed.get(2))} | {_cell(row.passed.get(4))} | {frac} | {bwd} | "
              f"{byt} | {' '.join(row.lint)} | {row.seconds:.1f} | {detail} |", flush=True)
