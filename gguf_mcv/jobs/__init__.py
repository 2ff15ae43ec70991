"""Batch jobs: inputs and their keys, the results file, the resumable loop, and the same on Ray."""
