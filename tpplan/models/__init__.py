"""The small models the README, the docs and the shipped plans name (`--model
tpplan.models.llama:tiny`): `llama`, `mlp`, `fused`, `rule_examples` (the lint rules'
documented examples), `hf` (named transformers families at a tiny config), `hf_any`
(any transformers causal-LM type, tiny) and `titan` (torchtitan's models, small).
Code here is model code, like the user's: an error raised on its lines is the model's,
not a tpplan bug (core.problems.raised_by_tpplan). They import torch only, and
transformers or torchtitan inside the factories that need them."""
