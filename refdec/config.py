"""Configuration as frozen dataclasses. A ModelConfig is saved inside every checkpoint; the training
presets, TrainConfigs filled in, are refdec.presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

# Special token ids, fixed by the order in which refdec.tokenizer registers them.
PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID = 0, 1, 2, 3, 4
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>", "<mask>")
POSITION_TABLES = ("sinusoidal", "m2m100", "marian", "learned", "relative")
ACTIVATIONS = ("relu", "gelu", "gelu_new", "silu")  # refdec.variants.activation
NORMS = ("layer", "rms")
DRAFTER_LAYOUTS = ("causal", "bidirectional")  # the block drafter's self-attention (refdec.drafter)
PICKS = ("dev-loss", "tokens-per-call", "last")  # what a run's model.pt holds (TrainConfig.pick)
COMPILE_MODES = ("auto", "on", "off")  # torch.compile of the training passes (TrainConfig.compile)


@dataclass(frozen=True)
class ModelConfig:
    """Shape of an encoder-decoder Transformer (Vaswani et al. 2017, figure 1)."""

    vocab_size: int
    d_model: int = 256
    n_heads: int = 4
    d_ff: int = 1024
    enc_layers: int = 3
    dec_layers: int = 3
    dropout: float = 0.1
    norm_first: bool = True  # pre-norm (True) or the paper's post-norm (False)
    tie_embeddings: bool = True  # one matrix for source, target and output projection
    max_positions: int = 256  # longest source or target the model accepts, bos/eos included
    # Width of the encoder states the cross-attention reads (0 = d_model). With enc_layers 0 the model has
    # no encoder of its own and reads another model's (refdec.adapters.SharedEncoder: a BiLD small model
    # on the large model's encoder), whose width this is.
    d_memory: int = 0
    pad_id: int = PAD_ID
    bos_id: int = BOS_ID  # the decoder's start token
    eos_id: int = EOS_ID
    # The position table: "sinusoidal" (section 3.5, sin and cos interleaved) or "m2m100" (Hugging Face's
    # M2M100/NLLB table: [sin | cos] halves with its own frequencies, computed in float32, position p at
    # row p + pad_id + 1; refdec.positions.m2m100_positions).
    positions: str = "sinusoidal"
    # Forced tokens (an imported NLLB/M2M100 model's language codes): encoder_prefix goes before every
    # source; decoder_prefix follows the start token, before the first output token. Decoders never see
    # them: the model inserts them (refdec.model.Transformer.encode_states / decode_hidden).
    encoder_prefix: tuple[int, ...] = ()
    decoder_prefix: tuple[int, ...] = ()
    # -- How Hugging Face's seq2seq families differ from the paper's Transformer (refdec.hf.importing
    # maps each family's config.json onto these; the defaults are the paper's model). positions above
    # also takes "marian" (MarianSinusoidalPositionalEmbedding: [sin | cos] halves at the paper's
    # frequencies, rounded to float32), "learned" (BartLearnedPositionalEmbedding, a table per side;
    # its first 2 rows, BART's offset, are dropped at import) and "relative" (no absolute positions:
    # T5's bucketed relative position bias, T5Attention.compute_bias).
    activation: str = "relu"  # section 3.3's ReLU; BART/mBART "gelu", opus-mt "swish" (silu), T5 v1.1 "gelu_new"
    # T5 v1.1 / Flan-T5 feed_forward_proj "gated-gelu" (T5DenseGatedActDense; Shazeer 2020, "GLU
    # Variants Improve Transformer"): w2(act(w1 x) * w3 x)
    gated_ff: bool = False
    norm: str = "layer"  # "rms": T5LayerNorm (no mean, no bias, the mean square taken in float32)
    norm_eps: float = 1e-5  # nn.LayerNorm's default; T5 layer_norm_epsilon 1e-6
    bias: bool = True  # biases in every linear map (T5's have none)
    d_head: int = 0  # the width of one attention head (0 = d_model / n_heads); T5's d_kv, free of d_model
    scale_attention: bool = True  # Eq. 1's 1/sqrt(d_k); T5 has none (T5Attention.scaling = 1.0)
    scale_embeddings: bool = (
        True  # section 3.4's embeddings x sqrt(d_model); config scale_embedding (BART false), T5 none
    )
    embed_norm: bool = False  # a LayerNorm on embeddings + positions, per side (BART/mBART layernorm_embedding)
    logits_bias: bool = False  # a bias on the logits (BART/mBART/Marian final_logits_bias)
    # The decoder output x d_model^-0.5 before the vocabulary projection: T5 v1.0's tied head
    # (T5Config.scale_decoder_outputs, true unless the config says tie_word_embeddings false)
    rescale_head: bool = False
    relative_buckets: int = 32  # T5 relative_attention_num_buckets (positions "relative")
    relative_max_distance: int = 128  # T5 relative_attention_max_distance

    def __post_init__(self) -> None:
        if self.positions not in POSITION_TABLES:
            raise ValueError(f"positions must be one of {', '.join(POSITION_TABLES)}, not {self.positions!r}")
        for name in ("encoder_prefix", "decoder_prefix"):
            ids = tuple(getattr(self, name))
            if not all(isinstance(i, int) and 0 <= i < self.vocab_size for i in ids):
                raise ValueError(f"{name} must hold token ids below vocab_size={self.vocab_size}, not {list(ids)}")
            object.__setattr__(self, name, ids)  # a list from a checkpoint's dict becomes the tuple the field holds
        for name, allowed in (("activation", ACTIVATIONS), ("norm", NORMS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, not {getattr(self, name)!r}")
        if self.d_model % self.n_heads and not self.d_head:
            raise ValueError(f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.enc_layers < 0 or self.dec_layers < 1:
            raise ValueError("enc_layers must be at least 0 (0 = another model's encoder) and dec_layers at least 1")
        if self.enc_layers and self.d_memory not in (0, self.d_model):
            raise ValueError(
                f"a model with its own encoder reads states of width d_model={self.d_model}, "
                f"not d_memory={self.d_memory}"
            )

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.n_heads

    @property
    def memory_dim(self) -> int:
        """The width of the encoder states the decoder's cross-attention reads."""
        return self.d_memory or self.d_model

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**d)


@dataclass(frozen=True)
class TrainConfig:
    """One training run: the task, the model shape, and the optimisation schedule.

    The fields are flat, each mode's options beside the rest: they are train.py's flags, the
    presets' keywords (refdec.presets) and the keys of the configuration stored in every checkpoint
    (which --resume compares). The rules between them are checked per mode (_check_heads,
    _check_drafter, ...), and an option of a mode that is off must keep its field's default (_changed)."""

    task: str
    out_dir: str
    vocab_size: int = 8000
    # the model's shape: ModelConfig's defaults, one place for them
    d_model: int = ModelConfig.d_model
    n_heads: int = ModelConfig.n_heads
    d_ff: int = ModelConfig.d_ff
    enc_layers: int = ModelConfig.enc_layers
    dec_layers: int = ModelConfig.dec_layers
    dropout: float = ModelConfig.dropout
    norm_first: bool = ModelConfig.norm_first
    max_positions: int = ModelConfig.max_positions
    max_train_len: int = 128  # training pairs with a longer side (in tokens) are skipped
    batch_tokens: int = 4096  # source + target tokens per batch (per process)
    # Padded tokens per forward/backward pass, the batch's gradients accumulated over its passes (0 =
    # by the device: the whole batch on a CPU, what fits on a GPU); the update is the batch's either way.
    pass_tokens: int = 0
    # torch.compile of each pass's tensor work (Objective.compile): "on", "off", or "auto" = on a GPU,
    # off on a CPU (where it was measured not to pay: docs/usage.md); the update is the same either way.
    compile: str = "auto"
    lr: float = 7e-4
    warmup_steps: int = 1000
    label_smoothing: float = 0.1
    clip_norm: float = 1.0
    max_steps: int = 10000
    time_limit_min: float = 0.0  # stop after this many minutes (0 = no limit)
    eval_every: int = 500
    eval_sentences: int = 300  # dev sentences decoded greedily for BLEU at each evaluation
    keep_last: int = 5  # snapshots kept for averaging
    # model.pt: "dev-loss" (best or average, the lower), "tokens-per-call" (drafters and heads: best or
    # average, the more tokens per call of their decoder on the first speed_sentences dev sentences)
    # or "last" (the final weights)
    pick: str = "dev-loss"
    # Drafters and heads: dev sentences their decoder runs at each evaluation (GAD with its verifier,
    # blockwise with the heads), for the tokens per call, per row: what these models are for.
    speed_sentences: int = 64
    seed: int = 1
    train_limit: int = 0  # use only the first N training pairs (0 = all); for smoke runs
    dev_limit: int = 0  # validate on only the first N dev pairs (0 = all); for smoke runs
    data_dir: str = ""  # folder holding <task>/ (train.src, train.tgt ..., plain or .gz; "" = the repo's data/)
    threads: int = 0  # torch threads (0 = torch's default)
    log_every: int = 50
    # Starting point and proposal heads (blockwise parallel decoding, Stern et al. 2018, section 6).
    init_from: str = ""  # checkpoint whose shape, weights and tokenizer start the run ("" = from scratch)
    tokenizer_from: str = ""  # a tokenizer.json to train with instead of a new BPE (a model pair sharing a vocabulary)
    proposal_k: int = 0  # train k - 1 proposal heads on top of the model (0 = a plain model)
    proposal_d_ff: int = 0  # the heads' hidden width per head (0 = d_ff of the model)
    freeze_base: bool = False  # with proposal_k: train only the heads, the base model stays as it is
    # with proposal_k: "random" (one head per batch, the paper's), "mean" (all heads), or "base+random"
    # (the base model's own loss in every batch plus one random proposal head: keeps a fine-tuned base intact)
    head_loss: str = "random"
    # Non-autoregressive block drafter (GAD, Ge et al. 2022, section 3.2; refdec.drafter).
    drafter_k: int = 0  # train a drafter that fills k masks after a random prefix (0 = an AR model)
    drafter_layout: str = "causal"  # "causal" prefix (cacheable) or the paper's "bidirectional"
    glancing_start: float = 0.5  # glancing ratio at step 0 (GLAT)
    glancing_end: float = 0.3  # ... decayed linearly to this
    glancing_decay_steps: int = 3000
    # BiLD's early-exit small model (Kim et al. 2023, section 4.4): the first n decoder layers share
    # the prediction head and the loss is the average of the early and the full model's.
    early_exit: int = 0
    # A decoder on another model's frozen encoder (refdec.adapters.SharedEncoder): the checkpoint whose
    # encoder it reads (its vocabulary too); needs enc_layers 0. BiLD's small model or GAD's drafter on
    # the large model's (the verifier's) encoder runs no encoder of its own when decoding.
    encoder_from: str = ""
    # Word-level knowledge distillation (Hinton et al. 2015; Kim and Rush 2016): a teacher checkpoint on
    # the same vocabulary whose next-token distributions the model also learns, the loss being
    # (1 - kd_weight) x the label-smoothed cross-entropy + kd_weight x the cross-entropy to the teacher's.
    kd_from: str = ""
    kd_weight: float = 0.5

    def __post_init__(self) -> None:
        self._check_ranges()
        if self.tokenizer_from and self.init_from:
            raise ValueError(
                "tokenizer_from and init_from exclude each other: the starting model brings its vocabulary"
            )
        if self.compile not in COMPILE_MODES:
            raise ValueError(
                f"compile must be {', '.join(COMPILE_MODES[:-1])} or {COMPILE_MODES[-1]}, not {self.compile!r}"
            )
        if self.pick not in PICKS:
            raise ValueError(f"pick must be {', '.join(PICKS[:-1])} or {PICKS[-1]}, not {self.pick!r}")
        if (self.pick == "tokens-per-call" or self._changed("speed_sentences")) and not (
            self.drafter_k or self.proposal_k
        ):
            raise ValueError(
                "pick tokens-per-call and speed_sentences need drafter_k or proposal_k (a drafter's "
                "or the heads' decoder gives the tokens per call)"
            )
        self._check_heads()
        self._check_drafter()
        self._check_early_exit()
        self._check_shared_encoder()
        self._check_distillation()

    def _changed(self, *names: str) -> bool:
        """Whether any of the fields `names` differs from its default (an option of a mode that is off)."""
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        return any(getattr(self, n) != defaults[n] for n in names)

    def _check_heads(self) -> None:
        """Proposal heads (proposal_k and the options that shape them)."""
        if self.head_loss not in ("random", "mean", "base+random"):
            raise ValueError(f"head_loss must be random, mean or base+random, not {self.head_loss!r}")
        if self.head_loss == "base+random" and self.freeze_base:
            raise ValueError("head_loss base+random trains the base model's loss: it needs freeze_base false")
        if self.proposal_k == 1 or self.proposal_k < 0:
            raise ValueError("proposal_k must be 0 (no heads) or at least 2")
        if self.freeze_base and not self.proposal_k:
            raise ValueError("freeze_base needs proposal_k: a frozen model without heads has nothing to train")
        if not self.proposal_k and self._changed("proposal_d_ff", "head_loss"):
            raise ValueError("proposal_d_ff and head_loss need proposal_k (they shape the proposal heads)")

    def _check_drafter(self) -> None:
        """The block drafter (drafter_k, its layout and the glancing schedule)."""
        if self.drafter_k < 0 or (self.drafter_k and self.proposal_k):
            raise ValueError("drafter_k must be 0 or positive, and a drafter cannot also train proposal heads")
        if not self.drafter_k and self._changed(
            "drafter_layout", "glancing_start", "glancing_end", "glancing_decay_steps"
        ):
            raise ValueError("drafter_layout and the glancing options need drafter_k (they shape the drafter)")
        if self.drafter_layout not in DRAFTER_LAYOUTS:
            raise ValueError(f"drafter_layout must be {' or '.join(DRAFTER_LAYOUTS)}, not {self.drafter_layout!r}")

    def _check_early_exit(self) -> None:
        if self.early_exit < 0 or (self.early_exit and (self.drafter_k or self.proposal_k)):
            raise ValueError("early_exit must be 0 or positive, and cannot be combined with a drafter or heads")

    def _check_shared_encoder(self) -> None:
        """A decoder on encoder_from's frozen encoder, the only kind of model without an encoder."""
        if self.encoder_from and (self.enc_layers or self.tokenizer_from or self.proposal_k or self.early_exit):
            raise ValueError(
                "encoder_from needs enc_layers 0 (the encoder is the other model's), brings its "
                "vocabulary (no tokenizer_from) and trains a plain decoder or a drafter"
            )
        if not self.encoder_from and self.enc_layers < 1:
            raise ValueError("enc_layers 0 needs encoder_from: the checkpoint whose encoder the model reads")

    def _check_distillation(self) -> None:
        if self.kd_from and (self.drafter_k or self.proposal_k or self.early_exit):
            raise ValueError("kd_from distils a plain model: not with a drafter, proposal heads or an early exit")
        if not 0.0 <= self.kd_weight <= 1.0 or (self._changed("kd_weight") and not self.kd_from):
            raise ValueError("kd_weight is a weight in [0, 1] and needs kd_from (the teacher)")

    def _check_ranges(self) -> None:
        """Every number within what training can use: a bad value is one clear error, not a crash or
        a run that silently does nothing (a NaN fails every comparison, so it is refused too)."""
        at_least = {
            "vocab_size": 16,
            "d_model": 1,
            "n_heads": 1,
            "d_ff": 1,
            "max_positions": 2,
            "max_train_len": 1,
            "batch_tokens": 1,
            "warmup_steps": 1,
            "max_steps": 1,
            "eval_every": 1,
            "keep_last": 1,
            "log_every": 1,
            "glancing_decay_steps": 1,
            "eval_sentences": 0,
            "train_limit": 0,
            "threads": 0,
            "speed_sentences": 1,
            "pass_tokens": 0,
            "seed": 0,
            "proposal_d_ff": 0,
            "dev_limit": 0,
            "time_limit_min": 0,
        }
        for name, low in at_least.items():
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value >= low and math.isfinite(value)):
                raise ValueError(f"{name.replace('_', '-')} must be at least {low}, not {value}")
        for name in ("lr", "clip_norm"):
            if not (getattr(self, name) > 0 and math.isfinite(getattr(self, name))):
                raise ValueError(f"{name.replace('_', '-')} must be a positive number, not {getattr(self, name)}")
        for name in ("dropout", "label_smoothing"):  # 1 would drop every unit / ignore every label
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be in [0, 1), not {getattr(self, name)}")
        for name in ("glancing_start", "glancing_end"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name.replace('_', '-')} must be in [0, 1], not {getattr(self, name)}")

    def model_config(self, vocab_size: int, d_memory: int = 0) -> ModelConfig:
        return ModelConfig(
            vocab_size=vocab_size,
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            enc_layers=self.enc_layers,
            dec_layers=self.dec_layers,
            dropout=self.dropout,
            norm_first=self.norm_first,
            max_positions=self.max_positions,
            d_memory=d_memory,
        )

    def replace(self, **changes) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)
