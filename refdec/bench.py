"""python -m refdec.bench runs the command refdec.commands.bench (docs/layout.md)."""
from .commands.bench import main

if __name__ == "__main__":
    raise SystemExit(main())
