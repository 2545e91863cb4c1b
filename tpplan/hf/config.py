"""Reading a transformers configuration from what a user names: a model directory
(with `config.json`), a `config.json` file, or a transformers model type (`llama`:
that type's default configuration). The one reader behind `import-hf SOURCE` and
`--model hf:SPEC`; nothing is downloaded.

Input that names no readable configuration raises `HfConfigError` (a
`ValueError`), its message led by the caller's name for the source (`label`).
"""

from __future__ import annotations

import difflib
import json
import os
from pathlib import Path

__all__ = ["HfConfigError", "config_remarks_off", "load_config"]


class HfConfigError(ValueError):
    """The source names no configuration tpplan can read (the user's error)."""


def config_remarks_off():
    """transformers' warnings while it reads a configuration (a RoPE factor that does
    not match the context lengths, gpt-oss's tiny config): remarks on the model's
    numerics, while tpplan reads only its shapes, printed on a run that succeeds.
    Its errors still show."""
    import logging

    from ..core.quiet import loggers_quiet

    return loggers_quiet("transformers", level=logging.ERROR)


def load_config(source: str | os.PathLike, label: str | None = None):
    """The transformers config `source` names (a directory, a config file by any name,
    or a model type). `label`: how messages name the source (default: the source quoted)."""
    try:
        import transformers
    except ImportError:
        raise HfConfigError(f"{_label(source, label)}: reading a transformers config needs transformers (pip install 'tpplan[hf]')") from None

    spec = os.fspath(source)
    named = _label(spec, label)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            raise HfConfigError(f"{named}: the directory has no config.json")
    if path.is_file() or spec.endswith(".json"):
        _check_json(path, named)
        from huggingface_hub.errors import StrictDataclassError  # a config field of the wrong type

        try:  # transformers' own reader: it decodes what its writer encodes (`{"__float__": "Infinity"}`)
            with config_remarks_off():
                return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
        except StrictDataclassError as exc:
            raise HfConfigError(f"{named}: {path}: {' '.join(str(exc).split())}") from None
        except (OSError, ValueError, KeyError) as exc:  # transformers' words for a malformed config
            raise HfConfigError(f"{named}: {path}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
    if os.sep in spec or spec.startswith("."):
        raise HfConfigError(f"{named}: no such directory or file")
    try:
        with config_remarks_off():
            return transformers.AutoConfig.for_model(spec)
    except ValueError:
        close = difflib.get_close_matches(spec, sorted(transformers.CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise HfConfigError(
            f"{named}: neither a config path nor a transformers model type (a model directory or a config.json; "
            f"a type as 'llama', 'qwen2'){hint}"
        ) from None


def _label(source: str | os.PathLike, label: str | None) -> str:
    return label if label is not None else repr(os.fspath(source))


def _check_json(path: Path, named: str) -> None:
    """A readable JSON object with a model_type: transformers' own errors for anything
    else name neither the file nor what is wrong with it."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise HfConfigError(f"{named}: cannot read {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise HfConfigError(f"{named}: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise HfConfigError(f"{named}: {path} has no model_type (not a transformers config.json)")
