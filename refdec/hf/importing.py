"""A transformers model folder -> a refdec Transformer and its tokenizer.

A folder holds config.json, model.safetensors or pytorch_model.bin (sharded or not: an *.index.json
names the shards) and its tokenizer: tokenizer.json, or what the family has instead (an opus-mt
folder's source.spm and vocab.json, an old BART folder's vocab.json and merges.txt). Its family
(refdec.hf.families) maps config.json onto ModelConfig and each weight name onto refdec's; the model
is then refdec's Transformer with those switches, computing the logits transformers computes.

Special ids are kept as the folder has them (ModelConfig's pad/bos/eos ids, Tokenizer.foreign); the
decoder's start token is its decoder_start_token_id (Marian and T5: the pad token). Forced tokens
are inserted by the model itself, so every decoder honours them unchanged: the source language's code
before every source and BART's <s> (encoder_prefix), the target language's code or the folder's
forced_bos_token_id after the start token (decoder_prefix). A folder's bad_words_ids of one token
each become -inf logits. BART's learned position tables lose their first 2 rows (its offset) here.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..model import Transformer, sinusoidal_positions
from ..tokenizer import MarianPieces, Tokenizer
from .common import HFError, first_line, read_json, read_weights
from .families import FAMILIES, Family, family_of
from .layout import half_split, permute_state

M2M100, PEGASUS = FAMILIES["m2m_100"].architecture, FAMILIES["pegasus"].architecture
MODEL_TYPES = {name: f.architecture for name, f in FAMILIES.items()}
SOURCE_BOS = ("bart",)  # families whose tokenizer writes <s> before every source (BartTokenizer)
LEARNED_OFFSET = 2  # BartLearnedPositionalEmbedding: position p is row p + 2 of the stored table


def model_config(config: dict, family: Family, folder: Path, **over) -> ModelConfig:
    """refdec's ModelConfig for a transformers config.json (`over`: fields the folder's other files
    decide), or one line on what does not fit."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise HFError(f"{folder}: {what}; refdec's Transformer cannot hold this model")

    try:
        return ModelConfig(**{**family.fields(config, need), **over})
    except KeyError as e:
        raise HFError(f"{folder}/config.json has no {e.args[0]}") from None
    except (TypeError, ValueError) as e:
        raise HFError(f"{folder}/config.json: {first_line(e, 200)}") from None


def _embedding(weights: dict[str, torch.Tensor], folder: Path, head_too: bool) -> torch.Tensor:
    """The shared embedding; every copy the files hold must be equal (the output one too if `head_too`)."""
    names = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight") + (
        ("lm_head.weight",) * head_too
    )
    present = [weights[n] for n in names if n in weights]
    if not present:
        raise HFError(f"{folder}: no embedding matrix (shared.weight) in the weights")
    if any(not torch.equal(p, present[0]) for p in present[1:]):
        raise HFError(f"{folder}: the input and output embeddings differ; refdec ties them")
    return present[0]


def load_tokenizer(folder: Path, cfg: ModelConfig) -> Tokenizer | MarianPieces:
    """tokenizer.json of the folder: refdec's own kind when it is one (an exported refdec model),
    else wrapped with the model's special ids."""
    path = folder / "tokenizer.json"
    if not path.is_file() and (folder / "source.spm").is_file() and (folder / "vocab.json").is_file():
        try:  # an opus-mt folder: its sentencepiece model and vocab.json, as transformers' MarianTokenizer reads them
            return MarianPieces(
                folder / "source.spm", folder / "vocab.json", pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id
            )
        except Exception as e:
            raise HFError(
                f"cannot load the tokenizer of {folder} (source.spm, vocab.json): {first_line(e, 200)}"
            ) from None
    if not path.is_file() and (folder / "vocab.json").is_file() and (folder / "merges.txt").is_file():
        text = byte_level_bpe(folder)  # a BART folder from before tokenizer.json
    elif not path.is_file():
        raise HFError(
            f"{folder} has no tokenizer.json (nor an opus-mt source.spm and vocab.json, nor a BART "
            f"vocab.json and merges.txt)"
        )
    else:
        text = path.read_text(encoding="utf-8")
    try:
        return Tokenizer.for_model(text, pad_id=cfg.pad_id, bos_id=cfg.bos_id, eos_id=cfg.eos_id)
    except Exception as e:
        raise HFError(f"cannot load tokenizer {path}: {first_line(e, 200)}") from None


# The tokens whose ids config.json gives and a tokenizer names: (role, config.json's field, the name
# tokenizer_config.json or special_tokens_map.json gives it under, the name every family uses).
NAMED_SPECIALS = (("end", "eos_token_id", "eos_token", "</s>"), ("padding", "pad_token_id", "pad_token", "<pad>"))
CONTRACT = "(docs/hf.md, section The tokenizer of a folder)"


def check_special_tokens(folder: Path, tokenizer, cfg: ModelConfig) -> None:
    """The contract between a folder's tokenizer and its config.json (docs/hf.md): the end and padding
    tokens the tokenizer names (tokenizer_config.json's eos_token and pad_token, else </s> and <pad>
    where its vocabulary has them) sit at config.json's eos_token_id and pad_token_id, and every id
    the model starts, ends, pads or is forced with is a token of the tokenizer. One line otherwise:
    decoding would stop at, or drop, tokens the tokenizer does not mean so."""
    names = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        if (folder / name).is_file():
            names.update({k: v for k, v in read_json(folder / name).items() if k in ("eos_token", "pad_token")})
    ids = {"eos_token_id": cfg.eos_id, "pad_token_id": cfg.pad_id}
    for role, field, key, usual in NAMED_SPECIALS:
        named = names.get(key)
        token = (named.get("content") if isinstance(named, dict) else named) or usual
        at = tokenizer.token_id(token)
        if at is None and named:
            raise HFError(f"{folder}: its {key} {token!r} is not a token of its tokenizer {CONTRACT}")
        if at is not None and at != ids[field]:
            raise HFError(
                f"{folder}: config.json's {field} is {ids[field]} but the tokenizer has its {role} token "
                f"{token!r} at {at}; the model and its tokenizer must agree on it {CONTRACT}"
            )
    used = {
        "eos_token_id": cfg.eos_id,
        "pad_token_id": cfg.pad_id,
        "decoder_start_token_id": cfg.bos_id,
        **{f"forced token {i}": i for i in (*cfg.encoder_prefix, *cfg.decoder_prefix)},
    }
    for field, i in used.items():
        if not 0 <= i < tokenizer.vocab_size:
            where = field if field.startswith("forced") else f"config.json's {field} {i}"
            raise HFError(
                f"{folder}: {where} is not a token of its tokenizer ({tokenizer.vocab_size} tokens) {CONTRACT}"
            )


def byte_level_bpe(folder: Path) -> str:
    """The tokenizer.json text of a folder's vocab.json and merges.txt, built as transformers 5 builds
    BartTokenizer (RobertaTokenizer): byte-level BPE, its special tokens matched in the text,
    add_prefix_space from tokenizer_config.json (false by default)."""
    from tokenizers import Tokenizer as Tok
    from tokenizers import decoders, models, pre_tokenizers

    try:
        settings = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
        tok = Tok(
            models.BPE.from_file(
                str(folder / "vocab.json"),
                str(folder / "merges.txt"),
                dropout=None,
                continuing_subword_prefix="",
                end_of_word_suffix="",
                fuse_unk=False,
            )
        )
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=bool(settings.get("add_prefix_space", False)))
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(
            [t for t in ("<s>", "<pad>", "</s>", "<unk>", "<mask>") if tok.token_to_id(t) is not None]
        )
        return tok.to_str()
    except Exception as e:
        raise HFError(f"cannot read {folder}/vocab.json and merges.txt: {first_line(e, 200)}") from None


def language_ids(tokenizer: Tokenizer, folder: Path, config: dict, src_lang: str | None, tgt_lang: str | None):
    """(encoder_prefix, decoder_prefix): the language-code tokens named, the target's defaulting to
    the folder's forced_bos_token_id (config.json or generation_config.json)."""

    def token(name: str, what: str) -> int:
        i = tokenizer.token_id(name)
        if i is None:
            raise HFError(f"{what} {name!r} is not a token of {folder}'s vocabulary")
        return i

    enc = (token(src_lang, "--src-lang"),) if src_lang else ()
    if tgt_lang:
        return enc, (token(tgt_lang, "--tgt-lang"),)
    gen = folder / "generation_config.json"
    forced = config.get("forced_bos_token_id")
    if forced is None and gen.is_file():
        forced = read_json(gen).get("forced_bos_token_id")
    return enc, ((forced,) if forced is not None else ())


def load_folder(
    folder: str | Path,
    *,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
) -> tuple[Transformer, Tokenizer, dict]:
    """A transformers model folder -> (refdec model in eval mode, tokenizer, a checkpoint-like dict)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise HFError(f"model folder {folder} not found")
    if not (folder / "config.json").is_file():
        raise HFError(f"{folder} has no config.json (not a transformers model folder)")
    config = read_json(folder / "config.json")
    family = family_of(config, folder)
    cfg = model_config(config, family, folder)  # what does not fit is told before the tokenizer is read
    tokenizer = load_tokenizer(folder, cfg)
    enc, dec = language_ids(tokenizer, folder, config, src_lang, tgt_lang)
    if family.name in SOURCE_BOS:
        enc = (config.get("bos_token_id", 0),) + enc
    weights = read_weights(folder)
    shared = weights.get("shared.weight", weights.get("encoder.embed_tokens.weight"))
    # T5 v1.1 / Flan-T5 keep an lm_head of their own; the other families tie it to the embedding
    untied = family.name == "t5" and "lm_head.weight" in weights and not torch.equal(weights["lm_head.weight"], shared)
    banned = banned_tokens(folder)
    cfg = model_config(
        config,
        family,
        folder,
        encoder_prefix=enc,
        decoder_prefix=dec,
        tie_embeddings=not untied,
        **({"logits_bias": True} if banned else {}),
    )
    if tokenizer.vocab_size > cfg.vocab_size:
        raise HFError(
            f"{folder}/tokenizer.json has {tokenizer.vocab_size} tokens but the model {cfg.vocab_size} embeddings"
        )
    check_special_tokens(folder, tokenizer, cfg)
    model = Transformer(cfg)
    state = _state(model, family, weights, folder)
    if banned:  # -inf logits: never written, as transformers' NoBadWordsLogitsProcessor does at every step
        state["logits_bias"][list(banned)] = float("-inf")
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise HFError(f"{folder}: weights do not fit config.json: {first_line(e, 200)}") from None
    model.to(device=device, dtype=dtype).eval()
    return (
        model,
        tokenizer,
        {
            "format": "transformers",
            "task": None,
            "step": None,
            "architecture": family.architecture,
            "model_config": cfg.to_dict(),
            "meta": {"folder": str(folder)},
        },
    )


def banned_tokens(folder: Path) -> tuple[int, ...]:
    """The tokens the folder's generation_config.json forbids (bad_words_ids of one token each: opus-mt
    folders forbid their pad token), or one line for a banned sequence, which depends on the context."""
    gen = folder / "generation_config.json"
    bad = (read_json(gen).get("bad_words_ids") if gen.is_file() else None) or []
    if any(len(seq) != 1 for seq in bad):
        raise HFError(f"{gen}: bad_words_ids of more than one token; refdec forbids single tokens only")
    return tuple(seq[0] for seq in bad)


def _state(
    model: Transformer, family: Family, weights: dict[str, torch.Tensor], folder: Path
) -> dict[str, torch.Tensor]:
    """refdec's state dict for `model` from the folder's tensors, renamed (and reshaped) per family."""
    cfg, names = model.cfg, family.names(model.cfg)
    keys = [k for k in model.state_dict() if k != "src_embed.weight" or not cfg.tie_embeddings]
    missing = sorted(
        names.get(k, k)
        for k in keys
        if names.get(k, k) not in weights and names.get(k) not in ("shared.weight", "final_logits_bias")
    )
    if missing:
        raise HFError(f"{folder}: {len(missing)} weight(s) missing from the files, e.g. {missing[0]}")
    state = {}
    for key in keys:
        theirs = names.get(key, key)
        if theirs == "shared.weight" or key == "src_embed.weight":
            t = _embedding(weights, folder, head_too=cfg.tie_embeddings)
        elif theirs == "final_logits_bias":  # transformers starts it at zeros when a folder has none
            t = weights.get(theirs, torch.zeros(1, cfg.vocab_size)).reshape(-1)
        elif key.endswith("_positions"):  # learned: drop the offset rows, keep max_positions
            t = weights[theirs][LEARNED_OFFSET : LEARNED_OFFSET + cfg.max_positions]
        else:
            t = weights[theirs]
        state[key] = t.float()
    if family.architecture == PEGASUS:  # refdec's own export: undo its permutation and check the table it carries
        perm = half_split(cfg.d_model)
        state = permute_state(state, torch.argsort(perm))
        table = sinusoidal_positions(cfg.max_positions, cfg.d_model)[:, perm]
        for side in ("encoder", "decoder"):
            stored = weights.get(f"{side}.embed_positions.weight")
            if stored is None or stored.shape != table.shape or not torch.equal(stored, table.to(stored.dtype)):
                raise HFError(
                    f"{folder}: the {side}'s position table is not refdec's sinusoidal table; refdec imports "
                    f"Pegasus folders that `python -m refdec hf export` wrote"
                )
    if cfg.tie_embeddings:
        state["src_embed.weight"] = state["tgt_embed.weight"]
    return state
