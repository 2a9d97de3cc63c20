"""Benchmarks (`pdcluster bench ...`): each runs pdcluster and its peer in one process and
reports ratios. `gpu_check` is the one short proof run on a lent GPU machine (no Ray there)."""
