"""The training objectives: one loss module per mode (a plain model, word-level distillation, BiLD's
early exit, blockwise proposal heads, GAD's block drafter), each owning what the mode adds to a run:
the parts it loads beside the model, its dev evaluation, what its checkpoints carry, how those are
averaged and what model.pt keeps. The models they train and load are built in refdec.training.models.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .. import data as data_mod
from ..adapters import SharedEncoder, early_exit_hidden
from ..checkpoint import average_states, file_sha256, load_checkpoint, referenced_file
from ..compiling import compiled
from ..config import TrainConfig
from ..decoding.blockwise import decode_blockwise
from ..decoding.gad import decode_gad
from ..decoding.greedy import decode_greedy
from ..decoding.result import DecodeStats
from ..drafter import Drafter, block_batch, glance, glancing_ratio
from ..errors import TrainingError
from ..metrics import corpus_bleu
from ..model import Transformer
from ..proposal import ProposalHeads, head_logits, head_targets, proposal_state
from ..tokenizer import Tokenizer
from .models import frozen_model


def smoothed_loss(logits: torch.Tensor, target: torch.Tensor, eps: float, pad_id: int) -> torch.Tensor:
    """Label-smoothed cross-entropy (Szegedy et al. 2016), mean over non-pad target tokens."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bfloat16 (autocast) up, float64 kept
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        target.reshape(-1),
        ignore_index=pad_id,
        label_smoothing=eps,
        reduction="sum",
    )
    # Divided by at least 1: a batch with no target (a far proposal head on short sentences) gives 0, not NaN.
    return total / target.ne(pad_id).sum().clamp(min=1)


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """-sum_v q(v) log p(v), mean over the positions where `keep` (B, T) is True: word-level
    distillation's loss against a teacher's distributions q (its KL divergence plus q's entropy)."""
    nll = -(target_probs * torch.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, T)
    return (nll * keep).sum() / keep.sum().clamp(min=1)


class Objective(torch.nn.Module):
    """A training mode's loss as one module (what DistributedDataParallel wraps), chosen once per run
    by `objective_class`: one subclass per mode, each with its own forward(src, tgt_in, tgt_out), and
    each owning what the mode adds to a run: the parts it loads or creates beside the model (`load`),
    what its checkpoints carry (`checkpoint_entries`, `load_entries`), how snapshots of those are
    averaged (`average_entries`), what model.pt keeps (`final_checkpoint`) and how it is logged."""

    unused_parameters = False  # DistributedDataParallel must look for weights without a gradient
    # The methods holding the tensor work of a training pass, free of Python-side choices (random
    # heads, drafter blocks, glancing): what `compile` hands to torch.compile.
    compiled_parts: tuple[str, ...] = ("forward",)
    recompile_limit: int | None = None  # compilations of a part torch.compile may keep (None: its default, 8)

    def __init__(self, model: Transformer, cfg: TrainConfig, encoder: Transformer | None = None):
        super().__init__()
        self.model, self.cfg = model, cfg
        self.heads: ProposalHeads | None = None  # trained proposal heads beside the model (ProposalHeadsLoss)
        self.trained_heads: list[int] = []  # which heads evaluation reports (none: the model alone)
        # encoder_from: the other model's encoder, frozen and in eval mode. Kept in a tuple, not as a
        # submodule: its weights are not trained, saved, or switched to training mode with the rest.
        self.frozen_encoder = (encoder,) if encoder is not None else ()
        # Where that encoder is, from the run's folder, and which file it was (checkpoints record both).
        self.shared_encoder = (
            {"path": os.path.relpath(cfg.encoder_from, cfg.out_dir), "sha256": file_sha256(cfg.encoder_from)}
            if encoder is not None and cfg.encoder_from
            else None
        )
        self.step = 0  # set by the trainer: the drafter's glancing ratio decays with it
        self.compiled_with = ""  # the torch.compile backend of the passes' tensor work ("" = eager)

    def compile(self, backend: str = "inductor") -> None:
        """Run the tensor work of each training pass (`compiled_parts`) through torch.compile: fewer
        kernel launches and less Python per pass. Shapes are dynamic (token batches vary in rows
        and length), so a new batch shape reuses the compiled code instead of compiling anew; the
        Python-side choices of a pass stay outside and run eagerly. Evaluation and decoding stay
        eager. backend "inductor" generates kernels (with a C++ compiler on a CPU); "eager" only traces
        (for checking that the parts compile, where no compiler is at hand)."""
        if self.compiled_with:
            raise RuntimeError(f"the objective is already compiled ({self.compiled_with})")
        for name in self.compiled_parts:  # an instance attribute: it shadows the method of the class
            setattr(self, name, compiled(getattr(self, name), self.recompile_limit, backend=backend, dynamic=True))
        self.compiled_with = backend

    @classmethod
    def load(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        tok: Tokenizer,
        device: torch.device,
        encoder: Transformer | None = None,
    ) -> Objective:
        """The mode's loss on `model`, with whatever else the mode loads or creates (after the model:
        new weights draw from torch's generator in that order)."""
        return cls.of_parts(cfg, model, encoder=encoder)

    @classmethod
    def of_parts(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        *,
        heads: ProposalHeads | None = None,
        encoder: Transformer | None = None,
        teacher: Transformer | None = None,
    ) -> Objective:
        """The mode's loss over parts already built (those the mode does not use are ignored)."""
        return cls(model, cfg, encoder)

    def describe(self) -> str:
        """What the run's log line about the model adds for this mode."""
        return (f"; reads the frozen encoder of {self.cfg.encoder_from}" if self.frozen_encoder else "") + (
            f"; passes compiled (torch.compile, {self.compiled_with}: each new kind of pass compiles first)"
            if self.compiled_with
            else ""
        )

    def eval_note(self, dev_size: int) -> str:
        """What the log line of an evaluation adds after the scores."""
        return f" (greedy BLEU on {min(self.cfg.eval_sentences, dev_size)} sentences)"

    def hidden(self, src: torch.Tensor, tgt_in: torch.Tensor, self_block: torch.Tensor | None = None) -> torch.Tensor:
        """The model's final decoder states, on its own encoder or on the frozen one of encoder_from
        (`self_block`: a drafter's attention layout, as forward_hidden takes it)."""
        if not self.frozen_encoder:
            return self.model.forward_hidden(src, tgt_in, self_block)
        with torch.no_grad():
            states, src_pad = self.frozen_encoder[0].encode_states(src)
        return self.model.forward_hidden(src, tgt_in, self_block, memory=self.model.attach(states, src_pad))

    def decoding_model(self):
        """What greedy decoding of the dev set runs: the model, on the frozen encoder if it has one."""
        return SharedEncoder(self.model, self.frozen_encoder[0]) if self.frozen_encoder else self.model

    def checkpoint_entries(self, half: bool) -> dict:
        """What a checkpoint carries beside the model to be decoded in this mode (for a plain model,
        only where its frozen encoder is)."""
        return {"shared_encoder": self.shared_encoder} if self.shared_encoder else {}

    def load_entries(self, checkpoint: dict) -> None:
        """Take the weights beside the model back from `checkpoint` (none for a plain model)."""

    def average_entries(self, snaps: list[dict]) -> None:
        """Load the average of the snapshots' weights beside the model (none for a plain model)."""

    def final_checkpoint(self, checkpoint: dict) -> str:
        """Turn `checkpoint` into model.pt's content in place; returns what the log says about it."""
        return ""

    def smoothed(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return smoothed_loss(logits, target, self.cfg.label_smoothing, self.model.cfg.pad_id)

    @torch.no_grad()
    def evaluate(self, tok: Tokenizer, dev: data_mod.Split, device: torch.device) -> dict:
        """Teacher-forced dev loss (no smoothing) over the dev set, and BLEU of greedy decoding of its
        first sentences. With proposal heads: dev_loss is the mean over the trained heads, and the
        sentences are decoded blockwise (exact mode: the same output as greedy) for the tokens per
        call (the paper's mean accepted block size)."""
        m, heads = self.model, self.heads
        self.eval()
        src, batches = dev_batches(tok, dev, min(self.cfg.max_train_len, m.cfg.max_positions - 1), device)
        which = self.trained_heads or [1]
        total, count = [0.0] * len(which), [0] * len(which)
        for s, ti, to in batches:
            hidden = self.hidden(s, ti)
            for j, i in enumerate(which):
                target = head_targets(to, i)
                logits = head_logits(m, heads, hidden, i)
                total[j] += F.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]).float(),
                    target.reshape(-1),
                    ignore_index=tok.pad_id,
                    reduction="sum",
                ).item()
                count[j] += target.ne(tok.pad_id).sum().item()
        n = min(self.cfg.eval_sentences, len(src))
        # With heads, blockwise decoding (exact: greedy's output) gives the BLEU of the first n
        # sentences and the tokens per call of the first speed_sentences, in batches cut at both.
        speed = min(self.cfg.speed_sentences, len(src)) if heads is not None else 0
        hyps, stats = [], DecodeStats()
        for rows, first in decode_batches(src, n, speed):
            x = data_mod.source_tensor(rows).to(device)
            max_len = min(m.cfg.max_positions - 1, 2 * max(map(len, rows)) + 10)
            res = (
                decode_greedy(self.decoding_model(), x, max_len=max_len)
                if heads is None
                else decode_blockwise(m, heads, x, max_len=max_len)
            )
            hyps += [tok.decode(t.tolist()) for t in res.tokens]
            if first:
                stats.merge(res.stats)
        self.train()
        out = {
            "dev_loss": sum(t / max(c, 1) for t, c in zip(total, count)) / len(which),
            "dev_bleu": corpus_bleu(hyps[:n], dev.tgt[:n]),
        }
        if heads is not None:
            out["dev_loss_per_head"] = {str(i): t / max(c, 1) for i, t, c in zip(which, total, count)}
            out["dev_tokens_per_call"] = stats.mean_committed  # per row: tokens each sentence gains per call
        return out


def decode_batches(src: list[list[int]], n: int, speed: int, size: int = 32):
    """Batches of at most `size` of the first max(n, speed) sources, none straddling `speed`: each as
    (rows, whether they are among the first `speed`)."""
    for lo, hi in ((0, speed), (speed, max(n, speed))):
        for i in range(lo, hi, size):
            yield src[i : min(i + size, hi)], hi == speed


def dev_batches(tok: Tokenizer, dev: data_mod.Split, limit: int, device: torch.device):
    """The dev sources' token ids cut to `limit` tokens, and an iterator over teacher-forcing
    batches (src, tgt_in, tgt_out) of the dev pairs, 8000 tokens each at most."""
    src = [s[:limit] for s in tok.encode_batch(dev.src)]
    tgt = [t[:limit] for t in tok.encode_batch(dev.tgt)]
    batches = (
        tuple(x.to(device) for x in data_mod.training_tensors([src[i] for i in idx], [tgt[i] for i in idx]))
        for idx in data_mod.token_batches([(len(s), len(t)) for s, t in zip(src, tgt)], 8000, None)
    )
    return src, batches


class CrossEntropyLoss(Objective):
    """A plain model (on its own encoder or a frozen one): the label-smoothed cross-entropy."""

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        return self.smoothed(self.model.project(self.hidden(src, tgt_in)), tgt_out)


class DistillationLoss(Objective):
    """Word-level distillation (kd_from): (1 - kd_weight) x the label-smoothed cross-entropy +
    kd_weight x the cross-entropy to the teacher's next-token distributions."""

    def __init__(self, model: Transformer, cfg: TrainConfig, teacher: Transformer, encoder: Transformer | None = None):
        super().__init__(model, cfg, encoder)
        self.teacher = (teacher,)  # frozen, kept out of the submodules as the frozen encoder is

    @classmethod
    def load(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        tok: Tokenizer,
        device: torch.device,
        encoder: Transformer | None = None,
    ) -> DistillationLoss:
        """The teacher of kd_from, frozen; it must be on the run's task and vocabulary."""
        checkpoint = load_checkpoint(cfg.kd_from)
        if checkpoint.get("tokenizer_sha256") != tok.sha256 or checkpoint.get("task") != cfg.task:
            raise ValueError(f"the teacher {cfg.kd_from} is not on this run's task and vocabulary")
        return cls(model, cfg, frozen_model(checkpoint, device), encoder)

    @classmethod
    def of_parts(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        *,
        heads: ProposalHeads | None = None,
        encoder: Transformer | None = None,
        teacher: Transformer | None = None,
    ) -> DistillationLoss:
        return cls(model, cfg, teacher, encoder)

    def describe(self) -> str:
        return super().describe() + f"; distils {self.cfg.kd_from} (weight {self.cfg.kd_weight})"

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        logits = self.model.project(self.hidden(src, tgt_in))
        loss = self.smoothed(logits, tgt_out)
        with torch.no_grad():
            soft = torch.softmax(self.teacher[0](src, tgt_in).float(), dim=-1)  # (B, T, V)
        w = self.cfg.kd_weight
        return (1 - w) * loss + w * soft_cross_entropy(logits, soft, tgt_out.ne(self.model.cfg.pad_id))


class EarlyExitLoss(Objective):
    """BiLD's early exit: the mean of the full model's loss and that of its first early_exit layers."""

    @classmethod
    def load(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        tok: Tokenizer,
        device: torch.device,
        encoder: Transformer | None = None,
    ) -> EarlyExitLoss:
        if not cfg.early_exit < model.cfg.dec_layers:
            raise ValueError(f"early_exit={cfg.early_exit} needs more than {cfg.early_exit} decoder layers")
        return cls(model, cfg)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        final, early = early_exit_hidden(self.model, src, tgt_in, self.cfg.early_exit)
        return 0.5 * (
            self.smoothed(self.model.project(final), tgt_out) + self.smoothed(self.model.project(early), tgt_out)
        )

    def checkpoint_entries(self, half: bool) -> dict:
        return {"early_exit": self.cfg.early_exit, **super().checkpoint_entries(half)}


class ProposalHeadsLoss(Objective):
    """Blockwise parallel decoding's proposal heads: the loss of one random head (head_loss random),
    of the base and one random far head (base+random), or the mean over heads (mean)."""

    unused_parameters = True  # head 1 (the base) is skipped in some batches when heads are drawn at random
    compiled_parts = ("heads_loss",)  # the heads are drawn outside, in Python: one graph per head drawn

    def __init__(self, model: Transformer, heads: ProposalHeads, cfg: TrainConfig, base_file: str = ""):
        super().__init__(model, cfg)
        self.heads = heads
        # Head 1 is the base model itself: trained only when the base is not frozen.
        self.trained_heads = list(range(2 if cfg.freeze_base else 1, heads.k + 1))
        # Heads on a frozen base ship without the base's weights: model.pt names the file holding them
        # (init_from, or the base that init_from's heads stand on) instead.
        self.base_file = base_file = base_file or cfg.init_from
        self.frozen_base = (
            {"path": os.path.relpath(base_file, cfg.out_dir), "sha256": file_sha256(base_file)}
            if cfg.freeze_base and base_file
            else None
        )

    @classmethod
    def load(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        tok: Tokenizer,
        device: torch.device,
        encoder: Transformer | None = None,
    ) -> ProposalHeadsLoss:
        """Heads of cfg's shape on the model, whose weights are frozen with freeze_base: new ones, or
        those of init_from when it has heads of that shape (trained heads continued)."""
        heads = ProposalHeads(model.cfg.d_model, cfg.proposal_d_ff or model.cfg.d_ff, cfg.proposal_k).to(device)
        base_file = ""
        if cfg.init_from:
            checkpoint = load_checkpoint(cfg.init_from)
            if "proposal" in checkpoint:
                if checkpoint["proposal"]["config"] != heads.config():
                    raise TrainingError(
                        f"{cfg.init_from} holds heads of shape {checkpoint['proposal']['config']}, not "
                        f"{heads.config()}: give --proposal-k and --proposal-d-ff as they were trained"
                    )
                heads.load_state_dict({k: v.float() for k, v in checkpoint["proposal"]["state"].items()})
            if "frozen_base" in checkpoint:  # heads alone: the weights are those of the base they name
                base_file = str(
                    referenced_file(
                        cfg.init_from, checkpoint["frozen_base"], "holds proposal heads on the frozen model"
                    )
                )
        if cfg.freeze_base:
            model.requires_grad_(False)
        return cls(model, heads, cfg, base_file)

    @classmethod
    def of_parts(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        *,
        heads: ProposalHeads | None = None,
        encoder: Transformer | None = None,
        teacher: Transformer | None = None,
    ) -> ProposalHeadsLoss:
        return cls(model, heads, cfg)

    @property
    def recompile_limit(self) -> int:
        """Each head drawn is a graph of its own (its index picks a slice of the heads' weights and of the
        targets), so torch.compile may keep one per head, not its default 8 (refdec.compiling.compiled)."""
        return self.heads.k + 8

    def describe(self) -> str:
        cfg = self.cfg
        return super().describe() + (
            f"; {cfg.proposal_k - 1} proposal heads ({sum(p.numel() for p in self.heads.parameters()) / 1e6:.2f}M), "
            f"base {'frozen' if cfg.freeze_base else 'fine-tuned'}, {cfg.head_loss} head loss"
        )

    def load_entries(self, checkpoint: dict) -> None:
        self.heads.load_state_dict({k: v.float() for k, v in checkpoint["proposal"]["state"].items()})

    def average_entries(self, snaps: list[dict]) -> None:
        self.heads.load_state_dict(average_states([snap["proposal"]["state"] for snap in snaps]))

    def final_checkpoint(self, checkpoint: dict) -> str:
        """On a frozen base: the heads alone, naming the base's file (refdec.checkpoint loads it from there)."""
        if self.frozen_base is None:
            return ""
        del checkpoint["model"]
        checkpoint["frozen_base"] = self.frozen_base
        return f", the heads alone: the base is {self.base_file}"

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        return self.heads_loss(src, tgt_in, tgt_out, self.chosen_heads())

    def heads_loss(
        self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor, chosen: list[int]
    ) -> torch.Tensor:
        """The mean of the heads `chosen`'s losses."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.cfg.freeze_base):
            hidden = self.model.forward_hidden(src, tgt_in)
        losses = [
            self.smoothed(head_logits(self.model, self.heads, hidden, i), head_targets(tgt_out, i)) for i in chosen
        ]
        return sum(losses) / len(losses)

    def checkpoint_entries(self, half: bool) -> dict:
        return {"proposal": proposal_state(self.heads, half), **super().checkpoint_entries(half)}

    def chosen_heads(self) -> list[int]:
        """This batch's heads; random ones drawn from torch's generator, whose state last.pt keeps."""
        if self.cfg.head_loss == "random":
            return [self.trained_heads[int(torch.randint(len(self.trained_heads), ()))]]
        if self.cfg.head_loss == "base+random":  # head 1 (the base) always, one of heads 2..k beside it
            far = [i for i in self.trained_heads if i > 1]
            return [1, far[int(torch.randint(len(far), ()))]]
        return self.trained_heads


class DrafterLoss(Objective):
    """GAD's block drafter: L_NAR with glancing (GLAT). Predict the block, reveal gold tokens where it
    was wrong, learn the rest. Its verifier (the model of encoder_from, or else of init_from when
    that is not itself a drafter) runs GAD with it at each evaluation for the tokens per call."""

    # The block inputs, the glancing ratio (which changes every update) and the tokens revealed are
    # chosen in Python between the two passes of the model, outside what is compiled.
    compiled_parts = ("block_prediction", "block_loss")

    def __init__(
        self,
        model: Transformer,
        cfg: TrainConfig,
        encoder: Transformer | None = None,
        verifier: Transformer | None = None,
    ):
        super().__init__(model, cfg, encoder)
        self.verifier = (verifier,) if verifier is not None else ()  # frozen, out of the submodules

    @classmethod
    def load(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        tok: Tokenizer,
        device: torch.device,
        encoder: Transformer | None = None,
    ) -> DrafterLoss:
        verifier = encoder
        if verifier is None and cfg.init_from:
            checkpoint = load_checkpoint(cfg.init_from)
            verifier = None if "drafter" in checkpoint else frozen_model(checkpoint, device)
        if verifier is None and cfg.pick == "tokens-per-call":
            raise TrainingError(
                "pick tokens-per-call needs the drafter's verifier: --encoder-from (or --init-from "
                "a model that is not a drafter)"
            )
        return cls(model, cfg, encoder, verifier)

    @classmethod
    def of_parts(
        cls,
        cfg: TrainConfig,
        model: Transformer,
        *,
        heads: ProposalHeads | None = None,
        encoder: Transformer | None = None,
        teacher: Transformer | None = None,
    ) -> DrafterLoss:
        return cls(model, cfg, encoder, encoder)

    def forward(self, src: torch.Tensor, tgt_in: torch.Tensor, tgt_out: torch.Tensor) -> torch.Tensor:
        inp, gold, block = self.drafter_batch(tgt_out)
        cfg = self.cfg
        ratio = glancing_ratio(self.step, cfg.glancing_start, cfg.glancing_end, cfg.glancing_decay_steps)
        inp, target = glance(inp, gold, self.block_prediction(src, inp, block), ratio)
        return self.block_loss(src, inp, block, target)

    def block_prediction(self, src: torch.Tensor, inp: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
        """The drafter's argmax at every position of `inp` (no gradient): what glancing compares to the gold."""
        with torch.no_grad():
            return self.model.project(self.hidden(src, inp, block)).argmax(dim=-1)

    def block_loss(
        self, src: torch.Tensor, inp: torch.Tensor, block: torch.Tensor, target: torch.Tensor
    ) -> torch.Tensor:
        return self.smoothed(self.model.project(self.hidden(src, inp, block)), target)

    @torch.no_grad()
    def evaluate(self, tok: Tokenizer, dev: data_mod.Split, device: torch.device) -> dict:
        """The drafter's dev loss and top-1 accuracy on the block, at prefix lengths drawn from a fixed
        seed (the same blocks at every evaluation), without glancing."""
        self.eval()
        _, batches = dev_batches(tok, dev, min(self.cfg.max_train_len, self.model.cfg.max_positions - 1), device)
        gen = torch.Generator().manual_seed(1234)
        loss = correct = count = 0.0
        for s, _, to in batches:
            inp, gold, block = self.drafter_batch(to, gen)
            logits = self.model.project(self.hidden(s, inp, block))
            loss += F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]).float(), gold.reshape(-1), ignore_index=tok.pad_id, reduction="sum"
            ).item()
            on = gold.ne(tok.pad_id)
            correct += (logits.argmax(-1).eq(gold) & on).sum().item()
            count += on.sum().item()
        out = {"dev_loss": loss / max(count, 1), "dev_block_accuracy": correct / max(count, 1)}
        if self.verifier:
            out["dev_tokens_per_call"] = self.tokens_per_call(tok, dev, device)
        self.train()
        return out

    def tokens_per_call(self, tok: Tokenizer, dev: data_mod.Split, device: torch.device) -> float:
        """GAD's tokens per verifier call and row, with the verifier, on the first speed_sentences dev
        sources (what the drafter is for: GAD accepts what matches the verifier's own output)."""
        verifier, cfg = self.verifier[0], self.cfg
        drafter = Drafter(self.decoding_model(), k=cfg.drafter_k, layout=cfg.drafter_layout)
        room = min(verifier.cfg.max_positions, self.model.cfg.max_positions - cfg.drafter_k) - 1
        src = [s[:room] for s in tok.encode_batch(dev.src[: cfg.speed_sentences])]
        stats = DecodeStats()
        for rows, _ in decode_batches(src, len(src), 0):
            x = data_mod.source_tensor(rows).to(device)
            stats.merge(decode_gad(verifier, drafter, x, max_len=min(room, 2 * max(map(len, rows)) + 10)).stats)
        return stats.mean_committed

    def checkpoint_entries(self, half: bool) -> dict:
        return {
            "drafter": {"k": self.cfg.drafter_k, "layout": self.cfg.drafter_layout},
            **super().checkpoint_entries(half),
        }

    def eval_note(self, dev_size: int) -> str:
        return (
            f" (GAD with the verifier on {min(self.cfg.speed_sentences, dev_size)} sentences)" if self.verifier else ""
        )

    def drafter_batch(self, tgt_out: torch.Tensor, generator: torch.Generator | None = None):
        """Block inputs for every row: a random prefix length p in 0 .. len(y), then k masks."""
        pad = self.model.cfg.pad_id
        ys = [row[row.ne(pad)].tolist()[:-1] for row in tgt_out.cpu()]  # drop the eos
        ps = [int(torch.randint(len(y) + 1, (), generator=generator)) for y in ys]
        return (t.to(tgt_out.device) for t in block_batch(ys, self.cfg.drafter_k, ps, self.cfg.drafter_layout))


def objective_class(cfg: TrainConfig) -> type[Objective]:
    """The loss of the run's mode (TrainConfig's rules let at most one of them be on)."""
    if cfg.drafter_k:
        return DrafterLoss
    if cfg.early_exit:
        return EarlyExitLoss
    if cfg.proposal_k:
        return ProposalHeadsLoss
    if cfg.kd_from:
        return DistillationLoss
    return CrossEntropyLoss


def build_objective(
    cfg: TrainConfig,
    model: Transformer,
    heads: ProposalHeads | None = None,
    encoder: Transformer | None = None,
    teacher: Transformer | None = None,
) -> Objective:
    """The loss of the run's mode over parts already built (a run loads its own: Objective.load)."""
    return objective_class(cfg).of_parts(cfg, model, heads=heads, encoder=encoder, teacher=teacher)
