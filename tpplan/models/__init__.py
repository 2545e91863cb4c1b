"""Reference models for plans, tests and `--model tpplan.models.llama:tiny`."""
