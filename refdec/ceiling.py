"""python -m refdec.ceiling runs the command refdec.commands.ceiling (docs/layout.md)."""
from .commands.ceiling import main

if __name__ == "__main__":
    raise SystemExit(main())
