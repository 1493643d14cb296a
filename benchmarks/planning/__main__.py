"""`python -m benchmarks.planning`: the planning benchmark's command line."""

from benchmarks.planning import main

__all__: list[str] = []

raise SystemExit(main())
