"""The training presets: each a TrainConfig a run starts from (`python train.py --preset NAME`, any field
overridden on the command line). refdec.config defines the fields and their rules; this module only
fills them in."""

from __future__ import annotations

from .config import TrainConfig


def sad_preset(task: str, enc_layers: int, dec_layers: int) -> TrainConfig:
    """One model of a task's SAD pair (see PRESETS): width 192, enc_layers + dec_layers layers."""
    return TrainConfig(
        task=task,
        out_dir=f"runs/{task}-{enc_layers}x{dec_layers}",
        d_model=192,
        d_ff=768,
        enc_layers=enc_layers,
        dec_layers=dec_layers,
        lr=1e-3,
        warmup_steps=600,
        eval_every=400,
        time_limit_min=95,
        threads=1,
    )


VERIFIER = "checkpoints/mt-en-de/model.pt"  # the verifier of the mt-en-de drafters and heads


def mono_preset(name: str, **fields) -> TrainConfig:
    """A drafter or heads of the mt-en-de verifier trained on its greedy outputs for the training
    sources and 203k monolingual sentences, model.pt chosen by the tokens per call (see PRESETS)."""
    defaults = dict(
        data_dir="data/distilled/mt-en-de-mono",
        warmup_steps=200,
        eval_every=1000,
        time_limit_min=60,
        pick="tokens-per-call",
    )
    return TrainConfig(task="mt-en-de", out_dir=f"runs/{name}", **{**defaults, **fields})


# Presets: each trains on a 2-core CPU in about an hour (see README for measured times).
PRESETS: dict[str, TrainConfig] = {
    # The mt-en-de model is the large model, verifier and teacher of the speculative decoders: 6+6 layers
    # of width 256 (13.1M parameters), so that BiLD's small model takes about 1/6 of its greedy time on
    # this CPU (README). It keeps the vocabulary of the first, 3+3 mt-en-de model (the shipped tokenizer.json), so
    # the models built on that vocabulary still pair with it. An hour of the 2-core CPU undertrains it:
    # the shipped one was trained on a GPU (README gives the command).
    "mt-en-de": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de",
        enc_layers=6,
        dec_layers=6,
        dropout=0.2,
        batch_tokens=8192,
        time_limit_min=60,
        lr=1e-3,
        warmup_steps=800,
        eval_every=400,
        tokenizer_from="checkpoints/mt-en-de/tokenizer.json",
    ),
    "gec-uk": TrainConfig(task="gec-uk", out_dir="runs/gec-uk", time_limit_min=60),
    "gec-en": TrainConfig(task="gec-en", out_dir="runs/gec-en", time_limit_min=60),
    # The SAD pair (Sun et al. 2021): a balanced 6+6 model and a deep-encoder/shallow-decoder 9+3 one
    # of about the same size (7.7M and 7.3M parameters; a decoder layer has cross-attention and so
    # 4/3 the weights of an encoder layer). d_model 192 keeps each float16 checkpoint near 15 MB.
    # Both train side by side on the 2 cores, one thread each, for 95 minutes.
    "gec-uk-6x6": sad_preset("gec-uk", 6, 6),
    "gec-uk-9x3": sad_preset("gec-uk", 9, 3),
    # The same pair on English (data/gec-en: Brown and State of the Union sentences with synthetic errors).
    "gec-en-6x6": sad_preset("gec-en", 6, 6),
    "gec-en-9x3": sad_preset("gec-en", 9, 3),
    # The models of the speculative decoders on mt-en-de, all starting from or sharing the vocabulary of
    # the mt-en-de model. The distilled corpora come from `python -m refdec distill` (see README).
    # Times are for the 2-core CPU; the shipped ones were trained on a GPU (README gives the commands).
    # GAD (Ge et al. 2022): verifier and drafter both learn a shared teacher's outputs (Seq-KD). Here
    # the teacher is the verifier itself (checkpoints/mt-en-de, whose greedy outputs are shipped):
    # the drafter learns exactly what the verifier will accept, and the verifier stays the model every
    # other decoder is measured with. mt-en-de-distilled is the paper's other half, a verifier
    # fine-tuned on a beam-5 distilled corpus (python -m refdec distill --algo beam, README).
    "mt-en-de-distilled": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-distilled",
        init_from="checkpoints/mt-en-de/model.pt",
        data_dir="data/distilled/mt-en-de-beam5",
        lr=5e-4,
        warmup_steps=200,
        eval_every=400,
        time_limit_min=60,
    ),
    # The block drafter: 2 decoder layers of width 256 on the verifier's frozen encoder (the encoder
    # runs once for both when decoding), k = 8 masks, causal prefix (its keys and values are cached).
    "mt-en-de-drafter": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-drafter",
        encoder_from="checkpoints/mt-en-de/model.pt",
        data_dir="data/distilled/mt-en-de-greedy",
        enc_layers=0,
        dec_layers=2,
        drafter_k=8,
        lr=1e-3,
        warmup_steps=800,
        eval_every=500,
        time_limit_min=60,
        pick="tokens-per-call",
    ),
    # Blockwise parallel decoding (Stern et al. 2018): k = 10 (9 heads of hidden width 128, the mean of
    # their losses) on the base model's own greedy outputs (Seq-KD, section 6), the base frozen: exact
    # blockwise decoding is then the mt-en-de model's greedy output. Fine-tuning the base with the
    # heads (--freeze-base false --head-loss base+random) cost this base about a BLEU point for 0.04
    # more accepted tokens per call (README, "Blockwise parallel decoding").
    "mt-en-de-blockwise": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-blockwise",
        init_from="checkpoints/mt-en-de/model.pt",
        data_dir="data/distilled/mt-en-de-greedy",
        proposal_k=10,
        proposal_d_ff=128,
        freeze_base=True,
        head_loss="mean",
        lr=5e-4,
        warmup_steps=200,
        eval_every=400,
        time_limit_min=60,
        pick="tokens-per-call",
    ),
    # Drafters and heads that start from what the verifier knows, on the verifier's greedy outputs for the
    # training sources and 203k monolingual sentences (data/distilled/mt-en-de-mono). The drafter's
    # decoder starts as the verifier's first 2 decoder layers with its embeddings, final norm and output
    # projection (SpecDec's drafter starts from its verifier's encoder too: here it reads that encoder).
    "mt-en-de-drafter-from-verifier": mono_preset(
        "mt-en-de-drafter-from-verifier",
        init_from=VERIFIER,
        encoder_from=VERIFIER,
        enc_layers=0,
        dec_layers=2,
        drafter_k=8,
        lr=5e-4,
        warmup_steps=400,
    ),
    # The shipped drafter and heads, trained further (on the larger corpus, at a lower peak rate).
    "mt-en-de-drafter-continue": mono_preset(
        "mt-en-de-drafter-continue",
        init_from="checkpoints/mt-en-de-drafter/model.pt",
        encoder_from=VERIFIER,
        enc_layers=0,
        dec_layers=2,
        drafter_k=8,
        lr=5e-4,
        warmup_steps=200,
    ),
    "mt-en-de-blockwise-continue": mono_preset(
        "mt-en-de-blockwise-continue",
        init_from="checkpoints/mt-en-de-blockwise/model.pt",
        proposal_k=10,
        proposal_d_ff=128,
        freeze_base=True,
        head_loss="mean",
        lr=3e-4,
    ),
    # The heads at the model's own feed-forward width (1024, the paper's), and the regime that fine-tunes
    # the base with them (its own loss in every batch beside one random head: exact blockwise decoding
    # is then the fine-tuned model's greedy output, not the shipped mt-en-de model's).
    "mt-en-de-blockwise-wide": mono_preset(
        "mt-en-de-blockwise-wide", init_from=VERIFIER, proposal_k=10, freeze_base=True, head_loss="mean", lr=5e-4
    ),
    "mt-en-de-blockwise-finetuned": mono_preset(
        "mt-en-de-blockwise-finetuned",
        init_from=VERIFIER,
        proposal_k=10,
        proposal_d_ff=128,
        head_loss="base+random",
        lr=3e-4,
    ),
    # BiLD (Kim et al. 2023): a small model (1 decoder layer of width 128) on the large model's vocabulary,
    # its aligned copy fine-tuned on the large model's greedy outputs (kept as trained last: its dev
    # loss against the references is not what alignment aims at), and the early-exit model.
    "mt-en-de-small": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-small",
        tokenizer_from="checkpoints/mt-en-de/tokenizer.json",
        d_model=128,
        n_heads=4,
        d_ff=512,
        enc_layers=3,
        dec_layers=1,
        lr=1e-3,
        warmup_steps=800,
        eval_every=400,
        time_limit_min=60,
    ),
    "mt-en-de-small-aligned": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-small-aligned",
        init_from="checkpoints/mt-en-de-small/model.pt",
        data_dir="data/distilled/mt-en-de-greedy",
        lr=5e-4,
        warmup_steps=200,
        eval_every=400,
        time_limit_min=30,
        pick="last",
    ),
    # The same decoder (1 layer, width 128) on the large model's frozen encoder, trained on the large
    # model's greedy outputs (aligned from the start): the encoder runs once for both models when decoding.
    "mt-en-de-small-shared": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-small-shared",
        encoder_from="checkpoints/mt-en-de/model.pt",
        data_dir="data/distilled/mt-en-de-greedy",
        d_model=128,
        n_heads=4,
        d_ff=512,
        enc_layers=0,
        dec_layers=1,
        lr=1e-3,
        warmup_steps=800,
        eval_every=500,
        time_limit_min=60,
        pick="last",
    ),
    # The aligned small model, fine-tuned further with the large model's next-token distributions as
    # soft targets (word-level distillation) on the same greedy outputs.
    "mt-en-de-small-kd": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-small-kd",
        init_from="checkpoints/mt-en-de-small-aligned/model.pt",
        data_dir="data/distilled/mt-en-de-greedy",
        kd_from="checkpoints/mt-en-de/model.pt",
        lr=5e-4,
        warmup_steps=200,
        eval_every=500,
        time_limit_min=45,
        pick="last",
    ),
    # The aligned small model, fine-tuned further on the large model's greedy outputs for 203k monolingual
    # English sentences besides the 80k training sources (data/distilled/mt-en-de-mono, README).
    "mt-en-de-small-mono": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-small-mono",
        init_from="checkpoints/mt-en-de-small-aligned/model.pt",
        data_dir="data/distilled/mt-en-de-mono",
        lr=5e-4,
        warmup_steps=200,
        eval_every=1000,
        time_limit_min=45,
        pick="last",
        threads=1,
    ),
    "mt-en-de-early-exit": TrainConfig(
        task="mt-en-de",
        out_dir="runs/mt-en-de-early-exit",
        init_from="checkpoints/mt-en-de/model.pt",
        early_exit=1,
        lr=5e-4,
        warmup_steps=200,
        eval_every=400,
        time_limit_min=60,
    ),
    # Seconds, not minutes: the smoke preset the tests and the torchrun check use.
    "tiny": TrainConfig(
        task="mt-en-de",
        out_dir="runs/tiny",
        vocab_size=600,
        d_model=32,
        n_heads=2,
        d_ff=64,
        enc_layers=1,
        dec_layers=1,
        max_positions=128,
        batch_tokens=600,
        warmup_steps=10,
        max_steps=20,
        eval_every=10,
        eval_sentences=8,
        keep_last=2,
        log_every=5,
    ),
}
