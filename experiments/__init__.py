"""Experiments: workloads, the engine (replay and serving protocols), bounds and reports."""
