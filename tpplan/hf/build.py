"""`--model hf:SPEC`: the transformers causal LM of a local configuration, built
from the config alone (under the caller's `torch.device`, so on the meta device
it costs nothing). Nothing is downloaded.

SPEC is a HuggingFace model directory (with `config.json`), a `config.json`
file, or a transformers model type (`llama`, `qwen2`: that type's default
configuration).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .config import HfConfigError, load_config

PREFIX = "hf:"


def is_hf_ref(ref: str) -> bool:
    return ref.startswith(PREFIX)


def factory(ref: str) -> Callable[[], Any]:
    """A zero-argument factory for `ref` ("hf:SPEC"); the configuration is read now
    (hf.config, as import-hf reads it), so a bad SPEC fails (HfConfigError) before any
    model is built."""
    spec = ref[len(PREFIX):]
    if not spec:
        raise HfConfigError("--model hf: needs a model directory, a config.json or a model type, e.g. hf:./llama or hf:llama")
    config = load_config(spec, label=f"--model hf:{spec}")
    return functools.partial(causal_lm, config)


def causal_lm(config):
    """AutoModelForCausalLM from `config`, with SDPA attention (as tpplan.models.hf)
    where the model supports it, else eager (gpt-oss: transformers refuses SDPA)."""
    import transformers

    if getattr(config, "_attn_implementation", None) in (None, ""):
        model_class = transformers.AutoModelForCausalLM._model_mapping.get(type(config), None)
        config._attn_implementation = "sdpa" if getattr(model_class, "_supports_sdpa", True) else "eager"
    return transformers.AutoModelForCausalLM.from_config(config)
