"""`--model hf:SPEC`: the transformers causal LM of a local configuration, built
from the config alone (under the caller's `torch.device`, so on the meta device
it costs nothing). Nothing is downloaded.

SPEC is a HuggingFace model directory (with `config.json`), a `config.json`
file, or a transformers model type (`llama`, `qwen2`: that type's default
configuration).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

PREFIX = "hf:"


class HFSpecError(ValueError):
    """SPEC names no readable configuration (a usage error)."""


def is_hf_ref(ref: str) -> bool:
    return ref.startswith(PREFIX)


def factory(ref: str) -> Callable[[], Any]:
    """A zero-argument factory for `ref` ("hf:SPEC"); the configuration is read now,
    so a bad SPEC fails before any model is built."""
    spec = ref[len(PREFIX):]
    config = load_config(spec)
    return functools.partial(causal_lm, config)


def config_remarks_off():
    """transformers' warnings while it reads a configuration (a RoPE factor that does
    not match the context lengths, gpt-oss's tiny config): remarks on the model's
    numerics, while tpplan reads only its shapes, printed on a run that succeeds.
    Its errors still show."""
    import logging

    from ..core.quiet import loggers_quiet

    return loggers_quiet("transformers", level=logging.ERROR)


def load_config(spec: str):
    try:
        import transformers
    except ImportError:
        raise HFSpecError("--model hf:... needs transformers (pip install tpplan[hf])") from None
    if not spec:
        raise HFSpecError("--model hf: needs a model directory, a config.json or a model type, e.g. hf:./llama or hf:llama")
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise HFSpecError(f"--model hf:{spec}: the directory has no config.json")
    if path.is_file() or spec.endswith(".json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except OSError as exc:
            raise HFSpecError(f"--model hf:{spec}: cannot read {path}: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise HFSpecError(f"--model hf:{spec}: {path} is not JSON: {exc}") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise HFSpecError(f"--model hf:{spec}: {path} has no model_type (not a transformers config.json)")
        from huggingface_hub.errors import StrictDataclassError  # a config field of the wrong type

        try:  # transformers' own reader: it decodes what its writer encodes (`{"__float__": "Infinity"}`)
            with config_remarks_off():
                return transformers.AutoConfig.from_pretrained(str(path))
        except StrictDataclassError as exc:
            raise HFSpecError(f"--model hf:{spec}: {path}: {' '.join(str(exc).split())}") from None
        except (ValueError, KeyError) as exc:
            raise HFSpecError(f"--model hf:{spec}: {path}: {str(exc).splitlines()[0]}") from None
    if os.sep in spec or spec.startswith("."):
        raise HFSpecError(f"--model hf:{spec}: no such directory or file")
    try:
        with config_remarks_off():
            return transformers.AutoConfig.for_model(spec)
    except ValueError:
        known = sorted(transformers.CONFIG_MAPPING.keys())
        import difflib

        close = difflib.get_close_matches(spec, known, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise HFSpecError(f"--model hf:{spec}: not a directory, a config.json or a transformers model type{hint}") from None


def causal_lm(config):
    """AutoModelForCausalLM from `config`, with SDPA attention (as tpplan.hf_models)
    where the model supports it, else eager (gpt-oss: transformers refuses SDPA)."""
    import transformers

    if getattr(config, "_attn_implementation", None) in (None, ""):
        model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
        config._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    return transformers.AutoModelForCausalLM.from_config(config)
