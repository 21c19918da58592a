"""Helpers for the tests that run under a real single-node SLURM (see cluster.py)."""
