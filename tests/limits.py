"""Time limits for tests that start processes.

They are hang guards, never expected durations: on a loaded machine (two cores shared with other
jobs) a few ranks that each import torch can take a minute just to start, so the limits are
generous. A limit is reached only when something hangs, so a passing run never waits for one.
Tests that check how fast a failure is found bound the time from the failure itself (or compare
it with a timeout far above the bound), not from the start of the processes.
"""

from __future__ import annotations

# spawn(timeout=...): every rank's result, process start-up included.
SPAWN_TIMEOUT = 240.0
# pytest's limit for a test marked `dist` that sets none (tests/conftest.py): one spawn and its
# joins, so that spawn itself reports which rank hung.
DIST_TEST_TIMEOUT = 300
# Several scenarios in turn on one spawn (tests/pipeline/in_turn.py): a guard for them all, and
# pytest's limit for the test that starts them (the others read their results).
IN_TURN_TIMEOUT = 600.0
IN_TURN_TEST_TIMEOUT = 660
