"""python -m refdec.hf export CKPT OUT_DIR | audit ... (refdec.hfcli)"""

import sys

from ..hfcli import main

sys.exit(main())
