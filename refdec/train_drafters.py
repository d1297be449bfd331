"""python -m refdec.train_drafters runs the command refdec.commands.train_drafters (docs/layout.md)."""
from .commands.train_drafters import main

if __name__ == "__main__":
    raise SystemExit(main())
