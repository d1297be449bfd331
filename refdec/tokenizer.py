"""Byte-level BPE (Sennrich et al. 2016; GPT-2's byte-level variant) trained with the `tokenizers`
library, one joint source/target vocabulary per task, saved as tokenizer.json beside a checkpoint.

Byte-level means every string is representable: other scripts, emoji and control characters become
byte tokens instead of <unk>, so decode(encode(text)) == text for any text. <unk> keeps its id for
models and data that need one. Ids 0-4 are the special tokens pad, bos, eos, unk, mask (mask is the
placeholder of the non-autoregressive drafter).

A Hugging Face model's tokenizer.json (refdec.hf) is wrapped too, with that model's special ids
(`Tokenizer.foreign`): the same methods, its own vocabulary, pieces and specials. An opus-mt folder
has no tokenizer.json but a sentencepiece model and vocab.json: `MarianPieces`, the same methods.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from .config import BOS_ID, EOS_ID, MASK_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID
from .repo import install_hint


class Tokenizer:
    """Text <-> token ids. `encode` adds no bos/eos: the decoders add what they need, and never
    produces ids 0-4, whatever the text (a literal "<s>" in the input is just text)."""

    pad_id, bos_id, eos_id, unk_id, mask_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID, MASK_ID

    def __init__(self, tok: HFTokenizer, json_text: str):
        self._tok = tok
        self.json_text = json_text
        for i, name in enumerate(SPECIAL_TOKENS):
            if tok.token_to_id(name) != i:
                raise ValueError(f"tokenizer does not have {name} at id {i}: not a refdec tokenizer")
        self.special_ids = frozenset(range(len(SPECIAL_TOKENS)))
        self.byte_level = True

    @classmethod
    def foreign(cls, json_text: str, *, pad_id: int, bos_id: int, eos_id: int) -> Tokenizer:
        """Another model's tokenizer.json with that model's special ids (unk: its model's unk_token);
        its special tokens (those ids and the file's special added tokens: language codes, mask)
        never appear in decoded text."""
        self = cls.__new__(cls)
        self._tok, self.json_text = HFTokenizer.from_str(json_text), json_text
        unk = getattr(self._tok.model, "unk_token", None)
        unk_id = self._tok.token_to_id(unk) if isinstance(unk, str) else None
        self.pad_id, self.bos_id, self.eos_id, self.unk_id, self.mask_id = pad_id, bos_id, eos_id, unk_id, None
        added = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(added | {i for i in (pad_id, bos_id, eos_id, unk_id) if i is not None})
        self.byte_level = isinstance(self._tok.decoder, decoders.ByteLevel)
        return self

    @classmethod
    def for_model(cls, json_text: str, *, pad_id: int, bos_id: int, eos_id: int) -> Tokenizer:
        """A tokenizer.json with a model's special ids: refdec's own kind when it is one with these ids
        (a refdec model, exported or not), else wrapped as another model's (`foreign`)."""
        try:
            tok = cls(HFTokenizer.from_str(json_text), json_text)
            if (tok.pad_id, tok.bos_id, tok.eos_id) == (pad_id, bos_id, eos_id):
                return tok
        except ValueError:  # not refdec's layout of special tokens: another model's
            pass
        return cls.foreign(json_text, pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
        tok = HFTokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=list(SPECIAL_TOKENS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        # The specials stay in the BPE vocabulary (ids 0-4) but are not "added tokens": added tokens
        # are matched in raw text, so an input that literally contains "<mask>" or "</s>" would turn
        # into a control token. Without them, such text is ordinary bytes like any other.
        spec = json.loads(tok.to_str())
        spec["added_tokens"] = []
        text = json.dumps(spec, ensure_ascii=False)
        return cls(HFTokenizer.from_str(text), text)

    @classmethod
    def load(cls, path: str | Path) -> Tokenizer:
        text = Path(path).read_text(encoding="utf-8")
        return cls(HFTokenizer.from_str(text), text)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.json_text, encoding="utf-8")

    @property
    def sha256(self) -> str:
        """Identifies the vocabulary; checkpoints record it so a mismatched pair is refused."""
        return hashlib.sha256(self.json_text.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text; special tokens (bos, eos, pad, mask) are dropped."""
        return self._tok.decode([int(i) for i in ids if int(i) not in self.special_ids], skip_special_tokens=True)

    def invalid_bytes(self, ids: Iterable[int]) -> int:
        """How many bytes of `decode(ids)` are not valid UTF-8 (a model can write part of a multi-byte
        character); `decode` shows each such sequence as U+FFFD, Unicode's replacement character."""
        piece = _token_bytes if self.byte_level else _piece_bytes
        raw = b"".join(piece(self._tok.id_to_token(int(i)) or "") for i in ids if int(i) not in self.special_ids)
        return len(raw) - len(raw.decode("utf-8", errors="ignore").encode("utf-8"))

    def tokens(self, ids: Iterable[int]) -> list[str]:
        """Readable pieces for traces (byte-level symbols, e.g. 'Ġ' marks a leading space)."""
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_id(self, token: str) -> int | None:
        """The id of a token of the vocabulary (a language code), or None."""
        return self._tok.token_to_id(token)


class MarianPieces:
    """An opus-mt folder's tokenizer, as transformers' MarianTokenizer reads it (one vocabulary for
    both sides): source.spm cuts the text into sentencepiece pieces, vocab.json numbers them (a piece
    it lacks is <unk>), a leading language code such as >>fra<< is one token; ids join back to text
    through the same sentencepiece model. The same methods as Tokenizer; needs sentencepiece."""

    mask_id, byte_level = None, False

    def __init__(self, spm_path: Path, vocab_path: Path, *, pad_id: int, bos_id: int, eos_id: int):
        try:
            import sentencepiece
        except ImportError:
            raise ImportError(
                f"an opus-mt folder without tokenizer.json needs the sentencepiece package ({install_hint('hf')})"
            ) from None
        raw_spm, raw_vocab = Path(spm_path).read_bytes(), Path(vocab_path).read_bytes()
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=raw_spm)
        self._ids: dict[str, int] = json.loads(raw_vocab)
        self._pieces = {i: p for p, i in self._ids.items()}
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = pad_id, bos_id, eos_id, self._ids["<unk>"]
        self.special_ids = frozenset({pad_id, bos_id, eos_id, self.unk_id})
        self.sha256 = hashlib.sha256(hashlib.sha256(raw_spm).digest() + raw_vocab).hexdigest()
        self.vocab_size = max(self._ids.values()) + 1

    def encode(self, text: str) -> list[int]:
        code = []
        if text.startswith(">>") and (end := text.find("<<")) != -1:  # MarianTokenizer.remove_language_code
            code, text = [text[: end + 2]], text[end + 2 :]
        return [self._ids.get(p, self.unk_id) for p in code + self._sp.encode(text, out_type=str)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Token ids -> text, special tokens dropped (MarianTokenizer's decode, skip_special_tokens)."""
        pieces = [self._pieces.get(int(i), "<unk>") for i in ids if int(i) not in self.special_ids]
        return self._sp.decode_pieces(pieces).replace("\u2581", " ").strip()

    def invalid_bytes(self, ids: Iterable[int]) -> int:
        """How many invalid byte sequences `decode(ids)` holds: sentencepiece writes each (byte-fallback
        pieces <0xNN> that form no character) as one U+FFFD, counted here."""
        return self.decode(ids).count("\ufffd")

    def tokens(self, ids: Iterable[int]) -> list[str]:
        return [self._pieces.get(int(i), "<unk>") for i in ids]

    def token_id(self, token: str) -> int | None:
        return self._ids.get(token)


def _byte_symbols() -> dict[str, int]:
    """Byte-level BPE's alphabet: each byte is written as one printable character (printable
    Latin-1 bytes as themselves, the other bytes as the characters from U+0100 on, in byte order)."""
    printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    symbols = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in symbols.values())
    symbols.update({chr(256 + n): b for n, b in enumerate(others)})
    return symbols


_BYTE_OF = _byte_symbols()


def _token_bytes(token: str) -> bytes:
    return bytes(_BYTE_OF[c] for c in token)


def _piece_bytes(token: str) -> bytes:
    """A SentencePiece-style piece's bytes: <0xNN> byte-fallback pieces are that byte, '▁' a space."""
    if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
        try:
            return bytes([int(token[3:5], 16)])
        except ValueError:
            pass
    return token.replace("\u2581", " ").encode("utf-8")


def iter_training_text(pairs: Iterator[tuple[str, str]]) -> Iterator[str]:
    """Both sides of every pair: the vocabulary is joint (IAD copies source tokens as the draft)."""
    for src, tgt in pairs:
        yield src
        yield tgt
