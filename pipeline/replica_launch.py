"""`python -m pipeline.replica_launch`: the replica launcher's command under its first name."""

from __future__ import annotations

from pipeline.replicas.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
