"""python -m refdec.ctranslate2 runs the command refdec.commands.ctranslate2 (docs/layout.md)."""
from .commands.ctranslate2 import main

if __name__ == "__main__":
    raise SystemExit(main())
