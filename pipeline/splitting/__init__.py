"""Splitting a model into stages: partition, profiling, configuration and argument checks."""
