"""Each transformers family refdec imports: its config.json mapped onto ModelConfig's fields, and its
weight names mapped onto refdec's state-dict keys.

    family   architecture                     what differs from the paper's Transformer (ModelConfig)
    m2m100   M2M100ForConditionalGeneration   positions "m2m100" (NLLB too)
    pegasus  PegasusForConditionalGeneration  none: the layout `python -m refdec hf export` writes
    marian   MarianMTModel                    post-norm, positions "marian", activation (opus-mt: swish),
                                              logits_bias; the decoder starts from the pad token
    bart     BartForConditionalGeneration     post-norm, positions "learned", embed_norm, gelu, logits_bias,
                                              scale_embeddings false (bart-large); <s> before the source,
                                              the start token </s> followed by the forced <s>
    mbart    MBartForConditionalGeneration    pre-norm, positions "learned", embed_norm, logits_bias, gelu;
                                              mBART-50's language codes as forced tokens
    t5       T5ForConditionalGeneration       norm "rms", positions "relative", scale_attention false,
                                              bias false, d_head, scale_embeddings false; v1.0: relu,
                                              tied head rescaled (rescale_head); v1.1 / Flan-T5: gated
                                              gelu_new, untied head; the decoder starts from pad

Every mapping reads the fields transformers' own configuration class reads (its defaults where a
config.json leaves one out), so a folder means here what it means to transformers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import ACTIVATIONS, ModelConfig
from .common import HFError
from .layout import hf_names

# transformers' ACT2FN names -> refdec.config.ACTIVATIONS ("swish" is nn.SiLU there)
HF_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_new", "swish": "silu", "silu": "silu"}
assert set(HF_ACTIVATIONS.values()) <= set(ACTIVATIONS)


@dataclass(frozen=True)
class Family:
    name: str
    architecture: str  # the class config.json's "architectures" names
    fields: Callable[[dict, Callable], dict]  # (config.json, need) -> ModelConfig fields
    names: Callable[[ModelConfig], dict[str, str]]  # refdec key -> transformers key ("model." dropped)


def _activation(config: dict, need, default: str) -> str:
    name = config.get("activation_function", default)
    need(name in HF_ACTIVATIONS, f"activation {name!r} (refdec has {', '.join(sorted(HF_ACTIVATIONS))})")
    return HF_ACTIVATIONS[name]


def _bart_like(config: dict, need, *, activation: str, scale: bool) -> dict:
    """The fields every BART-shaped config names the same way (M2M100, Marian, BART, mBART, Pegasus)."""
    need(
        config.get("encoder_attention_heads") == config.get("decoder_attention_heads"),
        "different encoder and decoder head counts",
    )
    need(
        config.get("encoder_ffn_dim") == config.get("decoder_ffn_dim"),
        "different encoder and decoder feed-forward widths",
    )
    need(config.get("encoder_layers", 0) >= 1, "no encoder layers")
    need(config.get("tie_word_embeddings", True) is not False, "untied input and output embeddings")
    start = config.get("decoder_start_token_id")
    need(start is not None, "no decoder_start_token_id")
    return dict(
        vocab_size=config["vocab_size"],
        d_model=config["d_model"],
        n_heads=config["encoder_attention_heads"],
        d_ff=config["encoder_ffn_dim"],
        enc_layers=config["encoder_layers"],
        dec_layers=config["decoder_layers"],
        dropout=config.get("dropout", 0.1),
        max_positions=config["max_position_embeddings"],
        pad_id=config["pad_token_id"],
        bos_id=start,
        eos_id=config["eos_token_id"],
        activation=_activation(config, need, activation),
        scale_embeddings=bool(config.get("scale_embedding", scale)),
    )


def m2m100_fields(config: dict, need) -> dict:
    return {**_bart_like(config, need, activation="relu", scale=True), "positions": "m2m100"}


def pegasus_fields(config: dict, need) -> dict:
    return _bart_like(config, need, activation="gelu", scale=True)


def marian_fields(config: dict, need) -> dict:
    """MarianConfig (Helsinki-NLP/opus-mt-*): post-norm layers, the static sinusoidal table, one
    vocabulary for both sides (share_encoder_decoder_embeddings), final_logits_bias."""
    need(
        config.get("share_encoder_decoder_embeddings", True),
        "separate source and target vocabularies (share_encoder_decoder_embeddings false)",
    )
    need(config.get("decoder_vocab_size") in (None, config.get("vocab_size")), "a decoder_vocab_size of its own")
    if config.get("decoder_start_token_id") is None:  # MarianConfig's default start: its pad token
        config = {**config, "decoder_start_token_id": config.get("pad_token_id", 58100)}
    config = {"pad_token_id": 58100, "eos_token_id": 0, **config}  # MarianConfig's defaults
    return {
        **_bart_like(config, need, activation="gelu", scale=False),
        "norm_first": False,
        "positions": "marian",
        "logits_bias": True,
    }


def bart_fields(config: dict, need, *, start: int | None = 2) -> dict:
    """BartConfig (facebook/bart-base, bart-large, their GEC and summarisation fine-tunes): post-norm,
    learned positions (offset 2), layernorm_embedding, final_logits_bias; `start` the configuration
    class's default decoder_start_token_id (BartConfig's 2, MBartConfig none)."""
    config = {"pad_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": start, **config}  # its defaults
    return {
        **_bart_like(config, need, activation="gelu", scale=False),
        "norm_first": False,
        "positions": "learned",
        "embed_norm": True,
        "logits_bias": True,
    }


def mbart_fields(config: dict, need) -> dict:
    """MBartConfig (facebook/mbart-large-50*, mbart-large-cc25): BART's fields but pre-norm with final
    norms, and no default decoder_start_token_id."""
    return {**bart_fields(config, need, start=None), "norm_first": True}


def t5_fields(config: dict, need) -> dict:
    """T5Config (t5-small/base/large: relu, tied and rescaled head; google/t5-v1_1-*, google/flan-t5-*:
    gated-gelu, untied head): RMS norms, relative position buckets, no attention scaling, no biases."""
    proj = config.get("feed_forward_proj", "relu")
    act = proj.split("-")[-1]
    act = "gelu_new" if proj == "gated-gelu" else act  # T5Config's own rewrite of the old name
    need(act in HF_ACTIVATIONS, f"feed_forward_proj {proj!r}")
    # T5Config.scale_decoder_outputs: saved by transformers 5, else true unless tie_word_embeddings is false
    rescale = config.get("scale_decoder_outputs", config.get("tie_word_embeddings") is not False)
    pad = config.get("pad_token_id", 0)
    start = config.get("decoder_start_token_id")
    return dict(
        vocab_size=config.get("vocab_size", 32128),
        d_model=config.get("d_model", 512),
        n_heads=config.get("num_heads", 8),
        d_head=config.get("d_kv", 64),
        d_ff=config.get("d_ff", 2048),
        enc_layers=config.get("num_layers", 6),
        dec_layers=config.get("num_decoder_layers") or config.get("num_layers", 6),
        dropout=config.get("dropout_rate", 0.1),
        norm_first=True,
        norm="rms",
        norm_eps=config.get("layer_norm_epsilon", 1e-6),
        bias=False,
        scale_attention=False,
        scale_embeddings=False,
        positions="relative",
        activation=HF_ACTIVATIONS[act],
        gated_ff=proj.startswith("gated-"),
        rescale_head=bool(rescale),
        relative_buckets=config.get("relative_attention_num_buckets", 32),
        relative_max_distance=config.get("relative_attention_max_distance", 128),
        # T5 has no position table: the longest sequence is the user's choice (n_positions, else 512)
        max_positions=config.get("n_positions", 512),
        pad_id=pad,
        bos_id=pad if start is None else start,
        eos_id=config.get("eos_token_id", 1),
    )


def bart_names(cfg: ModelConfig) -> dict[str, str]:
    """hf_names plus the tensors only some BART-shaped families have (each present when cfg has it)."""
    names = hf_names(cfg)
    for ours, side in (("src", "encoder"), ("tgt", "decoder")):
        names[f"{ours}_positions"] = f"{side}.embed_positions.weight"
        for p in ("weight", "bias"):
            names[f"{ours}_embed_norm.{p}"] = f"{side}.layernorm_embedding.{p}"
    names["logits_bias"] = "final_logits_bias"
    names["src_embed.weight"] = "shared.weight"
    return names


_T5_ATTN = {"wq": "q", "wk": "k", "wv": "v", "wo": "o"}


def t5_names(cfg: ModelConfig) -> dict[str, str]:
    """T5's block/layer names: encoder layer i = [SelfAttention, DenseReluDense], decoder layer i =
    [SelfAttention, EncDecAttention, DenseReluDense], each with its layer_norm."""
    names = {
        "tgt_embed.weight": "shared.weight",
        "src_embed.weight": "shared.weight",
        "out_proj.weight": "lm_head.weight",
        "enc_norm.weight": "encoder.final_layer_norm.weight",
        "dec_norm.weight": "decoder.final_layer_norm.weight",
        "src_relative.embedding.weight": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
        "tgt_relative.embedding.weight": "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    }
    ff = {"w1": "wi_0" if cfg.gated_ff else "wi", "w3": "wi_1", "w2": "wo"}
    for side, n, parts in (
        ("encoder", cfg.enc_layers, [("attn", "SelfAttention"), ("ff", "DenseReluDense")]),
        (
            "decoder",
            cfg.dec_layers,
            [("self_attn", "SelfAttention"), ("cross_attn", "EncDecAttention"), ("ff", "DenseReluDense")],
        ),
    ):
        for i in range(n):
            for j, (ours, theirs) in enumerate(parts):
                at = f"{side}.block.{i}.layer.{j}"
                names[f"{side}.{i}.sub{j + 1}.norm.weight"] = f"{at}.layer_norm.weight"
                table = ff if ours == "ff" else _T5_ATTN
                for a, b in table.items():
                    names[f"{side}.{i}.{ours}.{a}.weight"] = f"{at}.{theirs}.{b}.weight"
    return names


FAMILIES = {
    f.name: f
    for f in (
        Family("m2m_100", "M2M100ForConditionalGeneration", m2m100_fields, bart_names),
        Family("pegasus", "PegasusForConditionalGeneration", pegasus_fields, bart_names),
        Family("marian", "MarianMTModel", marian_fields, bart_names),
        Family("bart", "BartForConditionalGeneration", bart_fields, bart_names),
        Family("mbart", "MBartForConditionalGeneration", mbart_fields, bart_names),
        Family("t5", "T5ForConditionalGeneration", t5_fields, t5_names),
    )
}


def family_of(config: dict, folder) -> Family:
    """The family of a config.json (its model_type, and its architectures when named), or one line."""
    family = FAMILIES.get(config.get("model_type"))
    if family is None or (config.get("architectures") and family.architecture not in config["architectures"]):
        got = ", ".join(config.get("architectures") or []) or config.get("model_type") or "unknown"
        known = ", ".join(f.architecture for f in FAMILIES.values())
        raise HFError(f"{folder}: unsupported architecture {got}; refdec imports {known}")
    return family
