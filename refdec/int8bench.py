"""python -m refdec.int8bench runs the command refdec.commands.int8bench (docs/layout.md)."""
from .commands.int8bench import main

if __name__ == "__main__":
    raise SystemExit(main())
