"""verl's fully-async recipe: the rollout pool streams work units; staleness and sync cadence by async_training.*."""
