"""The simulation substrate: one fake world, the fallback ladder, located runs, model building, block identity."""
