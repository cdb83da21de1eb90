"""`python -m realtime ...` is the `realtime` console script."""

from realtime.cli import main

raise SystemExit(main())
