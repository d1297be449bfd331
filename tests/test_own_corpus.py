"""A corpus of one's own: a task folder of plain (or gzipped) files with no dev split trains a verifier
(train.py --task NAME --data-dir DIR), `python -m refdec train-drafters --verifier` trains a drafter
and heads sized from it, and their GAD and blockwise decoding equal its greedy decoding; the errors
name the files a task's folder must hold; the dev split held out of train is the same in every run
and never trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import OWN_CORPUS_WORDS as WORDS
from conftest import REPO, random_checkpoint, run_py
from conftest import own_corpus as corpus

from refdec import data as data_mod
from refdec.data import carve_dev, load_split, training_splits


def test_plain_and_gzipped_files_read_alike(tmp_path):
    plain, packed = corpus(tmp_path / "plain"), corpus(tmp_path / "packed", gz=True)
    for split in ("train", "test"):
        a, b = load_split("up", split, plain), load_split("up", split, packed)
        assert a.src == b.src and a.refs == b.refs and len(a) == (200 if split == "train" else 4)
    (packed / "up" / "train.src").write_text("x\n")
    with pytest.raises(data_mod.UsageError, match="holds both train.src and train.src.gz: keep one"):
        load_split("up", "train", packed)


def test_errors_name_the_files_of_the_task_given(tmp_path, monkeypatch):
    """Case: with a plain train.src in DIR/up, --task up said "train.src.gz not found; rebuild with:
    python data/build.py up", a command for a task the repository does not ship, and gzip was required
    unsaid. Now the error names both forms and what the folder holds; the repository's commands are
    offered only for the tasks it ships (data/build.py in its own data/, distill in another folder)."""
    data = tmp_path / "data"
    (data / "up").mkdir(parents=True)
    (data / "up" / "train.src").write_text("a b\n")
    with pytest.raises(FileNotFoundError) as e:
        load_split("up", "train", data)
    msg = str(e.value)
    assert msg.startswith("no train.tgt or train.tgt.gz in ") and "train.src and train.tgt (plain text, or gzip" in msg
    assert "build.py" not in msg and "distill" not in msg
    with pytest.raises(FileNotFoundError, match="holds no task mt-en-de; it holds up \\(--task names the folder\\)"):
        load_split("mt-en-de", "train", corpus(tmp_path / "other"))
    with pytest.raises(FileNotFoundError, match="python -m refdec distill --task mt-en-de"):
        load_split("mt-en-de", "train", tmp_path / "empty")
    monkeypatch.setattr(data_mod, "DATA_DIR", data)  # as the repository's data/ with a shipped task's file lost
    (data / "mt-en-de").mkdir()
    with pytest.raises(
        FileNotFoundError, match="no train.src or train.src.gz in .*rebuild with: python data/build.py mt-en-de"
    ):
        load_split("mt-en-de", "train", data)
    with pytest.raises(ValueError, match="unknown task 'down'.*a corpus of your own: --data-dir DIR with DIR/down/"):
        load_split("down", "train", data)


def test_train_py_names_the_missing_file_in_one_line(tmp_path, capsys):
    from refdec.commands.train import main

    data = corpus(tmp_path / "data")
    (data / "up" / "train.tgt").unlink()
    code = main(["--preset", "tiny", "--data-dir", str(data), "--task", "up", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: no train.tgt or train.tgt.gz in ") and "build.py" not in err


def test_the_dev_split_held_out_of_train_is_fixed_and_disjoint(tmp_path):
    """Guards the dev split of a folder without one: 1 in 20 training pairs (at least 1, at most
    1000), the same rows in every run (a drafter's run validates on the verifier's dev pairs), none of
    them trained on, and the test files never read (here a broken one)."""
    assert [len(carve_dev(n)) for n in (2, 39, 40, 200, 10**5)] == [1, 1, 2, 10, 1000]
    assert carve_dev(200) == carve_dev(200) == sorted(set(carve_dev(200)))
    with pytest.raises(ValueError, match="too few"):
        carve_dev(1)
    data = corpus(tmp_path / "data")
    (data / "up" / "test.src").write_bytes(b"\xff\xfe not text")
    whole = load_split("up", "train", data)
    train, dev, held = training_splits("up", data)
    assert held == len(dev) == 10 and len(train) == 190
    assert dev.src == [whole.src[i] for i in carve_dev(200)] and dev.tgt == [whole.tgt[i] for i in carve_dev(200)]
    kept = [i for i in range(200) if i not in set(carve_dev(200))]
    assert train.src == [whole.src[i] for i in kept] and train.tgt == [whole.tgt[i] for i in kept]
    again = training_splits("up", data)
    assert again[1].src == dev.src and again[0].src == train.src
    for name, lines in (("dev.src", whole.src[:3]), ("dev.tgt", whole.tgt[:3])):
        (data / "up" / name).write_text("".join(line + "\n" for line in lines))
    train, dev, held = training_splits("up", data)
    assert held == 0 and dev.src == whole.src[:3] and train.src == whole.src


def test_the_token_cache_tells_a_held_out_dev_split_apart(tmp_path, monkeypatch):
    """The cached ids of a folder's training pairs depend on whether a dev split was held out of them
    (a dev file added later makes every pair a training pair again): never served stale."""
    from refdec.presets import PRESETS
    from refdec.tokenizer import Tokenizer
    from refdec.training import TokenCache

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    data = corpus(tmp_path / "data")
    tok = Tokenizer.train(WORDS * 3, vocab_size=300, min_frequency=1)
    cfg = PRESETS["tiny"].replace(task="up", data_dir=str(data))
    carved, whole = TokenCache(cfg, tok, 10).key(), TokenCache(cfg, tok).key()
    assert carved != whole and {"train.src", "train.tgt"} <= set(whole)


def test_a_borrowed_preset_follows_the_checkpoint_it_is_given(tmp_path):
    """Case: --preset mt-en-de-drafter --encoder-from MY/model.pt (width 32) trained a decoder of
    width 256 with 256 positions, the preset's, in silence. Now the fields the command line leaves out
    follow the checkpoint given, a note says which, and those given are kept."""
    from refdec.commands.train import follow_checkpoint, preset_config

    ckpt = str(random_checkpoint(tmp_path / "m"))  # width 16, 2 heads, 64 positions
    changes = {"encoder_from": ckpt, "d_ff": 48}
    cfg, note = follow_checkpoint("mt-en-de-drafter", preset_config("mt-en-de-drafter", changes), changes)
    assert (cfg.d_model, cfg.n_heads, cfg.max_positions, cfg.d_ff) == (16, 2, 64, 48)
    assert "d_model 256 -> 16" in note and "max_positions 256 -> 64" in note and "d_ff" not in note
    changes = {"init_from": ckpt}
    cfg, note = follow_checkpoint("mt-en-de-blockwise", preset_config("mt-en-de-blockwise", changes), changes)
    assert (cfg.enc_layers, cfg.dec_layers, cfg.proposal_d_ff) == (2, 2, 4)  # the preset's 128 of 1024, of d_ff 32
    same = {"encoder_from": str(REPO / "checkpoints/mt-en-de/model.pt")}  # the preset's own: nothing to follow
    assert follow_checkpoint("mt-en-de-drafter", preset_config("mt-en-de-drafter", same), same)[1] == ""


def test_train_drafters_refuses_what_is_no_verifier_in_one_line(tmp_path, capsys, monkeypatch):
    from conftest import error_of

    from refdec.commands import train_drafters as td

    ckpt = random_checkpoint(tmp_path / "m")  # task mt-en-de, 2 decoder layers
    data = corpus(tmp_path / "data")
    err = error_of(td.main, ["--data-dir", str(data)], capsys, monkeypatch)
    assert "--data-dir needs --verifier" in err
    err = error_of(td.main, ["--verifier", str(ckpt), "--data-dir", str(data), "--task", "up"], capsys, monkeypatch)
    assert "the verifier" in err and "was trained for mt-en-de" in err
    err = error_of(td.main, ["--verifier", str(ckpt), "--data-dir", str(data)], capsys, monkeypatch)
    assert "holds no task mt-en-de; it holds up" in err
    mine = corpus(tmp_path / "mine", task="mt-en-de")
    err = error_of(
        td.main, ["--verifier", str(ckpt), "--data-dir", str(mine), "--drafter-layers", "3"], capsys, monkeypatch
    )
    assert "--drafter-layers 3" in err and "it has 2" in err


@pytest.fixture(scope="module")
def own_verifier(tmp_path_factory) -> Path:
    """A tiny verifier trained on a corpus of plain files with no dev split, by train.py's entry point."""
    from refdec.commands.train import main

    root = tmp_path_factory.mktemp("own")
    data = corpus(root / "data")
    argv = ["--preset", "tiny", "--data-dir", str(data), "--task", "up", "--out-dir", str(root / "verifier")]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(root / "cache"))  # the token cache, kept out of the user's
        assert main([*argv, "--max-steps", "8", "--eval-every", "8", "--eval-sentences", "2", "--threads", "1"]) == 0
    return root


def test_a_drafter_and_heads_for_ones_own_verifier_decode_as_its_greedy(own_verifier, monkeypatch, capsys):
    """The recipe of docs/usage.md ("Training on your own corpus") on a tiny corpus: train-drafters
    --verifier --distill (each job run by train.py's entry point, in this process), then decode.py
    --algo gad and --algo blockwise, each compared with greedy: every output identical."""
    from refdec.checkpoint import load_checkpoint
    from refdec.commands import decode, train, train_drafters

    root = own_verifier
    monkeypatch.chdir(root)
    monkeypatch.setenv("XDG_CACHE_HOME", str(root / "cache"))
    ran = []
    monkeypatch.setattr(train_drafters, "run_job", lambda cmd, env: (ran.append(cmd) or train.main(cmd[2:]), False))
    argv = ["--verifier", "verifier/model.pt", "--data-dir", "data", "--out-dir", "drafters", "--distill"]
    assert train_drafters.main([*argv, "--max-steps", "4", "--dev-limit", "4"]) == 0
    assert [Path(cmd[1]).name for cmd in ran] == ["train.py", "train.py"]
    for cmd in ran:  # sized from the verifier (tiny: width 32, 2 heads, 128 positions), on its distilled outputs
        assert " --d-model 32 --n-heads 2 --d-ff 64 --max-positions 128 " in " ".join(cmd) + " "
        assert cmd[cmd.index("--data-dir") + 1] == "drafters/distilled"
    assert "10 of its 200 training pairs are held out as the dev set" in capsys.readouterr().err
    drafter, heads = (
        load_checkpoint("drafters/gad-drafter/model.pt"),
        load_checkpoint("drafters/blockwise-heads/model.pt"),
    )
    assert drafter["drafter"]["k"] == 4 and drafter["model_config"]["d_model"] == 32
    assert heads["proposal"]["config"] == {"d_model": 32, "d_ff": 8, "k": 4}  # an eighth of the verifier's d_ff
    assert json.loads(Path("drafters/distilled/up/distill.json").read_text())["sentences"] == 200
    for algo, models in (
        ("gad", ["--model", "verifier/model.pt", "--drafter", "drafters/gad-drafter/model.pt"]),
        ("blockwise", ["--model", "drafters/blockwise-heads/model.pt"]),
    ):
        report = root / f"{algo}.json"
        args = ["--algo", algo, *models, "--input", "data/up/test.src", "--compare", "greedy", "--report", str(report)]
        assert decode.main([*args, "--output", str(root / f"{algo}.txt"), "--threads", "1", "--quiet"]) == 0
        checks = json.loads(report.read_text())["lossless_checks"]
        assert [(c["algo"], c["identical"], c["divergences"]) for c in checks] == [(algo, 1.0, [])]


@pytest.mark.slow
def test_the_documented_commands_run_end_to_end(tmp_path):
    """docs/usage.md's recipe as a user types it, each command its own process: train.py on the folder,
    train-drafters with --distill, and decode.py's GAD and blockwise runs compared with greedy."""
    data = corpus(tmp_path / "mydata", gz=True)
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    steps = ["--max-steps", "6", "--eval-every", "6", "--eval-sentences", "2"]
    verifier = ["--preset", "tiny", "--data-dir", str(data), "--task", "up", "--out-dir", str(tmp_path / "v")]
    r = run_py("train.py", *verifier, *steps, env=env)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert "training pairs are held out as the dev set" in r.stderr.decode()
    r = run_py(
        "-m", "refdec", "train-drafters", "--verifier", str(tmp_path / "v/model.pt"), "--data-dir", str(data),
        "--distill", "--out-dir", str(tmp_path / "d"), "--max-steps", "4", "--dev-limit", "4", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    for algo, models in (
        ("gad", ["--model", str(tmp_path / "v/model.pt"), "--drafter", str(tmp_path / "d/gad-drafter/model.pt")]),
        ("blockwise", ["--model", str(tmp_path / "d/blockwise-heads/model.pt")]),
    ):
        report = tmp_path / f"{algo}.json"
        r = run_py(
            "decode.py", "--algo", algo, *models, "--input", str(data / "up/test.src.gz"), "--compare", "greedy",
            "--report", str(report), "--output", str(tmp_path / f"{algo}.txt"),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr.decode()[-2000:]
        assert [c["identical"] for c in json.loads(report.read_text())["lossless_checks"]] == [1.0]
