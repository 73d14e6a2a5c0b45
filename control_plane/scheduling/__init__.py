"""Scheduling: the per-process scheduler, the queue by shape and the matcher, why a job waits,
wake-ups across replicas, the agents' claims and their completions."""
