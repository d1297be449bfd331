"""python -m refdec.stepcost runs the command refdec.commands.stepcost (docs/layout.md)."""
from .commands.stepcost import main

if __name__ == "__main__":
    raise SystemExit(main())
