"""Train a refdec model.

    python train.py --preset mt-en-de                 # about an hour on a 2-core CPU
    python train.py --preset mt-en-de --resume        # continue after an interruption
    python train.py --preset tiny --max-steps 20 --out-dir /tmp/tiny    # seconds: a smoke run
    torchrun --nproc_per_node 2 train.py --preset tiny --out-dir /tmp/ddp   # data-parallel

Any field of a preset can be overridden (see --help). Output: refdec/training.py's docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from refdec.config import PRESETS, TrainConfig

HELP = {
    "task": "task to train on (data/<task>/)", "out_dir": "folder for tokenizer.json and checkpoints",
    "vocab_size": "BPE vocabulary size (joint source/target)", "d_model": "model width",
    "n_heads": "attention heads", "d_ff": "feed-forward width", "enc_layers": "encoder layers",
    "dec_layers": "decoder layers", "dropout": "dropout rate", "norm_first": "pre-norm (true) or post-norm (false)",
    "max_positions": "longest sequence the model accepts", "max_train_len": "skip training pairs longer than this (tokens)",
    "batch_tokens": "padded source+target tokens per batch and process", "lr": "peak learning rate",
    "warmup_steps": "linear warmup steps before inverse-sqrt decay", "label_smoothing": "label smoothing epsilon",
    "clip_norm": "gradient norm clip", "max_steps": "stop after this many updates",
    "time_limit_min": "stop after this many minutes of training (0 = none)",
    "eval_every": "validate and checkpoint every N updates", "eval_sentences": "dev sentences decoded for BLEU",
    "keep_last": "snapshots kept and averaged at the end",
    "pick": "what model.pt holds: dev-loss (best or average, the lower dev loss) or last (the final weights)", "seed": "random seed (runs are reproducible)",
    "train_limit": "use only the first N training pairs (0 = all)", "data_dir": "data folder (default: the repo's data/)",
    "threads": "torch threads (0 = default)", "log_every": "progress line every N updates",
    "init_from": "start from this checkpoint: its shape, weights and tokenizer",
    "tokenizer_from": "train with this tokenizer.json instead of a new BPE (e.g. a small model on a large one's vocabulary)",
    "proposal_k": "train k-1 blockwise proposal heads on top of the model (0 = none)",
    "proposal_d_ff": "hidden width per proposal head (0 = the model's d_ff)",
    "freeze_base": "with --proposal-k: train only the heads", "head_loss": "with --proposal-k: random (one head per batch), mean (all heads) or base+random (the base's loss in every batch plus one random head)",
    "drafter_k": "train a GAD block drafter filling k masks (0 = an autoregressive model)",
    "drafter_layout": "drafter self-attention: causal (prefix cached across iterations) or bidirectional (the paper's)",
    "glancing_start": "drafter: glancing ratio at step 0", "glancing_end": "drafter: glancing ratio after the decay",
    "glancing_decay_steps": "drafter: updates over which the glancing ratio decays linearly",
    "early_exit": "also train the first N decoder layers as an early exit (BiLD's small model; 0 = no)",
    "encoder_from": "train a decoder (--enc-layers 0) on this checkpoint's frozen encoder and vocabulary "
                    "(BiLD's small model on the large model's encoder)",
    "kd_from": "word-level distillation: also learn this teacher checkpoint's next-token distributions (same vocabulary)",
    "kd_weight": "with --kd-from: the weight of the teacher's distributions in the loss (the rest: the labels')",
}


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="starting configuration")
    p.add_argument("--resume", action="store_true", help="continue from <out-dir>/last.pt if it exists")
    for f in dataclasses.fields(TrainConfig):
        kind = {bool: parse_bool, int: int, float: float, str: str}[type(f.default)] if f.default is not dataclasses.MISSING else str
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=None,
                       help=HELP.get(f.name, "") + " (default: the preset's)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    changes = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig) if getattr(args, f.name) is not None}
    try:
        cfg = PRESETS[args.preset].replace(**changes)
        cfg.model_config(cfg.vocab_size)  # validates the shape before any work
    except (ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from refdec.training import Trainer, log_to_stderr
    try:
        results = Trainer(cfg, resume=args.resume, log=log_to_stderr).run()
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for name, r in results.items():
        print(f"{name}: " + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
