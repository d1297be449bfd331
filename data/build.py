"""Rebuild the shipped tasks and the monolingual corpus from the original packages (see data/README.md).

    python data/build.py                 # all three tasks, then mono-en
    python data/build.py mt-en-de        # one task

Each folder has its own script (build_mt_en_de.py, build_gec_uk.py, build_gec_en.py, build_mono_en.py)
with more options; this runs them in turn. mono-en (English sources without references, for
distillation) leaves out every sentence of mt-en-de, so it comes after it. Packages are fetched into
data/.cache/ (git-ignored) unless already there.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "mt-en-de": "build_mt_en_de.py",
    "gec-uk": "build_gec_uk.py",
    "gec-en": "build_gec_en.py",
    "mono-en": "build_mono_en.py",
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tasks", nargs="*", metavar="TASK", help=f"tasks to rebuild (default: all of {', '.join(SCRIPTS)})")
    args = p.parse_args()
    unknown = [t for t in args.tasks if t not in SCRIPTS]
    if unknown:
        p.error(f"unknown task {unknown[0]!r} (choose from {', '.join(SCRIPTS)})")
    for task in args.tasks or list(SCRIPTS):
        print(f"== {task}", flush=True)
        r = subprocess.run([sys.executable, str(HERE / SCRIPTS[task])])
        if r.returncode:
            print(f"error: building {task} failed (exit {r.returncode})", file=sys.stderr)
            return r.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
