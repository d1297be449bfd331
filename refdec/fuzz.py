"""python -m refdec.fuzz runs the command refdec.commands.fuzz (docs/layout.md)."""
from .commands.fuzz import main

if __name__ == "__main__":
    raise SystemExit(main())
