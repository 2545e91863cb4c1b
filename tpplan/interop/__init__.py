"""Other frameworks' parallelism configs (SPEC §7, Interop): `export` writes a plan
as torchtitan's, transformers' or accelerate's config, `import_config` reads one
back as a version 2 plan, both from `frameworks`' tables of their fields. No torch."""
