"""The planner's choice against every configuration of its space, each measured alike.

`python -m benchmarks.planning` runs it (`main`): the space (`space`), measurement rounds
(`rounds`), calibration of the cost model (`calibrate`), statistics (`stats`), the recorded
results (`record`) and their report (`report`).
"""

from benchmarks.planning.run import main

__all__ = ["main"]
