"""Training loop pieces, checkpoints (atomic, safe, averaged, resumable) and the torchrun path."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import REPO, run_py, tiny_model

from refdec.adapters import early_exit_hidden
from refdec.checkpoint import CheckpointError, average_states, load_checkpoint, load_model, save_atomic
from refdec.training import cpp_compiler, inverse_sqrt

TINY = ["train.py", "--preset", "tiny", "--train-limit", "800", "--threads", "1"]


def test_inverse_sqrt_schedule():
    """Guards against a schedule that never warms up or never decays."""
    assert inverse_sqrt(50, 100) == pytest.approx(0.5)
    assert inverse_sqrt(100, 100) == pytest.approx(1.0)
    assert inverse_sqrt(400, 100) == pytest.approx(0.5)


def test_save_atomic_keeps_old_file_when_interrupted(tmp_path, monkeypatch):
    """Guards against a kill during saving leaving a truncated checkpoint behind."""
    path = tmp_path / "last.pt"
    save_atomic({"format": "refdec-checkpoint-1", "x": torch.ones(2)}, path)

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(KeyboardInterrupt):
        save_atomic({"format": "refdec-checkpoint-1", "x": torch.zeros(2)}, path)
    assert torch.equal(load_checkpoint(path)["x"], torch.ones(2))
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/refdec_pwned",))


def test_untrusted_pickle_is_refused_not_run(tmp_path):
    """Guards against torch.load running code from a malicious checkpoint (weights_only=True)."""
    path = tmp_path / "evil.pt"
    Path("/tmp/refdec_pwned").unlink(missing_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"format": "refdec-checkpoint-1", "model": Evil()}, f)
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    assert not Path("/tmp/refdec_pwned").exists()


def test_corrupt_and_missing_checkpoints(tmp_path):
    """Guards against tracebacks on truncated or absent files."""
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match=r"is truncated or not a checkpoint \(21 bytes"):
        load_checkpoint(bad)
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "nothing.pt")


def test_average_states():
    """Guards against averaging that weights snapshots unequally or changes integer buffers."""
    a, b = tiny_model(0).state_dict(), tiny_model(1).state_dict()
    avg = average_states([a, b])
    k = "tgt_embed.weight"
    assert torch.allclose(avg[k], (a[k] + b[k]) / 2)


def _weights(path: Path) -> dict:
    return load_checkpoint(path)["model"]


@pytest.mark.slow
def test_resume_continues_exactly(tmp_path):
    """Guards against resume losing optimizer state, data position or RNG state: 8 steps straight
    equal 4 steps, an interruption, and 4 more after --resume."""
    straight, split = tmp_path / "a", tmp_path / "b"
    r = run_py(*TINY, "--out-dir", str(straight), "--max-steps", "8", "--eval-every", "4")
    assert r.returncode == 0, r.stderr.decode()
    r = run_py(*TINY, "--out-dir", str(split), "--max-steps", "4", "--eval-every", "4")
    assert r.returncode == 0, r.stderr.decode()
    r = run_py(*TINY, "--out-dir", str(split), "--max-steps", "8", "--eval-every", "4", "--resume")
    assert r.returncode == 0, r.stderr.decode()
    assert b"resumed from" in r.stderr
    wa, wb = _weights(straight / "last.pt"), _weights(split / "last.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    # the run also wrote what decode.py needs, and the averaged snapshot
    for name in ("model.pt", "best.pt", "average.pt", "tokenizer.json", "log.jsonl"):
        assert (split / name).exists(), name
    model, tok, checkpoint = load_model(split / "model.pt", task="mt-en-de")
    assert not model.training and checkpoint["step"] == 8
    records = [json.loads(line) for line in (split / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8] and all(r["tokens_per_s"] > 0 for r in records)


@pytest.mark.slow
def test_seeded_runs_are_reproducible(tmp_path):
    """Guards against hidden nondeterminism (unseeded init, shuffling, dropout)."""
    for name in ("x", "y"):
        r = run_py(*TINY, "--out-dir", str(tmp_path / name), "--max-steps", "5", "--eval-every", "5")
        assert r.returncode == 0, r.stderr.decode()
    wx, wy = _weights(tmp_path / "x" / "last.pt"), _weights(tmp_path / "y" / "last.pt")
    assert all(torch.equal(wx[k], wy[k]) for k in wx)


@pytest.mark.slow
def test_torchrun_two_processes(tmp_path):
    """Guards against the data-parallel path rotting: 2 CPU processes (gloo) train a few steps,
    with a time limit so that the ranks' shared stopping decision is exercised too."""
    import socket

    with socket.socket() as sock:  # a free port, so a parallel run cannot collide
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    out = tmp_path / "ddp"
    r = run_py(
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        port,
        *TINY,
        "--out-dir",
        str(out),
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--time-limit-min",
        "30",
        timeout=600,
    )
    assert r.returncode == 0, r.stderr.decode()[-3000:]
    assert b"2 process(es)" in r.stderr
    assert (out / "model.pt").exists()


@pytest.mark.slow
def test_bad_preset_value_is_one_line_error():
    """Guards against a traceback for an impossible model shape."""
    r = run_py("train.py", "--preset", "tiny", "--d-model", "30", "--n-heads", "4")
    assert r.returncode == 2
    assert r.stderr.decode().strip().startswith("error:") and "Traceback" not in r.stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [True, False])
def test_proposal_heads_train_on_a_base_model(trained_tiny, tmp_path, freeze):
    """Guards the blockwise training regimes: frozen base (the model's weights stay bit-identical,
    only the heads learn) and joint fine-tuning (the base moves too); the checkpoint carries the
    heads, and exact blockwise decoding of it is greedy decoding of p_1 (float64)."""
    from refdec.data import load_split, source_tensor
    from refdec.decoding import decode_greedy
    from refdec.decoding.blockwise import decode_blockwise
    from refdec.proposal import load_proposal

    out = tmp_path / "heads"
    shutil.copytree(trained_tiny, tmp_path / "base")
    r = run_py(
        *TINY,
        "--out-dir",
        str(out),
        "--max-steps",
        "6",
        "--eval-every",
        "3",
        "--init-from",
        str(tmp_path / "base" / "model.pt"),
        "--proposal-k",
        "3",
        "--freeze-base",
        str(freeze).lower(),
        "--head-loss",
        "random" if freeze else "mean",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "tokens per call" in r.stderr.decode()
    base, checkpoint = load_checkpoint(trained_tiny / "model.pt"), load_checkpoint(out / "model.pt")
    same = all(torch.equal(base["model"][k], checkpoint["model"][k]) for k in base["model"])
    assert same == freeze
    raw = torch.load(out / "model.pt", weights_only=True)  # heads on a frozen base ship without its weights
    assert ("model" in raw) != freeze and ("frozen_base" in raw) == freeze
    model, tok, checkpoint = load_model(out / "model.pt", dtype=torch.float64)
    heads = load_proposal(checkpoint, dtype=torch.float64)
    assert heads is not None and heads.k == 3
    for line in load_split("mt-en-de", "dev").src[:3]:
        x = source_tensor([tok.encode(line)])
        assert torch.equal(
            decode_greedy(model, x, max_len=12).tokens[0], decode_blockwise(model, heads, x, max_len=12).tokens[0]
        )
    if freeze:  # the base named by the heads' file must be the file they were trained on
        base_file = tmp_path / "base" / "model.pt"
        base_file.write_bytes(base_file.read_bytes() + b"\0")
        with pytest.raises(CheckpointError, match="sha256"):
            load_checkpoint(out / "model.pt")
        base_file.unlink()
        with pytest.raises(CheckpointError, match="not there"):
            load_checkpoint(out / "model.pt")


def test_base_plus_random_head_loss_always_trains_the_base():
    """Guards the joint fine-tuning loss that keeps the base intact: every batch's loss is the mean of
    the base model's own loss (head 1) and that of one proposal head drawn from 2..k, never two far heads."""
    from refdec.model import Transformer
    from refdec.presets import PRESETS
    from refdec.proposal import ProposalHeads, head_logits, head_targets
    from refdec.training import ProposalHeadsLoss, smoothed_loss

    torch.manual_seed(0)
    cfg = PRESETS["tiny"].replace(proposal_k=4, head_loss="base+random", dropout=0.0)
    model = Transformer(cfg.model_config(40)).double().eval()
    heads = ProposalHeads(model.cfg.d_model, 16, 4).double().eval()
    obj = ProposalHeadsLoss(model, heads, cfg)
    src, tgt = torch.randint(5, 40, (3, 7)), torch.randint(5, 40, (3, 9))
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]
    with torch.no_grad():
        hidden = model.forward_hidden(src, tgt_in)
        per = {
            i: smoothed_loss(head_logits(model, heads, hidden, i), head_targets(tgt_out, i), 0.1, 0).item()
            for i in range(1, 5)
        }
        seen = set()
        for seed in range(20):
            torch.manual_seed(seed)
            loss = obj(src, tgt_in, tgt_out).item()
            far = [i for i in (2, 3, 4) if loss == pytest.approx((per[1] + per[i]) / 2, rel=1e-6)]
            assert len(far) == 1, (loss, per)
            seen.add(far[0])
    assert seen == {2, 3, 4}


@pytest.mark.slow
@pytest.mark.parametrize(
    "args,needle",
    [
        (["--proposal-k", "3", "--freeze-base", "true", "--head-loss", "base+random"], "needs freeze_base false"),
        (["--proposal-k", "1"], "proposal_k"),
        (["--freeze-base", "true"], "freeze_base needs proposal_k"),
        (["--proposal-k", "3", "--head-loss", "max"], "head_loss"),
        (["--head-loss", "mean"], "need proposal_k"),
        (["--glancing-end", "0.1"], "need drafter_k"),
        (["--pick", "newest"], "pick must be dev-loss, tokens-per-call or last"),
        (["--pick", "tokens-per-call"], "need drafter_k or proposal_k"),
        (["--tokenizer-from", "t.json", "--init-from", "m.pt"], "exclude each other"),
        (["--kd-weight", "0.3"], "needs kd_from"),
        (["--kd-from", "m.pt", "--kd-weight", "1.5"], "kd_weight"),
        (["--kd-from", "m.pt", "--drafter-k", "4"], "kd_from distils a plain model"),
        (["--compile", "yes"], "compile must be auto, on or off, not 'yes'"),
    ],
)
def test_bad_proposal_options_are_one_line_errors(args, needle):
    r = run_py(*TINY, "--out-dir", "/nonexistent", *args)
    err = r.stderr.decode()
    assert r.returncode != 0 and needle in err and "Traceback" not in err, err


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["causal", "bidirectional"])
def test_gad_drafter_trains_from_the_verifier(trained_tiny, tmp_path, layout):
    """Guards the drafter's training path (random prefix, k masks, glancing), its checkpoint mark, and
    its dev figure: GAD's tokens per call with the verifier it starts from, which chooses model.pt."""
    out = tmp_path / "drafter"
    r = run_py(
        *TINY,
        "--out-dir",
        str(out),
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--init-from",
        str(trained_tiny / "model.pt"),
        "--drafter-k",
        "4",
        "--drafter-layout",
        layout,
        "--pick",
        "tokens-per-call",
        "--speed-sentences",
        "5",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "block accuracy" in r.stderr.decode() and "(GAD with the verifier on 5 sentences)" in r.stderr.decode()
    assert 1 <= load_checkpoint(out / "best.pt")["meta"]["dev_tokens_per_call"] <= 5
    checkpoint = load_checkpoint(out / "model.pt")
    assert checkpoint["drafter"] == {"k": 4, "layout": layout}
    assert checkpoint["meta"]["train_config"]["init_from"].endswith("model.pt")


@pytest.mark.slow
def test_a_small_model_on_a_given_vocabulary_kept_as_trained_last(trained_tiny, tmp_path):
    """Guards BiLD's small-model path: --tokenizer-from trains a model of another shape on the same
    vocabulary (decode.py refuses pairs that differ), and --pick last makes model.pt the final
    weights rather than the best on the references' dev loss (alignment aims at a teacher's outputs)."""
    out = tmp_path / "small"
    r = run_py(
        *TINY,
        "--out-dir",
        str(out),
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--d-model",
        "16",
        "--tokenizer-from",
        str(trained_tiny / "tokenizer.json"),
        "--pick",
        "last",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert (out / "tokenizer.json").read_bytes() == (trained_tiny / "tokenizer.json").read_bytes()
    assert "model.pt <- last.pt" in r.stderr.decode()
    model, last = load_checkpoint(out / "model.pt"), load_checkpoint(out / "last.pt")
    assert model["meta"]["picked"] == "last" and model["step"] == last["step"] == 4
    assert all(torch.equal(model["model"][k], last["model"][k].half()) for k in last["model"])


def test_soft_cross_entropy_is_cross_entropy_against_the_teachers_distribution():
    """Word-level distillation's loss: torch's cross-entropy with probability targets, masked; with
    one-hot targets it is the ordinary cross-entropy of those tokens."""
    from refdec.training import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g, dtype=torch.float64)
    probs = torch.softmax(torch.randn(2, 5, 7, generator=g, dtype=torch.float64), dim=-1)
    keep = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    ref = torch.nn.functional.cross_entropy(logits[keep].float(), probs[keep].float())
    assert torch.allclose(soft_cross_entropy(logits, probs.float(), keep), ref, atol=1e-6)
    hard = torch.randint(7, (2, 5), generator=g)
    one_hot = torch.nn.functional.one_hot(hard, 7).float()
    assert torch.allclose(
        soft_cross_entropy(logits, one_hot, keep),
        torch.nn.functional.cross_entropy(logits[keep].float(), hard[keep]),
        atol=1e-6,
    )


@pytest.mark.slow
def test_word_level_distillation_trains_against_a_teacher(trained_tiny, tmp_path):
    """Guards the --kd-from path: the teacher is loaded frozen, the run trains and records it, and a
    teacher on another vocabulary is refused with one line."""
    out = tmp_path / "kd"
    r = run_py(
        *TINY,
        "--out-dir",
        str(out),
        "--max-steps",
        "4",
        "--eval-every",
        "2",
        "--init-from",
        str(trained_tiny / "model.pt"),
        "--kd-from",
        str(trained_tiny / "model.pt"),
        "--kd-weight",
        "0.7",
    )
    assert r.returncode == 0, r.stderr.decode()
    assert "distils" in r.stderr.decode() and "(weight 0.7)" in r.stderr.decode()
    checkpoint = load_checkpoint(out / "model.pt")
    assert checkpoint["meta"]["train_config"]["kd_from"].endswith("model.pt") and checkpoint["step"] == 4
    other = tmp_path / "other"
    r = run_py(*TINY, "--out-dir", str(other), "--max-steps", "2", "--eval-every", "2", "--vocab-size", "500")
    assert r.returncode == 0, r.stderr.decode()
    r = run_py(
        *TINY,
        "--out-dir",
        str(tmp_path / "kd2"),
        "--max-steps",
        "2",
        "--init-from",
        str(trained_tiny / "model.pt"),
        "--kd-from",
        str(other / "model.pt"),
    )
    err = r.stderr.decode()
    assert r.returncode != 0 and "not on this run's task and vocabulary" in err and "Traceback" not in err, err


@pytest.mark.parametrize("mode", ["plain", "distillation", "early-exit", "heads", "drafter"])
def test_each_mode_trains_on_its_own_loss(mode):
    """build_objective picks one loss per mode, and each is the formula its docstring gives (bitwise,
    on a float64 model in eval mode): the label-smoothed cross-entropy, its mix with the teacher's
    distributions, the mean of the full and the early-exit loss, the mean over proposal heads, and
    the drafter's loss on its block (glancing ratio 0: nothing revealed)."""
    from refdec.presets import PRESETS
    from refdec.proposal import ProposalHeads, head_logits, head_targets
    from refdec.training import (
        CrossEntropyLoss,
        DistillationLoss,
        DrafterLoss,
        EarlyExitLoss,
        ProposalHeadsLoss,
        build_model,
        build_objective,
        smoothed_loss,
        soft_cross_entropy,
    )

    changes = {
        "plain": {},
        "distillation": {"kd_from": "teacher.pt", "kd_weight": 0.3},
        "early-exit": {"early_exit": 1},
        "heads": {"proposal_k": 3, "head_loss": "mean"},
        "drafter": {"drafter_k": 3, "glancing_start": 0.0, "glancing_end": 0.0},
    }[mode]
    cfg = PRESETS["tiny"].replace(dec_layers=2, **changes)
    torch.manual_seed(0)
    model = build_model(cfg, 40).double().eval()
    heads = ProposalHeads(model.cfg.d_model, 16, 3).double().eval() if mode == "heads" else None
    teacher = tiny_model(1, vocab=40) if mode == "distillation" else None
    obj = build_objective(cfg, model, heads, teacher=teacher)
    expected_type = {
        "plain": CrossEntropyLoss,
        "distillation": DistillationLoss,
        "early-exit": EarlyExitLoss,
        "heads": ProposalHeadsLoss,
        "drafter": DrafterLoss,
    }[mode]
    assert type(obj) is expected_type
    src, tgt = torch.randint(5, 40, (3, 7)), torch.randint(5, 40, (3, 9))
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:]

    def ce(logits, target):
        return smoothed_loss(logits, target, cfg.label_smoothing, 0)

    torch.manual_seed(1)
    got = obj(src, tgt_in, tgt_out)
    torch.manual_seed(1)
    if mode in ("plain", "distillation"):
        logits = model(src, tgt_in)
        want = ce(logits, tgt_out)
        if mode == "distillation":
            soft = torch.softmax(teacher(src, tgt_in).float(), dim=-1)
            want = 0.7 * want + 0.3 * soft_cross_entropy(logits, soft, tgt_out.ne(0))
    elif mode == "early-exit":
        final, early = early_exit_hidden(model, src, tgt_in, 1)
        want = 0.5 * (ce(model.project(final), tgt_out) + ce(model.project(early), tgt_out))
        assert torch.equal(final, model.forward_hidden(src, tgt_in))
    elif mode == "heads":
        hidden = model.forward_hidden(src, tgt_in)
        want = sum(ce(head_logits(model, heads, hidden, i), head_targets(tgt_out, i)) for i in (1, 2, 3)) / 3
    else:
        inp, gold, block = obj.drafter_batch(tgt_out)
        want = ce(model.project(model.forward_hidden(src, inp, block)), gold)
    assert torch.equal(got, want), (got, want)


def test_heads_load_on_a_base_stored_before_newer_config_fields(tmp_path):
    """Guards heads on a frozen base whose file predates ModelConfig fields (activation, norm, bias,
    positions, ...): the heads' file stores them with their defaults, the base's does not, and the two
    are still the same network. A base of another shape is still refused."""
    from refdec.checkpoint import FORMAT, file_sha256

    model = tiny_model(0)
    full = model.cfg.to_dict()
    old = {
        k: full[k]
        for k in (
            "vocab_size",
            "d_model",
            "n_heads",
            "d_ff",
            "enc_layers",
            "dec_layers",
            "dropout",
            "norm_first",
            "tie_embeddings",
            "max_positions",
            "pad_id",
            "bos_id",
            "eos_id",
        )
    }
    base = {
        "format": FORMAT,
        "task": "mt-en-de",
        "model_config": old,
        "model": model.state_dict(),
        "tokenizer_sha256": "v",
        "step": 1,
        "meta": {},
    }
    save_atomic(base, tmp_path / "base" / "model.pt")
    heads = {
        "format": FORMAT,
        "task": "mt-en-de",
        "model_config": {**full, "dropout": 0.0},
        "tokenizer_sha256": "v",
        "step": 2,
        "meta": {},
        "frozen_base": {"path": "../base/model.pt", "sha256": file_sha256(tmp_path / "base" / "model.pt")},
    }
    save_atomic(heads, tmp_path / "heads" / "model.pt")
    checkpoint = load_checkpoint(tmp_path / "heads" / "model.pt")
    assert all(torch.equal(checkpoint["model"][k], v) for k, v in model.state_dict().items())
    save_atomic({**heads, "model_config": {**full, "activation": "gelu"}}, tmp_path / "heads" / "model.pt")
    with pytest.raises(CheckpointError, match="does not have the shape"):
        load_checkpoint(tmp_path / "heads" / "model.pt")


def _dev_and_vocab(n: int):
    """The first n mt-en-de dev pairs of 8 source tokens or more (so that a batch's output budget,
    2 x its longest source + 10, is the models' 23 positions for every row) and the shipped mt-en-de
    vocabulary (no training needed)."""
    from refdec.data import Split, load_split
    from refdec.tokenizer import Tokenizer

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    dev = load_split("mt-en-de", "dev")
    keep = [i for i, ids in enumerate(tok.encode_batch(dev.src[: 2 * n])) if len(ids) >= 8][:n]
    return Split([dev.src[i] for i in keep], [[r[i] for i in keep] for r in dev.refs], [dev.docs[i] for i in keep]), tok


def _batch1_tokens_per_call(decode, tok, dev, room: int) -> float:
    """Tokens per call of a decoder run one sentence at a time: all tokens over all calls."""
    from refdec.data import source_tensor

    tokens = calls = 0
    for ids in tok.encode_batch(dev.src):
        ids = ids[:room]
        res = decode(source_tensor([ids]), room)
        tokens, calls = tokens + res.stats.tokens, calls + res.stats.verifier_calls
    return tokens / calls


def test_heads_dev_tokens_per_call_is_per_row():
    """Guards the heads' dev figure: tokens per call per sentence (at most k), as decoding each
    sentence alone gives it, not all rows' tokens over the calls of a 40-row batch (which printed
    14.49 for k = 10)."""
    from refdec.decoding.blockwise import decode_blockwise
    from refdec.presets import PRESETS
    from refdec.proposal import ProposalHeads
    from refdec.training import build_model, build_objective

    dev, tok = _dev_and_vocab(40)
    cfg = PRESETS["tiny"].replace(
        proposal_k=3, head_loss="mean", eval_sentences=40, speed_sentences=40, max_positions=24, dropout=0.0
    )
    torch.manual_seed(0)
    model = build_model(cfg, tok.vocab_size).double()
    heads = ProposalHeads(model.cfg.d_model, 16, 3).double()
    scores = build_objective(cfg, model, heads).evaluate(tok, dev, torch.device("cpu"))
    model.eval(), heads.eval()
    want = _batch1_tokens_per_call(lambda x, n: decode_blockwise(model, heads, x, max_len=n), tok, dev, 23)
    assert 1 <= scores["dev_tokens_per_call"] <= 3
    assert scores["dev_tokens_per_call"] == pytest.approx(want, rel=1e-12)


def test_drafter_dev_figure_is_gads_tokens_per_call_with_its_verifier(tmp_path):
    """Guards the drafter's dev figure: GAD's tokens per verifier call and row with the verifier
    (whose encoder the drafter reads) on the first speed_sentences dev sentences, as GAD one
    sentence at a time gives it."""
    from refdec.adapters import SharedEncoder
    from refdec.decoding.gad import decode_gad
    from refdec.drafter import Drafter
    from refdec.presets import PRESETS
    from refdec.training import build_model, build_objective

    dev, tok = _dev_and_vocab(30)
    from refdec.checkpoint import make_checkpoint

    torch.manual_seed(0)
    verifier = build_model(PRESETS["tiny"].replace(max_positions=24, dropout=0.0), tok.vocab_size).double().eval()
    save_atomic(make_checkpoint(verifier, "mt-en-de", tok, 0), tmp_path / "v.pt")
    cfg = PRESETS["tiny"].replace(
        drafter_k=3,
        speed_sentences=12,
        max_positions=24,
        dropout=0.0,
        encoder_from=str(tmp_path / "v.pt"),
        enc_layers=0,
        out_dir=str(tmp_path / "run"),
    )
    model = build_model(cfg, tok.vocab_size, encoder=verifier).double()
    scores = build_objective(cfg, model, encoder=verifier).evaluate(tok, dev, torch.device("cpu"))
    drafter = Drafter(SharedEncoder(model.eval(), verifier), k=3)
    dev12 = type(dev)(dev.src[:12], [r[:12] for r in dev.refs], dev.docs[:12])
    want = _batch1_tokens_per_call(lambda x, n: decode_gad(verifier, drafter, x, max_len=n), tok, dev12, 20)
    assert 1 <= scores["dev_tokens_per_call"] <= 3 + 1
    assert scores["dev_tokens_per_call"] == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("pick,best_step", [("tokens-per-call", 1), ("dev-loss", 2)])
def test_best_checkpoint_is_ranked_by_the_runs_pick(tmp_path, pick, best_step):
    """Guards what best.pt (and so model.pt) is: with pick tokens-per-call the evaluation with the
    most tokens per call, though another has the lower dev loss."""
    from refdec.presets import PRESETS
    from refdec.tokenizer import Tokenizer
    from refdec.training import Progress, RunFolder, build_model, build_objective

    tok = Tokenizer.load(REPO / "checkpoints" / "mt-en-de" / "tokenizer.json")
    cfg = PRESETS["tiny"].replace(drafter_k=3, pick=pick, out_dir=str(tmp_path))
    model = build_model(cfg, tok.vocab_size)
    folder = RunFolder(cfg, build_objective(cfg, model), tok, lambda msg: None)
    progress, opt = Progress(), torch.optim.Adam(model.parameters())
    for scores in ({"dev_loss": 2.0, "dev_tokens_per_call": 1.6}, {"dev_loss": 1.0, "dev_tokens_per_call": 1.2}):
        progress.step += 1
        folder.save_evaluation(scores, progress, opt)
    assert load_checkpoint(tmp_path / "best.pt")["step"] == best_step


def _saved(model, tok, path: Path, **entries) -> Path:
    from refdec.checkpoint import make_checkpoint

    save_atomic({**make_checkpoint(model, "mt-en-de", tok, 0), **entries}, path)
    return path


def test_drafter_starts_from_the_verifier_and_continues_a_drafter(tmp_path):
    """Guards the drafters that start from what the verifier knows: on the verifier's frozen encoder,
    init_from the verifier gives the drafter the verifier's embeddings, first dec_layers decoder
    layers, final norm and output projection (every parameter equal to the verifier's); init_from a
    drafter on that encoder continues it as it is; a drafter of another encoder is refused."""
    from refdec.checkpoint import file_sha256
    from refdec.presets import PRESETS
    from refdec.training import TrainingError, build_model, build_run_objective

    _, tok = _dev_and_vocab(1)
    torch.manual_seed(0)
    verifier = build_model(PRESETS["tiny"].replace(dec_layers=3), tok.vocab_size)
    v_path = _saved(verifier, tok, tmp_path / "v" / "model.pt")
    cfg = PRESETS["tiny"].replace(
        drafter_k=3,
        enc_layers=0,
        dec_layers=2,
        encoder_from=str(v_path),
        init_from=str(v_path),
        out_dir=str(tmp_path / "run"),
    )
    obj = build_run_objective(cfg, tok, load_checkpoint(v_path), torch.device("cpu"))
    drafter, want = obj.model.state_dict(), verifier.state_dict()
    assert obj.model.cfg.enc_layers == 0 and obj.model.cfg.dec_layers == 2
    assert "decoder.0.ff.w1.weight" in drafter and "dec_norm.weight" in drafter and "tgt_embed.weight" in drafter
    assert all(torch.equal(t, want[k]) for k, t in drafter.items())
    assert obj.verifier[0] is obj.frozen_encoder[0]
    with torch.no_grad():
        obj.model.dec_norm.weight.add_(1.0)  # a trained drafter: not the verifier's any more
    d_path = _saved(
        obj.model,
        tok,
        tmp_path / "d" / "model.pt",
        drafter={"k": 3, "layout": "causal"},
        shared_encoder={"path": "../v/model.pt", "sha256": file_sha256(v_path)},
    )
    cont = build_run_objective(cfg.replace(init_from=str(d_path)), tok, load_checkpoint(d_path), torch.device("cpu"))
    assert all(torch.equal(t, obj.model.state_dict()[k]) for k, t in cont.model.state_dict().items())
    other = _saved(build_model(PRESETS["tiny"], tok.vocab_size), tok, tmp_path / "o" / "model.pt")
    with pytest.raises(TrainingError, match="another encoder"):
        build_run_objective(
            cfg.replace(init_from=str(d_path), encoder_from=str(other)),
            tok,
            load_checkpoint(d_path),
            torch.device("cpu"),
        )
    with pytest.raises(TrainingError, match="at most its 3 decoder layers"):
        build_run_objective(cfg.replace(dec_layers=4), tok, load_checkpoint(v_path), torch.device("cpu"))


def test_heads_continue_from_trained_heads_on_their_base(tmp_path):
    """Guards continuing trained heads: init_from a heads-alone file loads its heads (equal) on its
    base's weights, and the new heads name that base file, not the heads' file, as their base."""
    from refdec.checkpoint import file_sha256
    from refdec.presets import PRESETS
    from refdec.proposal import ProposalHeads, proposal_state
    from refdec.training import build_model, build_run_objective

    _, tok = _dev_and_vocab(1)
    torch.manual_seed(0)
    base = build_model(PRESETS["tiny"], tok.vocab_size)
    b_path = _saved(base, tok, tmp_path / "base" / "model.pt")
    heads = ProposalHeads(base.cfg.d_model, 16, 3)
    raw = {
        **torch.load(b_path, weights_only=True),
        "proposal": proposal_state(heads),
        "frozen_base": {"path": "../base/model.pt", "sha256": file_sha256(b_path)},
    }
    del raw["model"]
    save_atomic(raw, tmp_path / "heads" / "model.pt")
    cfg = PRESETS["tiny"].replace(
        proposal_k=3,
        proposal_d_ff=16,
        freeze_base=True,
        head_loss="mean",
        init_from=str(tmp_path / "heads" / "model.pt"),
        out_dir=str(tmp_path / "run"),
    )
    obj = build_run_objective(cfg, tok, load_checkpoint(cfg.init_from), torch.device("cpu"))
    assert all(torch.equal(t, heads.state_dict()[k]) for k, t in obj.heads.state_dict().items())
    assert all(torch.equal(t, base.state_dict()[k]) for k, t in obj.model.state_dict().items())
    assert obj.frozen_base == {"path": os.path.join("..", "base", "model.pt"), "sha256": file_sha256(b_path)}


def test_two_half_batch_passes_make_the_one_batch_update():
    """Guards gradient accumulation: a batch run as two passes (each loss weighted by its share of
    the target tokens) gives the update of the batch in one pass (float64, the trainer's AdamW), and
    on a CPU the default pass is the whole batch (a preset's optimisation as it was)."""
    from refdec.data import training_tensors
    from refdec.presets import PRESETS
    from refdec.training import accumulate, build_model, build_objective, device_pass_tokens

    cfg = PRESETS["tiny"].replace(dropout=0.0)
    g = torch.Generator().manual_seed(0)
    src = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (6,), generator=g)]
    tgt = [torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 12, (6,), generator=g)]
    params, losses, grads = [], [], []
    for pieces in ([range(6)], [range(3), range(3, 6)]):
        torch.manual_seed(0)
        model = build_model(cfg, 40).double()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9, weight_decay=0.0)
        obj = build_objective(cfg, model)
        loss, n_tok = accumulate(
            obj,
            [training_tensors([src[i] for i in part], [tgt[i] for i in part]) for part in pieces],
            0,
            torch.device("cpu"),
        )
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        params.append(list(model.parameters()))
        losses.append(loss)
        assert n_tok == sum(map(len, src)) + sum(map(len, tgt)) + 12  # every eos
    assert losses[0] == pytest.approx(losses[1], rel=1e-12)
    moved = [not torch.equal(p, q) for p, q in zip(params[0], build_model(cfg, 40).double().parameters())]
    assert any(moved)
    for a, b in zip(*grads):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-15), (a - b).abs().max()
    for a, b in zip(
        *params
    ):  # steps of lr 1e-2 agree to 1e-9 (Adam divides by sqrt(v) + eps: tiny gradients' rounding grows)
        assert torch.allclose(a, b, rtol=0, atol=1e-9), (a - b).abs().max()
    assert device_pass_tokens(cfg, build_model(cfg, 40).cfg, torch.device("cpu")) == cfg.batch_tokens


def test_training_ids_are_cached_outside_the_data_and_never_stale(tmp_path, monkeypatch):
    """Guards the token cache: a whole training set is tokenized once and its ids kept in refdec's cache
    folder ($XDG_CACHE_HOME/refdec/train-ids), never beside the data (case: train.py wrote a 25.8 MB
    .train-ids-*.pt into data/mt-en-de/, which no command writes into); a later run reads them (no
    tokenizing) and gets the same ids; an edited corpus is tokenized anew, never served from the old
    cache; a smoke run (train_limit) writes none."""
    import gzip

    from refdec.data import load_split
    from refdec.presets import PRESETS
    from refdec.training import encode_pairs

    _, tok = _dev_and_vocab(1)
    folder = tmp_path / "data" / "mt-en-de"
    folder.mkdir(parents=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    train = load_split("mt-en-de", "train")

    def write(tgt_lines):
        for name, lines in (("train.src.gz", train.src[:40]), ("train.tgt.gz", tgt_lines)):
            with gzip.open(folder / name, "wt", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))

    write(train.tgt[:40])
    cfg = PRESETS["tiny"].replace(data_dir=str(tmp_path / "data"))
    pairs = list(zip(train.src[:40], train.tgt[:40]))
    logs = []
    first = encode_pairs(cfg, tok, pairs, 0, logs.append)
    assert any("cached" in m for m in logs) and list(
        (tmp_path / "cache" / "refdec" / "train-ids").glob("mt-en-de-*.pt")
    )
    assert sorted(p.name for p in folder.iterdir()) == ["train.src.gz", "train.tgt.gz"]  # nothing beside the data
    real = tok.encode_batch
    monkeypatch.setattr(type(tok), "encode_batch", lambda self, texts: pytest.fail("tokenized again"))
    assert encode_pairs(cfg, tok, pairs, 0, logs.append) == first
    assert encode_pairs(cfg.replace(train_limit=10), tok, pairs[:10], 0, logs.append) == tuple(
        [row for row in side[:10]] for side in first
    )
    monkeypatch.setattr(type(tok), "encode_batch", lambda self, texts: real(texts))
    edited = ["Ein ganz anderer Satz."] + train.tgt[1:40]
    write(edited)
    again = encode_pairs(cfg, tok, list(zip(train.src[:40], edited)), 0, logs.append)
    assert again[1][0] == tok.encode("Ein ganz anderer Satz.") != first[1][0]


def test_tokens_per_call_pick_needs_a_drafters_verifier():
    """Guards a drafter run told to keep its best tokens per call without a verifier to run GAD with
    (neither --encoder-from nor --init-from a model): one clear error before training, not a run
    whose evaluations lack the figure its model.pt is chosen by."""
    from refdec.presets import PRESETS
    from refdec.training import DrafterLoss, TrainingError, build_model

    cfg = PRESETS["tiny"].replace(drafter_k=3, pick="tokens-per-call")
    with pytest.raises(TrainingError, match="needs the drafter's verifier"):
        DrafterLoss.load(cfg, build_model(cfg, 40), None, torch.device("cpu"))


def _steps(cfg, mode: str, backend: str | None, steps: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    """`steps` AdamW updates of a tiny float32 objective of `mode` (its passes compiled with `backend`,
    or eager) on batches of varying shapes: the losses and the final weights."""
    import torch._dynamo

    from refdec.data import training_tensors
    from refdec.proposal import ProposalHeads
    from refdec.training import build_model, build_objective

    torch._dynamo.reset()  # each test's objective is new: no code compiled for another one's guards
    torch.manual_seed(0)
    model = build_model(cfg, 40)
    heads = ProposalHeads(model.cfg.d_model, 16, cfg.proposal_k) if cfg.proposal_k else None
    teacher = tiny_model(1, vocab=40).float() if cfg.kd_from else None
    obj = build_objective(cfg, model, heads, teacher=teacher).train()
    if backend:
        obj.compile(backend)
        assert "passes compiled (torch.compile, " + backend in obj.describe()
    opt = torch.optim.AdamW([p for p in obj.parameters() if p.requires_grad], lr=1e-3)
    g, losses = torch.Generator().manual_seed(0), []
    for step in range(steps):
        rows = 2 + step  # another batch shape at every step: compiled once, for all of them
        src = [
            torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (rows,), generator=g)
        ]
        tgt = [
            torch.randint(5, 40, (int(n),), generator=g).tolist() for n in torch.randint(2, 12, (rows,), generator=g)
        ]
        obj.step = step
        opt.zero_grad()
        loss = obj(*training_tensors(src, tgt))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in obj.parameters()]


COMPILE_MODES = {
    "plain": {},
    "distillation": {"kd_from": "teacher.pt", "kd_weight": 0.3},
    "early-exit": {"early_exit": 1},
    "heads": {"proposal_k": 4, "head_loss": "random"},
    "drafter": {"drafter_k": 3},
}


@pytest.mark.parametrize("mode", list(COMPILE_MODES))
def test_compiled_passes_trace_every_mode_to_its_eager_updates(mode):
    """Guards what torch.compile traces of each mode's pass (Objective.compile: the tensor work
    only, the random heads, the drafter's blocks and glancing outside): traced by dynamo and run
    as traced (backend "eager", no compiler needed), the losses and weights of a few updates on
    batches of changing shapes, with dropout, are those of the eager objective, bit for bit."""
    from refdec.presets import PRESETS

    cfg = PRESETS["tiny"].replace(dec_layers=2, **COMPILE_MODES[mode])
    eager, traced = _steps(cfg, mode, None), _steps(cfg, mode, "eager")
    assert eager[0] == traced[0]
    assert all(torch.equal(a, b) for a, b in zip(eager[1], traced[1]))


def test_compile_option_is_on_where_asked_and_needs_a_compiler_on_a_cpu(monkeypatch):
    """Guards the compile option: auto compiles on a GPU only, off never, on always; a bad value,
    or compile on on a CPU without a C++ compiler, is one clear error."""
    from refdec.presets import PRESETS
    from refdec.training import TrainingError, loop

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    tiny = PRESETS["tiny"]
    assert tiny.compile == "auto"
    assert not loop.compiles(tiny, cpu) and loop.compiles(tiny, gpu)
    assert not loop.compiles(tiny.replace(compile="off"), gpu) and loop.compiles(tiny.replace(compile="on"), gpu)
    with pytest.raises(ValueError, match="compile must be auto, on or off, not 'yes'"):
        tiny.replace(compile="yes")
    monkeypatch.setattr(loop, "cpp_compiler", lambda: None)
    with pytest.raises(TrainingError, match="needs a C\\+\\+ compiler"):
        loop.compiles(tiny.replace(compile="on"), cpu)


needs_cpp = pytest.mark.skipif(cpp_compiler() is None, reason="torch.compile's CPU kernels need a C++ compiler")


@pytest.mark.slow
@needs_cpp
def test_compiled_run_matches_eager_and_resumes(tmp_path):
    """Guards --compile on end to end (inductor's generated kernels): the dev losses after 4 and 8
    updates of a compiled run (without dropout, whose masks inductor draws its own way) are the
    eager run's within float rounding (not the weights: Adam scales the rounding of gradients that
    are zero in exact arithmetic, such as the attention keys' bias, up to whole steps), and 4
    compiled updates, an interruption and 4 more after --resume give the straight compiled run's."""
    runs = {"eager": ("off", [8]), "compiled": ("on", [8]), "resumed": ("on", [4, 8])}
    for name, (compile_, stops) in runs.items():
        for i, stop in enumerate(stops):
            r = run_py(
                *TINY,
                "--out-dir",
                str(tmp_path / name),
                "--dropout",
                "0",
                "--compile",
                compile_,
                "--max-steps",
                str(stop),
                "--eval-every",
                "4",
                *(["--resume"] if i else []),
                timeout=900,
            )
            assert r.returncode == 0, r.stderr.decode()[-3000:]
            assert ("passes compiled (torch.compile, inductor" in r.stderr.decode()) == (compile_ == "on")
    losses = {
        name: [json.loads(line)["dev_loss"] for line in (tmp_path / name / "log.jsonl").read_text().splitlines()]
        for name in runs
    }
    assert len(losses["eager"]) == 2 and losses["compiled"] == pytest.approx(losses["eager"], rel=1e-5), losses
    assert losses["resumed"] == pytest.approx(losses["compiled"], rel=1e-6), losses
    wc, wr = _weights(tmp_path / "compiled" / "last.pt"), _weights(tmp_path / "resumed" / "last.pt")
    for k in wc:
        assert torch.allclose(wr[k], wc[k], rtol=0, atol=1e-6), (k, (wr[k] - wc[k]).abs().max())
