"""The planner's choice against every configuration of its space, each measured alike.

`python -m benchmarks.planning` runs it (`run.main`): the space (`space`), measurement rounds
(`rounds`), calibration of the cost model (`calibrate`), statistics (`stats`), the recorded
results (`record`) and their report (`report`).
"""

__all__: list[str] = []
