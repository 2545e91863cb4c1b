"""The `--check` engine: a tensor-parallel run against its one-device reference; the first difference, the module at fault, replicas that disagree."""
