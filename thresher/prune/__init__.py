"""Expert pruning: REAP and its baselines (frequency, EAN, random), and applying an expert mask."""
