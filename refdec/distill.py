"""python -m refdec.distill runs the command refdec.commands.distill (docs/layout.md)."""
from .commands.distill import main

if __name__ == "__main__":
    raise SystemExit(main())
