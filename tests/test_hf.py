"""refdec.hf: transformers folders in (M2M100, NLLB), refdec checkpoints out (Pegasus layout), round trips.

Tiny random models built by transformers from a config (nothing downloaded), in float64: imported
logits equal transformers' to 1e-12 and the greedy outputs are the same; an exported folder loads
in stock transformers and decodes as refdec does; refdec -> transformers -> refdec is bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # transformers, subprocess runs

from conftest import error_of, one_line_error, run_py  # noqa: E402
from hf_helpers import LANGS, WORDS, m2m_folder, sources  # noqa: E402

from refdec import hf  # noqa: E402
from refdec.checkpoint import make_checkpoint, save_atomic  # noqa: E402
from refdec.commands.decode import main as decode_command  # noqa: E402
from refdec.commands.hfcli import main as hf_main  # noqa: E402
from refdec.config import ModelConfig  # noqa: E402
from refdec.decoding import decode_beam, decode_greedy, decode_iad, decode_speculative  # noqa: E402
from refdec.model import Transformer  # noqa: E402
from refdec.tokenizer import Tokenizer  # noqa: E402

pytestmark = pytest.mark.slow  # transformers models and commands

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return m2m_folder(tmp_path_factory.mktemp("m2m"))


@pytest.fixture(scope="module")
def theirs(folder):
    return hf.hf_from_pretrained(folder, torch.float64)


def test_import_logits_and_greedy_equal_transformers(folder, theirs):
    model, tok, _ = hf.load_folder(folder, dtype=torch.float64)
    assert model.cfg.positions == "m2m100" and (model.cfg.pad_id, model.cfg.bos_id, model.cfg.eos_id) == (1, 2, 2)
    assert (tok.pad_id, tok.unk_id) == (1, 3) and tok.decode([2, 4, 5, 44, 1]) == "w0 w1"  # 44: a language code
    for src in sources(6):
        tgt = sources(1, seed=len(src))[0]
        diff = (hf.refdec_logits(model, src, tgt) - hf.hf_logits(theirs, model.cfg, src, tgt)).abs().max()
        assert diff <= hf.LOGIT_TOLERANCE
        ours = decode_greedy(model, torch.tensor([src + [2]]), max_len=20).tokens[0]
        assert torch.equal(ours, hf.hf_generate(theirs, model.cfg, src, 20))


def test_forced_language_tokens_honoured_by_greedy_beam_iad_and_speculative(folder, theirs, tmp_path):
    model, tok, _ = hf.load_folder(folder, dtype=torch.float64, src_lang="__en__", tgt_lang="__de__")
    # another random model as the drafter: its drafts are often rejected, so its cache is cut back
    small, _, _ = hf.load_folder(
        m2m_folder(tmp_path / "small", seed=1, encoder_layers=1, decoder_layers=1),
        dtype=torch.float64,
        src_lang="__en__",
        tgt_lang="__de__",
    )
    en, de = (tok._tok.token_to_id(t) for t in LANGS)
    assert model.cfg.encoder_prefix == (en,) and model.cfg.decoder_prefix == (de,)
    srcs = sources(5, seed=3)
    plain, _, _ = hf.load_folder(folder, dtype=torch.float64)
    changed = 0
    for src in srcs:
        tgt = sources(1, seed=len(src) + 7)[0]
        cached = hf.refdec_logits(model, src, tgt)
        assert (cached - hf.hf_logits(theirs, model.cfg, src, tgt)).abs().max() <= hf.LOGIT_TOLERANCE
        forced = model(torch.tensor([src + [2]]), torch.tensor([[2] + tgt]))[0]  # teacher forcing, no cache
        assert (forced - cached).abs().max() <= hf.LOGIT_TOLERANCE
        want = hf.hf_generate(theirs, model.cfg, src, 20)  # transformers with [en] + src and [start, de]
        x = torch.tensor([src + [2]])
        assert torch.equal(decode_greedy(model, x, max_len=20).tokens[0], want)
        assert torch.equal(decode_beam(model, x, max_len=20, beam_size=1).tokens[0], want)
        assert torch.equal(decode_iad(model, x, max_len=20).tokens[0], want)
        assert torch.equal(decode_speculative(model, small, x, max_len=20, gamma=3).tokens[0], want)
        changed += not torch.equal(decode_greedy(plain, x, max_len=20).tokens[0], want)
    assert changed  # the forced tokens change what the model writes
    batch = torch.full((len(srcs), 9), 1)  # a padded batch: the prefix goes before each row's source
    for i, s in enumerate(srcs):
        batch[i, : len(s) + 1] = torch.tensor(s + [2])
    outs = decode_iad(model, batch, max_len=20).tokens
    assert all(torch.equal(o, hf.hf_generate(theirs, model.cfg, s, 20)) for o, s in zip(outs, srcs))


def refdec_checkpoint(path: Path, seed: int = 0, max_positions: int = 64) -> Path:
    """A random refdec model (tied, pre-norm, every weight perturbed) with a trained byte-level tokenizer."""
    tok = Tokenizer.train(
        ["the cat sat on the mat", "a dog ran in the park", "der Hund lief im Park"] * 5,
        vocab_size=300,
        min_frequency=1,
    )
    torch.manual_seed(seed)
    model = Transformer(
        ModelConfig(
            vocab_size=tok.vocab_size,
            d_model=16,
            n_heads=2,
            d_ff=32,
            enc_layers=2,
            dec_layers=2,
            max_positions=max_positions,
        )
    )
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    path.mkdir(parents=True, exist_ok=True)
    save_atomic(make_checkpoint(model, "mt-en-de", tok, step=1), path / "model.pt")
    tok.save(path / "tokenizer.json")
    return path / "model.pt"


def test_export_of_a_checkpoint_with_proposal_heads_refuses_or_leaves_them_out_when_told(tmp_path):
    """Case: `python -m refdec hf export` of a blockwise checkpoint (the model and its proposal heads)
    wrote the model alone and said nothing of the heads. transformers has no place for them: it is
    refused in one line (exit 2, no folder written) naming the fix; --without-heads exports the model
    and says the heads are not in it."""
    from refdec.checkpoint import load_checkpoint
    from refdec.proposal import ProposalHeads, proposal_state

    ckpt = refdec_checkpoint(tmp_path / "ckpt")
    stored = load_checkpoint(ckpt)
    save_atomic({**stored, "proposal": proposal_state(ProposalHeads(16, 8, k=3))}, ckpt)
    r = run_py("-m", "refdec", "hf", "export", str(ckpt), str(tmp_path / "out"))
    err = r.stderr.decode().strip()
    assert r.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "2 blockwise proposal heads" in err and "--without-heads" in err
    assert not (tmp_path / "out").exists()
    r = run_py("-m", "refdec", "hf", "export", str(ckpt), str(tmp_path / "out"), "--without-heads")
    assert r.returncode == 0, r.stderr.decode()
    assert "the proposal heads are not in it" in r.stdout.decode()
    assert "loading it back with transformers to check it" in r.stderr.decode()  # said before its silent seconds
    back, _, _ = hf.load_folder(tmp_path / "out")
    assert all(
        torch.equal(back.state_dict()[k], v.float()) for k, v in stored["model"].items() if k in back.state_dict()
    )
    # a plain checkpoint exports as before, with nothing left out
    assert hf.export(refdec_checkpoint(tmp_path / "plain"), tmp_path / "plain-out")["heads_left_out"] is False


def test_export_loads_in_transformers_and_round_trips_bitwise(tmp_path):
    from refdec.checkpoint import load_model

    ckpt = refdec_checkpoint(tmp_path / "ckpt")
    result = hf.export(ckpt, tmp_path / "out")
    assert result["architecture"] == hf.PEGASUS and result["max_logit_difference"] <= hf.LOGIT_TOLERANCE
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "out").iterdir()}
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    ours, tok, _ = load_model(ckpt, dtype=torch.float64)
    back, back_tok, _ = hf.load_folder(tmp_path / "out", dtype=torch.float64)
    assert back_tok.sha256 == tok.sha256 and back.cfg == ours.cfg
    for k, v in ours.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    for text in ("the cat sat", "a dog ran in the park on the mat", "der Hund"):
        src = tok.encode(text)
        want = decode_greedy(ours, torch.tensor([src + [2]]), max_len=30).tokens[0]
        assert torch.equal(hf.hf_generate(theirs, ours.cfg, src, 30), want)
        diff = (
            (hf.refdec_logits(ours, src, want.tolist()) - hf.hf_logits(theirs, ours.cfg, src, want.tolist()))
            .abs()
            .max()
        )
        assert diff <= hf.LOGIT_TOLERANCE
        assert torch.equal(hf.refdec_logits(back, src, want.tolist()), hf.refdec_logits(ours, src, want.tolist()))
    back32, _, _ = hf.load_folder(tmp_path / "out")
    ours32, _, _ = load_model(ckpt)
    src = tok.encode("the cat sat on the mat")
    assert torch.equal(hf.refdec_logits(back32, src, [5, 6, 7]), hf.refdec_logits(ours32, src, [5, 6, 7]))


def test_imported_m2m100_exports_as_m2m100_and_round_trips_bitwise(folder, tmp_path):
    """An imported model keeps transformers' M2M100 table, so it goes back out as M2M100 (checked by
    `check_export` against transformers in float64) and in again to the same weights."""
    model, tok, _ = hf.load_folder(folder)
    hf.write_folder(model, tok, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == [hf.M2M100]
    assert hf.check_export(model, tmp_path / "out", sources(1, seed=5)[0])["max_logit_difference"] <= hf.LOGIT_TOLERANCE
    back, _, _ = hf.load_folder(tmp_path / "out")
    assert back.cfg == model.cfg
    src, tgt = sources(1, seed=6)[0], sources(1, seed=7)[0]
    assert torch.equal(hf.refdec_logits(back, src, tgt), hf.refdec_logits(model, src, tgt))


def test_pytorch_model_bin_imports_as_safetensors_does(folder, tmp_path):
    import shutil

    from safetensors.torch import load_file

    shutil.copytree(folder, tmp_path / "bin")
    torch.save(load_file(str(folder / "model.safetensors")), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "model.safetensors").unlink()
    a, b = hf.load_folder(folder)[0].state_dict(), hf.load_folder(tmp_path / "bin")[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_core_library_imports_without_transformers():
    r = run_py(
        "-c",
        "import sys; sys.modules['transformers'] = sys.modules['safetensors'] = None\n"
        "import refdec.model, refdec.app.loading, refdec.decoding, refdec.app.runner, refdec.hf\n"
        "try:\n    refdec.hf.hf_from_pretrained('x')\nexcept refdec.hf.HFError as e:\n    print(e)",
    )
    assert r.returncode == 0 and "needs the transformers package" in r.stdout.decode(), r.stderr.decode()


def test_unsupported_architecture_and_missing_files(tmp_path, folder):
    bad = tmp_path / "bart"
    bad.mkdir()
    config = json.loads((folder / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "model_type": "bart", "architectures": ["BartModel"]}))
    with pytest.raises(hf.HFError, match="unsupported architecture BartModel"):
        hf.load_folder(bad)
    gelu = tmp_path / "gelu"
    gelu.mkdir()
    (gelu / "config.json").write_text(json.dumps({**config, "activation_function": "gelu_10"}))
    with pytest.raises(hf.HFError, match="activation 'gelu_10'"):
        hf.load_folder(gelu)
    no_tok = tmp_path / "no-tok"
    no_tok.mkdir()
    (no_tok / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(hf.HFError, match="has no tokenizer.json"):
        hf.load_folder(no_tok)
    (no_tok / "tokenizer.json").write_text((folder / "tokenizer.json").read_text())
    with pytest.raises(hf.HFError, match="has no weights"):
        hf.load_folder(no_tok)
    args = ["--task", "mt-en-de", "--algo", "greedy", "--input", "-", "--quiet", "--threads", "1"]
    assert "unsupported architecture BartModel" in one_line_error(
        run_py("decode.py", *args, "--model", str(bad), stdin=b"w1\n")
    )
    assert "has no weights" in one_line_error(run_py("decode.py", *args, "--model", str(no_tok), stdin=b"w1\n"))
    assert "not found" in one_line_error(
        run_py("-m", "refdec", "hf", "export", str(tmp_path / "none.pt"), str(tmp_path / "o"))
    )


def test_decode_cli_on_a_transformers_folder(folder, theirs, tmp_path):
    """decode.py --model FOLDER with greedy, beam and iad writes what transformers' greedy writes
    (beam size 1 is greedy), the language tokens forced."""
    model, tok, _ = hf.load_folder(folder, dtype=torch.float64, src_lang="__en__", tgt_lang="__de__")
    srcs = sources(4, seed=11)
    lines = [" ".join(WORDS[t - 4] for t in s) for s in srcs]
    want = [tok.decode(hf.hf_generate(theirs, model.cfg, s, 2 * len(s) + 10).tolist()) for s in srcs]
    (tmp_path / "in.txt").write_text("\n".join(lines) + "\n")
    r = run_py(
        "decode.py",
        "--task",
        "mt-en-de",
        "--algo",
        "greedy",
        "--compare",
        "beam:beam-size=1,iad",
        "--model",
        str(folder),
        "--input",
        str(tmp_path / "in.txt"),
        "--src-lang",
        "__en__",
        "--tgt-lang",
        "__de__",
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
    assert [(x["algo"], x["identical"]) for x in runs[1:]] == [("beam:beam-size=1", 1.0), ("iad", 1.0)]


def test_audit_reports_every_method(tmp_path, capsys):
    """The audit on a tiny exported pair: every method's row, refdec's lossless decoders identical to
    refdec greedy, each differing line with its first divergent position and margin, JSON written."""
    # 256 positions: transformers' assisted generation lets its assistant run past max_length, and near
    # the end of the position table that fails (the audit records such a line as an error)
    large = refdec_checkpoint(tmp_path / "large", seed=2, max_positions=256)
    small = refdec_checkpoint(tmp_path / "small", seed=3, max_positions=256)
    assert (
        hf_main(
            [
                "audit",
                "--task",
                "mt-en-de",
                "--model",
                str(large),
                "--small",
                str(small),
                "--limit",
                "2",
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
    report = json.loads((tmp_path / "r.json").read_text())
    rows = {r["method"]: r for r in report["methods"]}
    assert list(rows) == ["refdec-greedy", "refdec-speculative", "hf-greedy", "hf-assisted", "hf-prompt-lookup"]
    assert report["lines"] == 2 and rows["refdec-greedy"]["identical"] == rows["refdec-speculative"]["identical"] == 1
    assert report["environment"]["threads"] == 1 and report["environment"]["cpu_capability"]  # the machine timed
    for r in rows.values():
        assert r["seconds"] > 0 and r["tokens"] >= 2 and not r["errors"]
        assert len(r["differing"]) == round(2 * (1 - r["identical"]))
        assert all(d["margin_top1_top2"] >= 0 and d["position"] >= 0 for d in r["differing"])
    assert "hf-prompt-lookup" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--algo", "gad"], "--algo gad needs a block drafter"),
        (["--algo", "bild"], "--algo bild needs a small model"),
        (["--algo", "speculative"], "--algo speculative needs a small model"),
        (["--algo", "greedy", "--compare", "gad"], "--compare gad needs a block drafter"),
    ],
)
def test_a_companion_model_a_folder_does_not_bring_is_asked_for(folder, tmp_path, capsys, monkeypatch, argv, needle):
    """Case: `decode.py --model FOLDER --input s.txt --algo gad` (bild, speculative, --compare gad) exited 1
    with `TypeError: replace() argument 1 must be str, not None`: without --task there is no shipped
    companion model (drafter, small model) to default to. One line now names the model the algorithm
    needs and its flag."""
    (tmp_path / "s.txt").write_text("w1 w2 w3\n", encoding="utf-8")
    err = error_of(
        decode_command, ["--model", str(folder), "--input", str(tmp_path / "s.txt"), *argv], capsys, monkeypatch
    )
    role = "drafter" if "gad" in argv else "small"
    assert needle in err and f"pass --{role} PATH" in err, err
