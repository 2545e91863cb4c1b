"""`tpplan fit` (SPEC §9): the layouts of a world, their checks, bounds, exact dry runs and ranking."""
