"""Train a refdec model: the command refdec/commands/train.py, which `refdec train` (once installed)
and `python -m refdec train` run too.

    python train.py --preset mt-en-de                 # about an hour on a 2-core CPU, into runs/mt-en-de/
    python train.py --preset tiny --max-steps 20 --out-dir runs/smoke  # seconds: a smoke run
    torchrun --nproc_per_node 2 train.py --preset tiny --out-dir runs/ddp    # data-parallel
    python train.py --help                            # every option
"""

from refdec.commands.train import main

if __name__ == "__main__":
    raise SystemExit(main())
