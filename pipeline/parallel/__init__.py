"""Beside the pipeline: data parallelism, tied weights, clipping, loss scaling, agreement."""
