"""`tpplan fit`: choose a training job's parallel layout, ranked by a stated cost model (SPEC §9)."""
