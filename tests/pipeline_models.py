"""Models for tests/test_pipeline_apply.py (`--model pipeline_models:FN`, with tests/ on
PYTHONPATH)."""

from __future__ import annotations

import torch

from tpplan.models.llama import Transformer, rotary_table


class ScaledEmbeddings(Transformer):
    """tpplan's Llama whose forward scales the embeddings itself, between two modules
    (as Gemma once did): a pipeline stage runs the model's forward, so every stage
    after the first scales the hidden states again, and only `--check` can tell."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.config
        rope = rotary_table(tokens.shape[1], cfg.dim // cfg.n_heads, cfg.rope_theta, device=tokens.device)
        h = self.tok_embeddings(tokens) * cfg.dim ** 0.5
        for layer in self.layers:
            h = layer(h, rope)
        return self.output(self.norm(h))


def scaled_embeddings() -> ScaledEmbeddings:
    from tpplan.models.llama import LlamaConfig

    return ScaledEmbeddings(LlamaConfig())


def four_layers() -> Transformer:
    """tpplan's tiny Llama with 4 blocks: a pipeline of 4 stages whose two middle ones are alike."""
    from tpplan.models.llama import LlamaConfig

    return Transformer(LlamaConfig(n_layers=4))


def fourteen_layers() -> Transformer:
    """tpplan's tiny Llama with 14 blocks: two stages of 7, each long enough for its repeated blocks to be simulated once."""
    from tpplan.models.llama import LlamaConfig

    return Transformer(LlamaConfig(n_layers=14))
