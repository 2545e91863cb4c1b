"""On a successful run, stderr holds tpplan's own lines only: no warning, log line or
traceback of torch or transformers reaches the user (a crash-looking traceback on an
exit-0 run is read as a crash).

The commands run in-process (typer's CliRunner); what a terminal would show besides
CliRunner's own stderr is gathered too: Python warnings under the interpreter's
default filters (pytest's own recording would swallow them) and the output of every
logging handler (torch's and transformers' handlers hold the stream they were made
with, not CliRunner's).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tpplan.cli.app import app

ROOT = Path(__file__).resolve().parent.parent
LLAMA_PLAN = str(ROOT / "plans" / "llama_tp.yaml")
LLAMA = ("--model", "tpplan.models.llama:tiny")
MLP_PLAN = str(ROOT / "plans" / "mlp_tp.yaml")
MLP = ("--model", "tpplan.models.mlp:tiny")


@contextlib.contextmanager
def terminal_stderr() -> Iterator[io.StringIO]:
    """What reaches a user's stderr besides sys.stderr writes: warnings, shown as the
    interpreter's default filters would, and every logging handler's output."""
    gathered = io.StringIO()
    loggers = [logging.getLogger(), *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger))]
    streams = {h: h.stream for logger in loggers for h in logger.handlers
               if isinstance(h, logging.StreamHandler) and not isinstance(h, (logging.FileHandler, logging._StderrHandler))}
    last_resort = logging.StreamHandler(gathered)  # what logging.lastResort prints for a logger without handlers
    last_resort.setLevel(logging.WARNING)
    for handler in streams:
        handler.stream = gathered  # not setStream: it flushes the old stream, maybe a closed CliRunner one
    logging.getLogger().addHandler(last_resort)
    once = getattr(logging.Logger, "warning_once", None)  # transformers' once-per-process warnings: once per command here
    if once is not None and hasattr(once, "cache_clear"):
        once.cache_clear()
    shown = warnings.showwarning
    try:
        with warnings.catch_warnings():
            warnings.resetwarnings()  # Python's default filters (python -W default is not the user's)
            warnings.simplefilter("default")
            for category in (ResourceWarning, ImportWarning, PendingDeprecationWarning, DeprecationWarning):
                warnings.filterwarnings("ignore", category=category)
            warnings.filterwarnings("default", category=DeprecationWarning, module="__main__")
            warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: gathered.write(
                warnings.formatwarning(message, category, filename, lineno, line))
            yield gathered
    finally:
        warnings.showwarning = shown
        logging.getLogger().removeHandler(last_resort)
        for handler, stream in streams.items():
            handler.stream = stream


def run_gathered(*args: str):
    """CliRunner's result of `tpplan ARGS` and the stderr lines a user would see."""
    with terminal_stderr() as gathered:
        result = CliRunner().invoke(app, list(args), env={"FORCE_COLOR": None, "NO_COLOR": None})
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result, (result.stderr + gathered.getvalue()).splitlines()


def stderr_of(*args: str) -> tuple[int, list[str]]:
    """Exit code and the stderr lines a user would see of `tpplan ARGS`."""
    result, lines = run_gathered(*args)
    return result.exit_code, lines


def test_the_gathering_sees_what_torch_logs_and_warns():
    # the helper itself: a warning and a torch log line are seen, so an empty stderr means none
    with terminal_stderr() as gathered:
        warnings.warn("a user warning", UserWarning)
        logging.getLogger("torch._subclasses.fake_tensor").error("failed while attempting to run meta for aten.x")
    assert "UserWarning: a user warning" in gathered.getvalue()
    assert "failed while attempting to run meta for aten.x" in gathered.getvalue()


@pytest.mark.parametrize("args", [
    ("validate", MLP_PLAN, *MLP),
    ("apply", "--plan", MLP_PLAN, *MLP, "--dry-run", "--tp", "2"),
], ids=["validate", "dry-run"])
def test_a_successful_run_prints_nothing_on_stderr(args):
    code, lines = stderr_of(*args)
    assert code == 0
    assert lines == []


@pytest.mark.slow
@pytest.mark.parametrize("args", [
    ("validate", LLAMA_PLAN, *LLAMA),
    ("apply", "--plan", LLAMA_PLAN, *LLAMA, "--dry-run", "--tp", "2", "--check"),
    ("apply", "--plan", LLAMA_PLAN, *LLAMA, "--dry-run", "--tp", "2", "--memory-limit", "1GiB", "--dtype", "bf16"),
], ids=["validate", "dry-run-check", "dry-run-memory"])
def test_a_successful_run_on_llama_prints_nothing_on_stderr(args):
    code, lines = stderr_of(*args)
    assert code == 0
    assert lines == []


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory):
    pytest.importorskip("transformers")
    from tpplan.models.hf_any import tiny_config

    root = tmp_path_factory.mktemp("hf")
    from tpplan.core.quiet import loggers_quiet

    with warnings.catch_warnings(), loggers_quiet("transformers"):  # making the tiny configs is not a command under test
        warnings.simplefilter("ignore")
        for model_type in ("gpt_oss", "jamba"):
            tiny_config(model_type).save_pretrained(root / model_type)
    return root


@pytest.mark.slow
def test_transformers_remarks_on_a_config_or_a_missing_kernel_do_not_reach_the_user(tiny_configs, tmp_path):
    # gpt-oss's tiny config: "The explicitly set RoPE scaling factor ... does not match" (import-hf,
    # validate); jamba without mamba_ssm: "falling back to its reference PyTorch implementation"
    # (validate, dry run): remarks on numerics and speed, while the plan needs shapes only
    for model_type in ("gpt_oss", "jamba"):
        config, plan = str(tiny_configs / model_type), str(tmp_path / f"{model_type}.yaml")
        code, lines = stderr_of("import-hf", config, "-o", plan)
        assert code == 0 and all(line.startswith(("added: ", "left out: ")) for line in lines), lines
        for args in (("validate", plan, "--model", f"hf:{config}"),
                     ("apply", "--plan", plan, "--model", f"hf:{config}", "--dry-run", "--tp", "2")):
            code, lines = stderr_of(*args)
            assert (code, lines) == (0, []), (args, lines)


ODD = '''\
import torch
from torch import nn


class Rotary(nn.Module):  # a complex table, as torchtitan's freqs_cis
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.register_buffer("freqs", torch.polar(torch.ones(16), torch.arange(16.0)), persistent=False)

    def forward(self, x):
        return self.down(self.up(x)) * torch.view_as_real(self.freqs)[:, 1]


class MadeInForward(nn.Module):  # a module made inside forward: freed before its backward
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)

    def forward(self, x):
        return self.down(nn.GELU()(self.up(x)))


class Func(nn.Module):  # a function as a module, as the kernels package makes one (use_kernel_forward_from_hub)
    def forward(self, x, own=None):
        return own(x) if own is not None else x * torch.sigmoid(x)


SILU = Func()


class KernelizedFunction(nn.Module):  # kernels' use_kernelized_func: its own copy of the function, not a child
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.__dict__["_kernel_funcs"] = {"silu": Func()}

    def forward(self, x):
        return self.down(SILU(self.up(x), self._kernel_funcs["silu"]))  # the global one calls this module's copy
'''
ODD_PLAN = "version: 1\nrules:\n  up: colwise\n  down: rowwise\n"


@pytest.fixture
def odd(tmp_path, monkeypatch):
    (tmp_path / "odd_models.py").write_text(ODD)
    (tmp_path / "odd.yaml").write_text(ODD_PLAN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(tmp_path / "odd.yaml")


def test_check_keeps_a_complex_buffer_complex(odd):
    # Module.to(float32) would cast the table to real ("Casting complex values to real
    # discards the imaginary part"): the check would run a model that is not the user's
    code, lines = stderr_of("apply", "--plan", odd, "--model", "odd_models:Rotary", "--dry-run", "--tp", "2", "--check")
    assert (code, lines) == (0, [])


def test_a_module_freed_before_its_backward_is_a_note_not_torchs_warning(odd):
    result, lines = run_gathered("apply", "--plan", odd, "--model", "odd_models:MadeInForward", "--dry-run", "--tp", "2", "--memory-limit", "1GiB")
    assert (result.exit_code, lines) == (0, [])
    assert ("note: the backward of 1 module(s) freed after their forward (made inside another's forward) is counted in "
            "the totals but not attributed to a module: torch's ModTracker skips them") in result.stdout


def test_a_function_module_held_outside_the_children_reaches_no_module_tracker_warning(odd):
    # transformers 5.25 with kernels >= 0.19.1: each attention holds its own copy of the global function module
    # rotary_pos_emb (both of class Func) in `_kernel_funcs`; torch's ModTracker named both "Func", read the global
    # one's call into the copy as a module entering itself, and warned "The module hierarchy tracking maybe be
    # messed up. Please file a bug to PyTorch" once per layer of a memory plan
    model = ("--model", "odd_models:KernelizedFunction")
    result, lines = run_gathered("apply", "--plan", odd, *model, "--dry-run", "--tp", "2", "--memory-limit", "1GiB")
    assert (result.exit_code, lines) == (0, [])


@pytest.mark.slow
def test_a_memory_plan_of_a_transformers_model_reaches_no_module_tracker_warning():
    pytest.importorskip("transformers")
    qwen3 = ("--plan", str(ROOT / "plans" / "hf" / "qwen3_tp.yaml"), "--model", "tpplan.models.hf:qwen3")
    result, lines = run_gathered("apply", *qwen3, "--dry-run", "--tp", "2", "--memory-limit", "1GiB")
    assert (result.exit_code, lines) == (0, [])
