"""Memory planning: one training step under torch's MemTracker, repeated blocks simulated once, the report's memory data."""
