"""refdec.hf on the families people deploy: Marian (opus-mt), BART, mBART, T5 v1.0 and v1.1 / Flan-T5.

Tiny random models built by transformers from each family's config class (nothing downloaded),
saved with a word-level tokenizer.json, imported: float64 logits within 1e-12 of transformers';
greedy, beam(1), IAD, speculative decoding (a smaller model of the same family) and batched decoding
write transformers' greedy output on many random sources; mBART's forced language codes hold under
every decoder; decode.py --model FOLDER (no --task) writes transformers' greedy text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers, subprocess runs

from conftest import one_line_error, run_py  # noqa: E402
from hf_helpers import LANGS, WORDS, m2m_folder, sources, word_tokenizer_json  # noqa: E402

from refdec import hf  # noqa: E402
from refdec.decoding import decode_beam, decode_bild, decode_greedy, decode_iad, decode_speculative  # noqa: E402
from refdec.routes import on_route  # noqa: E402

transformers.logging.set_verbosity_error()
V = 4 + len(WORDS) + len(LANGS)  # <s> 0, <pad> 1, </s> 2, <unk> 3, words, language codes
FAMILIES = ("marian", "bart", "mbart", "t5", "t5-v1.1")


def hf_model(family: str, layers: int = 2):
    """A transformers model of `family` with `layers` encoder and decoder layers (d_model 16)."""
    bart_like = dict(
        vocab_size=V,
        d_model=16,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )
    t5 = dict(
        vocab_size=V,
        d_model=16,
        d_kv=6,
        num_heads=3,
        d_ff=32,
        num_layers=layers,
        num_decoder_layers=layers,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=20,
        pad_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
    )
    if family == "marian":  # opus-mt: swish, scaled embeddings, the decoder starts from pad
        return transformers.MarianMTModel(
            transformers.MarianConfig(
                **bart_like, decoder_start_token_id=1, scale_embedding=True, activation_function="swish"
            )
        )
    if family == "bart":
        return transformers.BartForConditionalGeneration(transformers.BartConfig(**bart_like, decoder_start_token_id=2))
    if family == "mbart":
        return transformers.MBartForConditionalGeneration(
            transformers.MBartConfig(**bart_like, decoder_start_token_id=2)
        )
    if family == "t5":  # v1.0: relu, tied head rescaled by d_model^-0.5
        return transformers.T5ForConditionalGeneration(transformers.T5Config(**t5))
    # v1.1 / Flan-T5: gated-gelu, an untied head (made to differ from the embedding below)
    return transformers.T5ForConditionalGeneration(
        transformers.T5Config(**t5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    )


def family_folder(path: Path, family: str, seed: int = 0, layers: int = 2) -> Path:
    """A random model of `family` (every weight, bias and final_logits_bias perturbed) saved by transformers, with the
    word-level tokenizer.json; BART's generation_config forces <s> after the start token, as
    facebook/bart-large's does."""
    torch.manual_seed(seed)
    model = hf_model(family, layers)
    with torch.no_grad():  # matrices perturbed more than gains and biases: post-norm models then vary their outputs
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.05))
        if hasattr(model, "final_logits_bias"):
            model.final_logits_bias.add_(torch.randn_like(model.final_logits_bias) * 0.05)
        if family == "t5-v1.1":
            model.lm_head.weight = torch.nn.Parameter(
                model.shared.weight.detach().clone() + torch.randn_like(model.shared.weight)
            )
    model.save_pretrained(path)
    (path / "tokenizer.json").write_text(word_tokenizer_json(), encoding="utf-8")
    if family == "bart":
        gen = json.loads((path / "generation_config.json").read_text())
        (path / "generation_config.json").write_text(json.dumps({**gen, "forced_bos_token_id": 0}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    """family -> (large folder, small folder of the same family and vocabulary), built on first use."""
    made = {}

    def get(family: str):
        if family not in made:
            root = tmp_path_factory.mktemp(family)
            made[family] = (
                family_folder(root / "large", family),
                family_folder(root / "small", family, seed=1, layers=1),
            )
        return made[family]

    return get


def padded(srcs: list[list[int]], eos: int = 2, pad: int = 1) -> torch.Tensor:
    batch = torch.full((len(srcs), max(map(len, srcs)) + 1), pad)
    for i, s in enumerate(srcs):
        batch[i, : len(s) + 1] = torch.tensor(s + [eos])
    return batch


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_every_decoder_equal_transformers_greedy(family, folders):
    large, small = folders(family)
    theirs = hf.hf_from_pretrained(large, torch.float64)
    model, _, _ = hf.load_folder(large, dtype=torch.float64)
    drafter, _, _ = hf.load_folder(small, dtype=torch.float64)
    srcs = sources(24, seed=2)
    wants = []
    for src in srcs:
        tgt = sources(1, seed=len(src))[0]
        assert (
            hf.refdec_logits(model, src, tgt) - hf.hf_logits(theirs, model.cfg, src, tgt)
        ).abs().max() <= hf.LOGIT_TOLERANCE
        want = hf.hf_generate(theirs, model.cfg, src, 20)
        x = torch.tensor([src + [model.cfg.eos_id]])
        assert torch.equal(decode_greedy(model, x, max_len=20).tokens[0], want)
        assert torch.equal(decode_beam(model, x, max_len=20, beam_size=1).tokens[0], want)
        assert torch.equal(decode_iad(model, x, max_len=20).tokens[0], want)
        assert torch.equal(decode_speculative(model, drafter, x, max_len=20, gamma=3).tokens[0], want)
        wants.append(want)
    assert len({tuple(w.tolist()) for w in wants}) > 1  # the sources lead to different outputs
    batch = padded(srcs, model.cfg.eos_id, model.cfg.pad_id)
    for decode in (
        lambda b: decode_greedy(model, b, max_len=20),
        lambda b: decode_iad(model, b, max_len=20),
        lambda b: decode_speculative(model, drafter, b, max_len=20, gamma=3),
    ):
        assert all(torch.equal(o, w) for o, w in zip(decode(batch).tokens, wants))
    assert len(decode_bild(model, drafter, batch, max_len=20).tokens) == len(srcs)  # BiLD runs (not lossless)
    invariant = on_route(hf.load_folder(large, dtype=torch.float64)[0], "invariant")  # T5's bias in rowwise_attention
    assert all(
        torch.equal(decode_iad(invariant, padded([s], model.cfg.eos_id, model.cfg.pad_id), max_len=20).tokens[0], w)
        for s, w in zip(srcs[:6], wants)
    )


def test_family_switches(folders):
    """Each family sets the ModelConfig fields its architecture differs by (docs/hf.md's table)."""
    cfgs = {f: hf.load_folder(folders(f)[0])[0].cfg for f in FAMILIES}
    assert (cfgs["marian"].positions, cfgs["marian"].norm_first, cfgs["marian"].activation, cfgs["marian"].bos_id) == (
        "marian",
        False,
        "silu",
        cfgs["marian"].pad_id,
    )
    assert cfgs["bart"].embed_norm and cfgs["bart"].encoder_prefix == (0,) and cfgs["bart"].decoder_prefix == (0,)
    assert cfgs["mbart"].norm_first and cfgs["mbart"].positions == "learned" and cfgs["mbart"].logits_bias
    assert cfgs["t5"].rescale_head and cfgs["t5"].tie_embeddings and not cfgs["t5"].gated_ff
    assert not cfgs["t5-v1.1"].rescale_head and not cfgs["t5-v1.1"].tie_embeddings and cfgs["t5-v1.1"].gated_ff
    assert all(cfgs[f].norm == "rms" and cfgs[f].d_head == 6 and not cfgs[f].bias for f in ("t5", "t5-v1.1"))


def test_mbart_language_codes_forced_under_every_decoder(folders):
    """mBART-50's convention: the source language's code before the source, the target's after the
    start token; every decoder (batched ones included) honours them as transformers' greedy does."""
    large, small = folders("mbart")
    theirs = hf.hf_from_pretrained(large, torch.float64)
    model, tok, _ = hf.load_folder(large, dtype=torch.float64, src_lang="__en__", tgt_lang="__de__")
    drafter, _, _ = hf.load_folder(small, dtype=torch.float64, src_lang="__en__", tgt_lang="__de__")
    plain, _, _ = hf.load_folder(large, dtype=torch.float64)
    assert model.cfg.encoder_prefix == (tok._tok.token_to_id("__en__"),)
    srcs = sources(12, seed=4)
    wants = [hf.hf_generate(theirs, model.cfg, s, 20) for s in srcs]
    assert sum(not torch.equal(decode_greedy(plain, padded([s]), max_len=20).tokens[0], w) for s, w in zip(srcs, wants))
    for src, want in zip(srcs, wants):
        x = padded([src])
        assert torch.equal(decode_greedy(model, x, max_len=20).tokens[0], want)
        assert torch.equal(decode_beam(model, x, max_len=20, beam_size=1).tokens[0], want)
        assert torch.equal(decode_iad(model, x, max_len=20).tokens[0], want)
        assert torch.equal(decode_speculative(model, drafter, x, max_len=20, gamma=3).tokens[0], want)
    batch = padded(srcs)
    for out in (
        decode_greedy(model, batch, max_len=20),
        decode_iad(model, batch, max_len=20),
        decode_speculative(model, drafter, batch, max_len=20, gamma=3),
    ):
        assert all(torch.equal(o, w) for o, w in zip(out.tokens, wants))
    # BiLD is not lossless, but its batch computes what each row computes alone, forced tokens included
    alone = [decode_bild(model, drafter, padded([s]), max_len=20).tokens[0] for s in srcs]
    assert all(torch.equal(o, a) for o, a in zip(decode_bild(model, drafter, batch, max_len=20).tokens, alone))


@pytest.mark.parametrize("family", ["marian", "bart", "t5", "m2m100"])
def test_decode_cli_greedy_and_iad_write_transformers_greedy_text(family, folders, tmp_path):
    """The done-when: decode.py --model FOLDER --dtype float64, no --task, plain text in and out."""
    folder = m2m_folder(tmp_path / "m2m") if family == "m2m100" else folders(family)[0]
    theirs = hf.hf_from_pretrained(folder, torch.float64)
    model, tok, _ = hf.load_folder(folder, dtype=torch.float64)
    srcs = sources(6, seed=11)
    lines = [" ".join(WORDS[t - 4] for t in s) for s in srcs]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    want = [tok.decode(hf.hf_generate(theirs, model.cfg, s, 2 * len(s) + 10).tolist()) for s in srcs]
    r = run_py(
        "decode.py",
        "--algo",
        "greedy",
        "--compare",
        "iad",
        "--model",
        str(folder),
        "--input",
        str(tmp_path / "in.txt"),
        "--dtype",
        "float64",
        "--quiet",
        "--threads",
        "1",
        "--output",
        str(tmp_path / "out.txt"),
        "--report",
        str(tmp_path / "r.json"),
    )
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "out.txt").read_text().splitlines() == want
    runs = json.loads((tmp_path / "r.json").read_text())["runs"]
    assert [(x["algo"], x["identical"]) for x in runs[1:]] == [("iad", 1.0)] and "bleu" not in runs[0]


def test_decode_cli_speculative_with_a_small_folder_on_stdin(folders):
    large, small = folders("marian")
    r = run_py(
        "decode.py",
        "--algo",
        "speculative",
        "--compare",
        "greedy",
        "--model",
        str(large),
        "--small",
        str(small),
        "--input",
        "-",
        "--dtype",
        "float64",
        "--quiet",
        "--threads",
        "1",
        stdin=b"w1 w2 w3\nw4 w5\n",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "1.0000 identical" in r.stdout.decode() + r.stderr.decode()


def test_one_line_errors(folders, tmp_path):
    """An unsupported architecture, a missing weight file, a small model on another vocabulary, and
    no --task without a folder: one line each, no traceback."""
    large, _ = folders("bart")
    args = ["--algo", "greedy", "--input", "-", "--quiet", "--threads", "1"]
    bad = tmp_path / "pegasus-x"
    bad.mkdir()
    (bad / "config.json").write_text(
        json.dumps({"model_type": "pegasus_x", "architectures": ["PegasusXForConditionalGeneration"]})
    )
    assert "unsupported architecture PegasusXForConditionalGeneration" in one_line_error(
        run_py("decode.py", *args, "--model", str(bad), stdin=b"w1\n")
    )
    no_weights = tmp_path / "no-weights"
    shutil.copytree(large, no_weights)
    (no_weights / "model.safetensors").unlink()
    assert "has no weights" in one_line_error(run_py("decode.py", *args, "--model", str(no_weights), stdin=b"w1\n"))
    other = tmp_path / "other-vocab"
    shutil.copytree(folders("bart")[1], other)
    spec = json.loads((other / "tokenizer.json").read_text())
    spec["model"]["vocab"]["w0x"] = spec["model"]["vocab"].pop("w0")
    (other / "tokenizer.json").write_text(json.dumps(spec))
    err = one_line_error(
        run_py(
            "decode.py",
            "--algo",
            "speculative",
            "--input",
            "-",
            "--quiet",
            "--threads",
            "1",
            "--model",
            str(large),
            "--small",
            str(other),
            stdin=b"w1\n",
        )
    )
    assert "does not share the tokenizer" in err
    assert "--task is needed" in one_line_error(run_py("decode.py", *args, stdin=b"w1\n"))


@pytest.mark.parametrize("family", ["marian", "bart", "t5"])
def test_audit_on_a_family_pair(family, folders, tmp_path, capsys):
    """python -m refdec hf audit on a folder pair and a text file: refdec greedy, IAD and speculative,
    transformers' greedy, beam-free assisted generation and prompt lookup; refdec's lossless decoders
    and transformers' greedy identical to refdec greedy, differing lines reported with a margin."""
    from refdec.commands.hfcli import main as hf_main

    large, small = folders(family)
    (tmp_path / "in.txt").write_text("\n".join(" ".join(WORDS[t - 4] for t in s) for s in sources(4, seed=8)) + "\n")
    assert (
        hf_main(
            [
                "audit",
                "--model",
                str(large),
                "--small",
                str(small),
                "--input",
                str(tmp_path / "in.txt"),
                "--limit",
                "4",
                "--warmup",
                "0",
                "--threads",
                "1",
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    rows = {r["method"]: r for r in json.loads((tmp_path / "r.json").read_text())["methods"]}
    assert list(rows) == [
        "refdec-greedy",
        "refdec-iad",
        "refdec-speculative",
        "hf-greedy",
        "hf-assisted",
        "hf-prompt-lookup",
    ]
    assert all(rows[m]["identical"] == 1 for m in ("refdec-iad", "refdec-speculative", "hf-greedy"))
    for r in rows.values():
        assert len(r["differing"]) == round(4 * (1 - r["identical"])) and not r["errors"]
        assert all(d["margin_top1_top2"] >= 0 for d in r["differing"])
    assert "hf-assisted" in capsys.readouterr().out


def test_audit_records_a_method_that_fails_in_its_warm_up_and_goes_on(folders, tmp_path, capsys):
    """Case: `hf audit` on a random BART pair stopped with `Error: RuntimeError: IndexError: index out of
    range in self` (exit 1) when transformers' assisted generation failed inside the warm-up: its assistant
    (and prompt lookup) drafts past the end of the 64-row position table on lines whose budget nears it.
    Such a line now fails in the warm-up as in the timed loop: the audit goes on (exit 0), and every
    method and line that failed is in the table and the report."""
    import re

    from refdec.commands.hfcli import main as hf_main

    large, small = folders("bart")
    g = torch.Generator().manual_seed(3)
    lines = [
        " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=g).tolist())
        for n in (27, 28, 3, 27, 30, 26)
    ]  # budgets of 2 x 27 + 10 and over: near the table's end
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    assert (
        hf_main(
            [
                "audit",
                "--model",
                str(large),
                "--small",
                str(small),
                "--input",
                str(tmp_path / "in.txt"),
                "--limit",
                "6",
                "--warmup",
                "2",
                "--threads",
                "1",
                "--report",
                str(tmp_path / "r.json"),
            ]
        )
        == 0
    )
    out, err = capsys.readouterr()
    warm = re.findall(r"(hf-[a-z-]+) failed on input line\(s\) (\d+) in the warm-up", err)
    assert warm, err  # the case: a method failed inside the warm-up
    timed = {(m, int(n)) for m, n in re.findall(r"(hf-[a-z-]+) failed on input line\(s\) (\d+): ", err)}
    rows = {r["method"]: r for r in json.loads((tmp_path / "r.json").read_text())["methods"]}
    recorded = {(m, e["line"]) for m, r in rows.items() for e in r["errors"]}
    assert recorded == timed and recorded  # every failure recorded, per method and line
    assert all(f"{m}: line {n} failed: IndexError" in out for m, n in recorded)  # and in the table
    for m, r in rows.items():
        assert round(6 * r["identical"]) <= 6 - len(r["errors"])  # a failed line is not identical
        if m.startswith("refdec-"):
            assert r["identical"] == 1 and not r["errors"]


def test_banned_tokens_never_written(folders, tmp_path):
    """opus-mt's generation_config.json forbids the pad token (bad_words_ids): refdec's logits carry
    -inf there, so greedy, IAD and speculative decoding write what transformers' greedy writes."""
    large, small = folders("marian")
    model, _, _ = hf.load_folder(large, dtype=torch.float64)
    srcs = sources(8, seed=5)
    first = [decode_greedy(model, padded([s]), max_len=20).tokens[0] for s in srcs]
    banned = int(torch.cat(first).mode().values)  # the token greedy writes most: banning it changes outputs
    for folder in (large, small):
        shutil.copytree(folder, tmp_path / folder.name)
        gen = json.loads((tmp_path / folder.name / "generation_config.json").read_text())
        (tmp_path / folder.name / "generation_config.json").write_text(json.dumps({**gen, "bad_words_ids": [[banned]]}))
    theirs = hf.hf_from_pretrained(tmp_path / "large", torch.float64)
    model, _, _ = hf.load_folder(tmp_path / "large", dtype=torch.float64)
    drafter, _, _ = hf.load_folder(tmp_path / "small", dtype=torch.float64)
    assert model.logits_bias[banned] == float("-inf")
    for src in srcs:
        want = hf.hf_generate(theirs, model.cfg, src, 20)
        assert banned not in want.tolist()
        for out in (
            decode_greedy(model, padded([src]), max_len=20),
            decode_iad(model, padded([src]), max_len=20),
            decode_speculative(model, drafter, padded([src]), max_len=20),
        ):
            assert torch.equal(out.tokens[0], want)


def opus_mt_folder(path: Path) -> Path:
    """An opus-mt-like folder with no tokenizer.json: a sentencepiece model trained here (source.spm =
    target.spm) and a vocab.json numbering <pad>, </s>, <unk> and its pieces, beside a random Marian model."""
    spm = pytest.importorskip("sentencepiece")
    path.mkdir(parents=True)
    text = ["the cat sat on the mat", "a dog ran in the park", "the house is small", "we see a red car"] * 20
    (path / "train.txt").write_text("\n".join(text))
    spm.SentencePieceTrainer.train(
        input=str(path / "train.txt"), model_prefix=str(path / "m"), vocab_size=30, model_type="unigram", minloglevel=2
    )
    sp = spm.SentencePieceProcessor(model_file=str(path / "m.model"))
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size()) if not sp.is_control(i) and not sp.is_unknown(i)]
    vocab = {t: i for i, t in enumerate(["</s>", "<unk>", ">>de<<"] + pieces + ["<pad>"])}
    for name in ("source.spm", "target.spm"):
        shutil.copy(path / "m.model", path / name)
    (path / "vocab.json").write_text(json.dumps(vocab))
    for name in ("m.model", "m.vocab", "train.txt"):
        (path / name).unlink()
    torch.manual_seed(0)
    model = transformers.MarianMTModel(
        transformers.MarianConfig(
            vocab_size=len(vocab),
            d_model=16,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
            pad_token_id=vocab["<pad>"],
            eos_token_id=0,
            decoder_start_token_id=vocab["<pad>"],
            scale_embedding=True,
            activation_function="swish",
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.05))
    model.save_pretrained(path)
    return path


@pytest.mark.filterwarnings("ignore:Recommended")  # MarianTokenizer asks for sacremoses, which it does not call
def test_opus_mt_folder_with_sentencepiece_files_only(tmp_path):
    """Its tokenizer is read from source.spm and vocab.json as transformers' MarianTokenizer reads
    them (the same ids, the same text back), and decode.py writes transformers' greedy text."""
    folder = opus_mt_folder(tmp_path / "opus")
    theirs_tok = transformers.MarianTokenizer.from_pretrained(str(folder))
    model, tok, _ = hf.load_folder(folder, dtype=torch.float64)
    lines = ["the cat sat", ">>de<< a dog ran in the park", "we see the small house", "zebra"]
    for line in lines:
        assert tok.encode(line) + [model.cfg.eos_id] == theirs_tok(line).input_ids
    theirs = hf.hf_from_pretrained(folder, torch.float64)
    want = [
        theirs_tok.decode(
            hf.hf_generate(theirs, model.cfg, tok.encode(x), 2 * len(tok.encode(x)) + 10).tolist(),
            skip_special_tokens=True,
        )
        for x in lines
    ]
    assert all(
        tok.decode(theirs_tok(x).input_ids) == theirs_tok.decode(theirs_tok(x).input_ids, skip_special_tokens=True)
        for x in lines
    )
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    r = run_py(
        "decode.py",
        "--algo",
        "greedy",
        "--compare",
        "iad",
        "--model",
        str(folder),
        "--input",
        str(tmp_path / "in.txt"),
        "--dtype",
        "float64",
        "--quiet",
        "--threads",
        "1",
        "--output",
        str(tmp_path / "out.txt"),
    )
    assert r.returncode == 0, r.stderr.decode()
    assert (tmp_path / "out.txt").read_text().splitlines() == want


def test_bart_folder_with_vocab_and_merges_only(tmp_path):
    """A BART folder from before tokenizer.json: vocab.json and merges.txt read as transformers 5's
    BartTokenizer reads them (the same ids), and decode.py writes transformers' greedy text."""
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path / "bart"
    folder.mkdir()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        ["the cat sat on the mat", "a dog ran in the park", "we see the small house"] * 10,
        vocab_size=300,
        min_frequency=1,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
    )
    bpe.save_model(str(folder))
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(
        transformers.BartConfig(
            vocab_size=bpe.get_vocab_size(),
            d_model=16,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=32,
            decoder_ffn_dim=32,
            max_position_embeddings=64,
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.05))
    model.save_pretrained(folder)
    theirs_tok = transformers.BartTokenizer.from_pretrained(str(folder))
    ours, tok, _ = hf.load_folder(folder, dtype=torch.float64)
    lines = ["the cat sat", "a dog ran in the park", "we see <mask> house!", "Zebras, 42 of them"]
    for line in lines:
        assert list(ours.cfg.encoder_prefix) + tok.encode(line) + [ours.cfg.eos_id] == theirs_tok(line).input_ids
    theirs = hf.hf_from_pretrained(folder, torch.float64)
    want = [
        theirs_tok.decode(
            hf.hf_generate(theirs, ours.cfg, tok.encode(x), 2 * len(tok.encode(x)) + 10).tolist(),
            skip_special_tokens=True,
        )
        for x in lines
    ]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    r = run_py(
        "decode.py",
        "--algo",
        "iad",
        "--model",
        str(folder),
        "--input",
        str(tmp_path / "in.txt"),
        "--dtype",
        "float64",
        "--quiet",
        "--threads",
        "1",
        "--output",
        str(tmp_path / "out.txt"),
    )
    assert r.returncode == 0, r.stderr.decode()
    # a random model writes any bytes, form feeds included: one line per input, newlines written as spaces
    with open(tmp_path / "out.txt", encoding="utf-8", newline="") as f:
        written = f.read().split("\n")[:-1]
    assert written == [w.replace("\r", " ").replace("\n", " ") for w in want]


@pytest.mark.parametrize("family", FAMILIES)
def test_import_writes_a_checkpoint_that_decodes_as_the_folder(family, folders, tmp_path, capsys, monkeypatch):
    """Case: no command turned a transformers folder into a refdec checkpoint, so the commands that take a
    model.pt could not start from one. `refdec hf import FOLDER --out DIR` writes model.pt and the folder's
    tokenizer.json, checked against transformers; greedy and IAD on the model.pt, and decode.py given it,
    write transformers' greedy output (mBART with its language codes, forced as the import was told)."""
    from refdec.checkpoint import load_model
    from refdec.commands.decode import main as decode_main
    from refdec.commands.hfcli import main as hf_main

    large, _ = folders(family)
    langs = ["--src-lang", "__en__", "--tgt-lang", "__de__"] if family == "mbart" else []
    assert hf_main(["import", str(large), "--out", str(tmp_path / "ckpt"), *langs]) == 0
    out = capsys.readouterr().out
    assert "wrote" in out and "the same greedy output" in out, out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["model.pt", "tokenizer.json"]
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == (large / "tokenizer.json").read_text()
    model, tok, stored = load_model(tmp_path / "ckpt" / "model.pt", dtype=torch.float64)
    folder, _, _ = hf.load_folder(
        large, dtype=torch.float64, **({"src_lang": "__en__", "tgt_lang": "__de__"} if langs else {})
    )
    assert (
        model.cfg == folder.cfg
        and stored["imported"]["architecture"] == hf.hf_from_pretrained(large).config.architectures[0]
    )
    assert all(torch.equal(model.state_dict()[k], v) for k, v in folder.state_dict().items())
    theirs = hf.hf_from_pretrained(large, torch.float64)
    srcs = sources(8, seed=13)
    wants = [hf.hf_generate(theirs, model.cfg, s, 2 * len(s) + 10) for s in srcs]
    for src, want in zip(srcs, wants):
        x = padded([src], model.cfg.eos_id, model.cfg.pad_id)
        assert torch.equal(decode_greedy(model, x, max_len=2 * len(src) + 10).tokens[0], want)
        assert torch.equal(decode_iad(model, x, max_len=2 * len(src) + 10).tokens[0], want)
    (tmp_path / "in.txt").write_text("\n".join(" ".join(WORDS[t - 4] for t in s) for s in srcs) + "\n")
    monkeypatch.chdir(tmp_path)
    assert (
        decode_main(
            [
                "--algo",
                "greedy",
                "--compare",
                "iad",
                "--model",
                "ckpt/model.pt",
                "--input",
                "in.txt",
                "--dtype",
                "float64",
                "--quiet",
                "--threads",
                "1",
                "--output",
                "out.txt",
            ]
        )
        == 0
    )
    assert (tmp_path / "out.txt").read_text().splitlines() == [tok.decode(w.tolist()) for w in wants]


def test_import_of_a_float64_folder_is_checked_as_the_float32_it_writes(folders, tmp_path, capsys):
    """Case: `hf import` of a folder saved in float64 failed its own check and wrote nothing: the
    checkpoint holds float32 weights, whose logits were held to float64's tolerance against the float64
    folder. Such a folder is now held to what rounding its weights to float32 moves: imported, its
    weights the folder's rounded to float32, its greedy output the folder's; a float32 folder is still
    held to float64's tolerance."""
    from refdec.checkpoint import load_model
    from refdec.commands.hfcli import main as hf_main
    from refdec.hf import convert

    large, _ = folders("bart")
    wide = tmp_path / "bart64"
    shutil.copytree(large, wide)
    m = transformers.AutoModelForSeq2SeqLM.from_pretrained(large, dtype=torch.float64)
    with torch.no_grad():  # weights float32 does not hold
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()), dtype=p.dtype) * 1e-4)
    m.save_pretrained(wide)
    assert not convert.held_exactly(wide) and convert.held_exactly(large)
    assert hf_main(["import", str(wide), "--out", str(tmp_path / "ckpt")]) == 0
    assert "the same greedy output" in capsys.readouterr().out
    model, _, _ = load_model(tmp_path / "ckpt" / "model.pt", dtype=torch.float64)
    folder, _, _ = hf.load_folder(wide, dtype=torch.float64)
    assert all(torch.equal(model.state_dict()[k], v.float().double()) for k, v in folder.state_dict().items())
    theirs = hf.hf_from_pretrained(wide, torch.float64)
    for src in sources(6, seed=21):
        x = padded([src], model.cfg.eos_id, model.cfg.pad_id)
        want = hf.hf_generate(theirs, model.cfg, src, 2 * len(src) + 10)
        assert torch.equal(decode_greedy(model, x, max_len=2 * len(src) + 10).tokens[0], want)


def test_import_of_a_model_with_more_embeddings_than_tokens_and_its_refusals(folders, tmp_path, capsys, monkeypatch):
    """A T5 folder may have more embeddings than its tokenizer has tokens (t5-small: 32,128 for 32,100): its
    model.pt loads all the same. Refused in one line each: an opus-mt folder with no tokenizer.json (refdec
    reads its sentencepiece model but cannot write it as one), a folder that is not one, an --out that is
    not empty or lies in the shipped checkpoints/."""
    from conftest import error_of

    from refdec.checkpoint import load_model
    from refdec.commands.hfcli import main as hf_main

    torch.manual_seed(0)
    t5 = transformers.T5ForConditionalGeneration(
        transformers.T5Config(
            vocab_size=V + 6,
            d_model=16,
            d_kv=6,
            num_heads=3,
            d_ff=32,
            num_layers=1,
            relative_attention_num_buckets=8,
            pad_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    )
    with torch.no_grad():
        for p in t5.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    t5.save_pretrained(tmp_path / "t5")
    (tmp_path / "t5" / "tokenizer.json").write_text(word_tokenizer_json(), encoding="utf-8")
    assert hf_main(["import", str(tmp_path / "t5"), "--out", str(tmp_path / "t5-ckpt"), "--task", "gec-en"]) == 0
    model, tok, stored = load_model(tmp_path / "t5-ckpt" / "model.pt", task="gec-en")
    assert (model.cfg.vocab_size, tok.vocab_size, stored["task"]) == (V + 6, V, "gec-en")
    opus = opus_mt_folder(tmp_path / "opus")
    capsys.readouterr()
    err = error_of(hf_main, ["import", str(opus), "--out", str(tmp_path / "o")], capsys, monkeypatch)
    assert "has no tokenizer.json" in err and "decode.py --model" in err, err
    assert "not a transformers model folder" in error_of(
        hf_main, ["import", str(tmp_path / "t5-ckpt"), "--out", str(tmp_path / "o")], capsys, monkeypatch
    )
    assert "--out" in error_of(
        hf_main, ["import", str(tmp_path / "t5"), "--out", str(tmp_path / "t5-ckpt")], capsys, monkeypatch
    )
    err = error_of(hf_main, ["import", str(tmp_path / "t5"), "--out", "checkpoints/t5"], capsys, monkeypatch)
    assert "is inside checkpoints/" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "change,needle",
    [
        (
            {"config.json": {"eos_token_id": 3}},
            "config.json's eos_token_id is 3 but the tokenizer has its end token '</s>' at 2",
        ),
        (
            {"config.json": {"pad_token_id": 0}},
            "config.json's pad_token_id is 0 but the tokenizer has its padding token '<pad>' at 1",
        ),
        ({"tokenizer_config.json": {"eos_token": "<eos>"}}, "its eos_token '<eos>' is not a token of its tokenizer"),
        (
            {"tokenizer_config.json": {"pad_token": {"content": "<unk>", "special": True}}},
            "config.json's pad_token_id is 1 but the tokenizer has its padding token '<unk>' at 3",
        ),
        (
            {"config.json": {"decoder_start_token_id": 60, "vocab_size": 64}},
            "config.json's decoder_start_token_id 60 is not a token of its tokenizer (46 tokens)",
        ),
    ],
)
def test_a_folder_that_breaks_the_tokenizer_contract_is_refused_in_one_line(
    change, needle, folders, tmp_path, capsys, monkeypatch
):
    """Case: docs/hf.md did not say what a folder's tokenizer.json must hold. It says now (section The
    tokenizer of a folder), and a folder that breaks it is refused in one line by every command that reads
    it (decode.py, hf import): an end or padding token the tokenizer names at another id than config.json's,
    a named token the tokenizer lacks, a start token that is no token of it."""
    from conftest import error_of

    from refdec.commands.decode import main as decode_main
    from refdec.commands.hfcli import main as hf_main

    large, _ = folders("bart")
    bad = tmp_path / "bad"
    shutil.copytree(large, bad)
    for name, fields in change.items():
        old = json.loads((bad / name).read_text()) if (bad / name).is_file() else {}
        (bad / name).write_text(json.dumps({**old, **fields}))
    if "vocab_size" in change.get("config.json", {}):  # weights of that many embeddings
        from safetensors.torch import load_file, save_file

        state = load_file(str(bad / "model.safetensors"))
        grown = {
            k: torch.cat([v, torch.zeros(64 - V, *v.shape[1:])]) if v.shape[:1] == (V,) else v for k, v in state.items()
        }
        grown["final_logits_bias"] = torch.zeros(1, 64)
        save_file(grown, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "in.txt").write_text("w1 w2\n")
    capsys.readouterr()  # transformers' progress bars while the folders were made
    err = error_of(
        decode_main, ["--model", str(bad), "--input", str(tmp_path / "in.txt"), "--threads", "1"], capsys, monkeypatch
    )
    assert needle in err and "(docs/hf.md, section The tokenizer of a folder)" in err, err
    assert needle in error_of(hf_main, ["import", str(bad), "--out", str(tmp_path / "out")], capsys, monkeypatch)
    assert not (tmp_path / "out").exists()


def test_import_checks_what_it_wrote_and_leaves_nothing_that_fails(folders, tmp_path, capsys, monkeypatch):
    """The import's check compares the model.pt it wrote with transformers' model of the folder: a
    Marian folder whose generation_config.json bans a token greedy writes passes (refdec holds it at -inf,
    transformers bans it in generate), and a check that fails is one line, with nothing left in --out."""
    from refdec.commands.hfcli import main as hf_main
    from refdec.hf import convert

    large, _ = folders("marian")
    banned = tmp_path / "banned"
    shutil.copytree(large, banned)
    model, _, _ = hf.load_folder(large)
    first = decode_greedy(model, padded([convert.probes(hf.load_tokenizer(large, model.cfg))[1]]), max_len=20).tokens[0]
    gen = json.loads((banned / "generation_config.json").read_text())
    (banned / "generation_config.json").write_text(json.dumps({**gen, "bad_words_ids": [[int(first[0])]]}))
    assert hf_main(["import", str(banned), "--out", str(tmp_path / "ok")]) == 0
    assert torch.isneginf(hf.load_folder(banned)[0].logits_bias[int(first[0])])  # the token greedy wrote first
    real = convert.compare_with_folder
    monkeypatch.setattr(
        convert,
        "compare_with_folder",
        lambda *a: {**real(*a), "max_logit_difference": 1e-3, "said": "logits differ by 0.001"},
    )
    capsys.readouterr()
    assert hf_main(["import", str(large), "--out", str(tmp_path / "bad")]) == 2
    said, err = capsys.readouterr().err.strip().splitlines()  # what it is doing, then the one line
    assert said.startswith("importing ") and err.startswith("error: ") and "does not reproduce" in err, err
    assert "logits differ by 0.001; nothing is left in" in err, err
    assert not (tmp_path / "bad").exists()
