"""python -m refdec.hf export CKPT OUT_DIR | audit ... (refdec.hf.cli)"""

import sys

from .cli import main

sys.exit(main())
