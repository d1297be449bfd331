"""Autoregressive training behind train.py (Vaswani et al. 2017, section 5).

Label-smoothed cross-entropy, Adam (0.9, 0.98, 1e-9) with linear warmup then inverse-sqrt decay,
gradient clipping, batches of a fixed number of tokens, periodic validation (dev loss + greedy BLEU),
best/last checkpoints written atomically, the last N snapshots averaged at the end, and resume from
last.pt after an interruption. Under torchrun it runs data-parallel (DistributedDataParallel; gloo on
CPU, nccl on CUDA): each process takes every world_size-th batch and gradients are averaged.

Files in out_dir:
    tokenizer.json   trained on the task's training text before step 1
    last.pt          weights + optimizer + position in the data: what --resume continues from
    best.pt          the best evaluation so far: lowest dev loss, or most tokens per call (pick)
    snapshots/       the last keep_last evaluation snapshots
    average.pt       their average
    model.pt         the file decode.py loads: the better of best/average (pick), or last; float16
    log.jsonl        one JSON record per evaluation

A run never clobbers another: an out_dir that already holds a run's files is refused unless the
run resumes it (its stored configuration, task and vocabulary must then agree with the new one,
beyond the schedule fields of RESUMABLE_CHANGES) or is told to overwrite it. Ctrl-C (SIGINT) ends
the run after the current update with last.pt saved, so --resume continues it exactly.

Each mode trains on a loss of its own, chosen once per run (`objective_class`): CrossEntropyLoss
(a plain model), DistillationLoss (kd_from), EarlyExitLoss (early_exit), ProposalHeadsLoss
(proposal_k) and DrafterLoss (drafter_k). Each mode also owns what it adds to a run: what it loads
or creates beside the model (the teacher, the heads), its dev evaluation, what its checkpoints
carry and how those are averaged and kept in model.pt, so the loop (Trainer) is the same for all.

With `proposal_k` the run trains the proposal heads of blockwise parallel decoding (refdec.proposal)
on top of the model of `init_from`, with the base frozen (`freeze_base`) or fine-tuned with them,
on one randomly drawn head's loss per batch (the paper's unbiased estimate) or the mean over heads.
The checkpoints then carry the heads beside the model, and validation decodes blockwise (exact
mode) to report the tokens per call, per row (the paper's mean accepted block size). A GAD
drafter's validation runs GAD with its verifier for the same figure; with pick tokens-per-call
that figure, not the dev loss against the references, chooses model.pt. With the base frozen,
model.pt holds the heads alone and names the init_from file as its base (`frozen_base`: path and
sha256; refdec.checkpoint loads the weights from there).

The package, by concern: models (the models a run starts from), objectives (the losses of the
modes), folder (the run folder), corpus (the data and its token ids), processes (a run's processes
under torchrun) and loop (the Trainer). Every name is importable from refdec.training.
"""

from .corpus import TokenCache, encode_pairs, load_data, prepare_tokenizer
from .folder import (
    PATH_FIELDS,
    RESUMABLE_CHANGES,
    RUN_FILES,
    Interrupted,
    Progress,
    RunFolder,
    TrainingError,
    check_out_dir,
    check_out_dir_data,
    claim_out_dir,
    config_changes,
    format_scores,
    remove_run,
)
from .loop import (
    Trainer,
    accumulate,
    build_run_objective,
    compiles,
    cpp_compiler,
    device_pass_tokens,
    inverse_sqrt,
    log_to_stderr,
    stop_on_sigint,
)
from .models import build_model, decoder_from, frozen_model
from .objectives import (
    CrossEntropyLoss,
    DistillationLoss,
    DrafterLoss,
    EarlyExitLoss,
    Objective,
    ProposalHeadsLoss,
    build_objective,
    decode_batches,
    dev_batches,
    objective_class,
    smoothed_loss,
    soft_cross_entropy,
)
from .processes import Processes

__all__ = [
    "CrossEntropyLoss",
    "DistillationLoss",
    "DrafterLoss",
    "EarlyExitLoss",
    "Interrupted",
    "Objective",
    "PATH_FIELDS",
    "Processes",
    "Progress",
    "ProposalHeadsLoss",
    "RESUMABLE_CHANGES",
    "RUN_FILES",
    "RunFolder",
    "TokenCache",
    "Trainer",
    "TrainingError",
    "accumulate",
    "build_model",
    "build_objective",
    "build_run_objective",
    "check_out_dir",
    "check_out_dir_data",
    "claim_out_dir",
    "compiles",
    "config_changes",
    "cpp_compiler",
    "decode_batches",
    "decoder_from",
    "dev_batches",
    "device_pass_tokens",
    "encode_pairs",
    "format_scores",
    "frozen_model",
    "inverse_sqrt",
    "load_data",
    "log_to_stderr",
    "objective_class",
    "prepare_tokenizer",
    "remove_run",
    "smoothed_loss",
    "soft_cross_entropy",
    "stop_on_sigint",
]
