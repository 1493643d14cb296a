"""What a replica rank reads from its environment: its group, the group count, the lighthouse."""

from __future__ import annotations

import importlib.util
import logging
import os

from pipeline.errors import PipeConfigError

__all__ = ["LIGHTHOUSE_ENV", "LOG_ENV", "NUM_REPLICAS_ENV", "REPLICA_ID_ENV", "check_installed",
           "read_environment", "warnings_to_stderr"]

# torchft's own names: its lighthouse address, and the replica group variables its torchx
# launcher sets, so a job started by torchft's tools or by ours reads the same environment.
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
REPLICA_ID_ENV = "REPLICA_GROUP_ID"
NUM_REPLICAS_ENV = "NUM_REPLICA_GROUPS"
_INSTALL = "pip install 'pipeline-engine[ft]' (or: pip install 'torchft>=0.2,<0.3')"
# Set by the launcher: the library's warnings (a step averaged over fewer replicas, a step not
# committed) reach stderr even where the script configures no logging.
LOG_ENV = "PIPELINE_FT_LOG"


def check_installed(what: str) -> None:
    """Raise PipeConfigError saying what to install when torchft is missing."""
    if importlib.util.find_spec("torchft") is None:
        raise PipeConfigError(f"{what} needs torchft, which is not installed: {_INSTALL}")


def read_environment() -> tuple[int, int, str]:
    """This process's replica id, the number of replicas and the lighthouse, from the
    environment (set by `python -m pipeline.launch --replicas R`, or by hand under torchrun)."""
    names = (REPLICA_ID_ENV, NUM_REPLICAS_ENV, LIGHTHOUSE_ENV)
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        raise PipeConfigError(
            f"Pipe(fault_tolerance=True) runs as one of several replica groups and reads "
            f"{', '.join(names)} from the environment; {', '.join(missing)} not set. Start it "
            f"with `python -m pipeline.launch --replicas R --nproc N script.py`, or set them "
            f"(one torchrun per replica group, the lighthouse from `python -m "
            f"pipeline.replica_launch --record`; see docs/fault-tolerance.md)")
    replica, count = os.environ[REPLICA_ID_ENV], os.environ[NUM_REPLICAS_ENV]
    if not (replica.isdigit() and count.isdigit() and int(replica) < int(count)):
        raise PipeConfigError(
            f"{REPLICA_ID_ENV} must be an integer in [0, {NUM_REPLICAS_ENV}) and "
            f"{NUM_REPLICAS_ENV} a positive integer; got {REPLICA_ID_ENV}={replica!r}, "
            f"{NUM_REPLICAS_ENV}={count!r}: set them to this group's index and the group count")
    return int(replica), int(count), os.environ[LIGHTHOUSE_ENV]


def warnings_to_stderr() -> None:
    """The library's warnings on stderr, once, where the script set up no logging."""
    logger = logging.getLogger("pipeline")
    if not any(not isinstance(h, logging.NullHandler) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(
            f"%(name)s (replica group {os.environ.get(REPLICA_ID_ENV)}, rank "
            f"{os.environ.get('RANK')}): %(levelname)s: %(message)s"))
        handler.setLevel(logging.WARNING)
        logger.addHandler(handler)
