"""python -m refdec <command> ...: the same command line as the installed `refdec` (refdec.commands)."""

from .commands import main

raise SystemExit(main())
