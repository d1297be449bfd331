"""python -m refdec.hf export CKPT OUT_DIR | audit ... (refdec.commands.hfcli)"""

import sys

from ..commands.hfcli import main

sys.exit(main())
