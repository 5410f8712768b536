"""Translation: the parallel-text reader and its bad inputs, the length-bucketed loader, the
encoder-decoder's decoding (cache, greedy, beam search), a run end to end on the CPU (train,
translate from the run and from its export, infer), and the data kind found by the registry."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

import pytest
import torch

from gpuaccel.cli import main
from gpuaccel.data import parse_spec
from gpuaccel.data.kinds import kind_named, kind_of_run
from gpuaccel.data.parallel import BOS, EOS, PAD, bucket_lengths, load_parallel
from gpuaccel.errors import GpuaccelError
from gpuaccel.kinds.translation import pair_loader
from gpuaccel.models.seq2seq import PyTorchDecoder, beam_search, transformer_seq2seq

WORDS = {"hund": "dog", "katze": "cat", "mann": "man", "frau": "woman", "kind": "child", "ball": "ball",
         "rot": "red", "blau": "blue", "gross": "big", "klein": "small", "läuft": "runs", "springt": "jumps",
         "schläft": "sleeps", "spielt": "plays"}
ADJECTIVES, NOUNS, VERBS = ["rot", "blau", "gross", "klein"], ["hund", "katze", "mann", "frau", "kind"], \
    ["läuft", "springt", "schläft", "spielt"]


def sentence_pairs(count: int, seed: int) -> tuple[list[str], list[str]]:
    """German-like sentences of a few words and their word-by-word English: 'Ein rot hund läuft.'
    -> 'A red dog runs.' (a mapping a small model learns in a few epochs)."""
    rng = random.Random(seed)
    src, tgt = [], []
    for _ in range(count):
        words = [rng.choice(ADJECTIVES), rng.choice(NOUNS), rng.choice(VERBS)]
        if rng.random() < 0.4:
            words.insert(0, rng.choice(ADJECTIVES))
        src.append("Ein " + " ".join(words) + ".")
        tgt.append("A " + " ".join(WORDS[w] for w in words) + ".")
    return src, tgt


def write_split(folder: Path, split: str, src: list[str], tgt: list[str], gz: bool = False) -> None:
    for language, lines in (("de", src), ("en", tgt)):
        text = "".join(line + "\n" for line in lines).encode()
        if gz:
            (folder / f"{split}.{language}.gz").write_bytes(gzip.compress(text))
        else:
            (folder / f"{split}.{language}").write_bytes(text)


@pytest.fixture
def pairs_dir(tmp_path):
    folder = tmp_path / "pairs"
    folder.mkdir()
    write_split(folder, "train", *sentence_pairs(600, 0), gz=True)
    write_split(folder, "val", *sentence_pairs(40, 1))
    write_split(folder, "test", *sentence_pairs(30, 2))
    return folder


def read(folder, **options):
    settings = dict(source="de", target="en", vocab_size=60, max_tokens=32, cache_dir=folder.parent / "cache")
    return load_parallel(folder, **{**settings, **options})


# ------------------------------------------------------------------------------ reading

def test_parallel_files_are_found_tokenised_and_cached(pairs_dir):
    assert parse_spec(str(pairs_dir)) == ("translation", pairs_dir)
    data = read(pairs_dir)
    assert (len(data.train), len(data.eval), list(data.tests)) == (600, 40, ["test"])
    assert data.eval.references[0] == sentence_pairs(40, 1)[1][0]  # the reference as written
    row = data.train.source[0]
    ids = row[row != PAD]
    assert ids[-1] == EOS and data.tokenizer.decode(ids[:-1]) == sentence_pairs(600, 0)[0][0]
    n = int((data.train.target_out[0] != PAD).sum()) - 1  # (the target's tokens, before its end)
    assert data.train.target_in[0, 0] == BOS and data.train.target_out[0, n] == EOS
    assert (data.train.target_in[0, 1:n + 1] == data.train.target_out[0, :n]).all()
    again = read(pairs_dir)  # (from the cache)
    assert (again.train.source == data.train.source).all()
    sentence = "Ein klein frau spielt."
    assert (again.tokenizer.encode(sentence) == data.tokenizer.encode(sentence)).all()


def test_each_bad_parallel_input_is_one_clear_error_or_counted(pairs_dir):
    (pairs_dir / "val.en").write_text("A dog.\n")  # one line against 40
    with pytest.raises(GpuaccelError, match=r"val\.de has 40 lines but .*val\.en has 1"):
        read(pairs_dir)
    write_split(pairs_dir, "val", *sentence_pairs(40, 1))
    (pairs_dir / "test.de").write_bytes(b"Ein hund.\nEin \xff\xfe hund.\n" + b"x\n" * 28)
    with pytest.raises(GpuaccelError, match=r"test\.de: line 2 is not UTF-8"):
        read(pairs_dir)
    (pairs_dir / "test.de").unlink()
    (pairs_dir / "test.en").unlink()
    (pairs_dir / "val.en").unlink()  # a missing side of the evaluation split
    with pytest.raises(GpuaccelError, match=r"split val has no val\.en"):
        read(pairs_dir)
    write_split(pairs_dir, "val", *sentence_pairs(40, 1))
    with pytest.raises(GpuaccelError, match="holds de and en; say which way to translate"):
        read(pairs_dir, source=None, target=None)
    src, tgt = sentence_pairs(600, 0)
    src[3], tgt[7] = "", "   "  # empty sides: skipped and counted
    src[5] = " ".join(["Ein rot hund läuft."] * 20)  # longer than max_tokens: cut and counted
    write_split(pairs_dir, "train", src, tgt, gz=True)
    data = read(pairs_dir)
    assert len(data.train) == 598 and data.skipped_empty == 2 and data.truncated == 1
    assert "2 pairs with an empty side skipped" in data.describe() and "1 sentences cut" in data.describe()
    assert (data.train.source != PAD).sum(1).max() <= 32


# ------------------------------------------------------------------------------ batches

def test_batches_come_in_a_few_shapes_cover_every_pair_and_resume_mid_epoch(pairs_dir):
    data = read(pairs_dir)
    _, sizes = bucket_lengths(data.train.lengths(), 256)
    loader = pair_loader(data.train, batch_tokens=256, device=torch.device("cpu"), train=True, seed=3)
    batches = list(loader.batches(0))
    assert len(batches) == len(loader) and {tuple(b[0].shape) for b in batches} == {(sizes[n], n) for n in sizes}
    assert all(b[0].shape[0] * b[0].shape[1] <= 256 for b in batches)
    seen = {tuple(row[row != PAD].tolist()) for b in batches for row in b[0]}
    assert seen == {tuple(row[row != PAD].tolist()) for row in torch.from_numpy(data.train.source)}
    tail = list(loader.batches(0, start=3))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches[3:], tail))
    assert not torch.equal(next(iter(loader.batches(1)))[0], batches[0][0])  # another epoch, another order
    shards = [pair_loader(data.train, batch_tokens=256, device=torch.device("cpu"), train=True, seed=3, rank=r,
                          world_size=2) for r in (0, 1)]
    assert len(shards[0]) == len(shards[1]) == len(loader) // 2
    evaluation = pair_loader(data.eval, batch_tokens=256, device=torch.device("cpu"), train=False)
    indices = torch.cat([b[3] for b in evaluation.batches()])
    assert sorted(indices.tolist()) == list(range(40))


# ------------------------------------------------------------------------------ decoding

def test_the_cached_step_is_the_teacher_forced_pass_and_greedy_is_beam_one():
    torch.manual_seed(0)
    model = transformer_seq2seq(50, 40, layers=2, heads=2, width=32, hidden=64, dropout=0.0).eval()
    source = torch.randint(4, 50, (3, 9))
    source[1, 6:] = PAD  # (a shorter sentence)
    target = torch.randint(4, 50, (3, 7))
    target[:, 0] = BOS
    with torch.no_grad():
        forced = torch.log_softmax(model(source, target), -1)
        decoder = PyTorchDecoder(model)
        decoder.start(source, 1, 8)
        for position in range(7):
            step = decoder.step(target[:, position], position)
            assert torch.allclose(step, forced[:, position], atol=1e-5)
        greedy = beam_search(PyTorchDecoder(model), source, beam=1, max_length=12)
        # greedy by hand: the whole prefix recomputed at every position, no cache (a hypothesis never
        # emits padding or a start token)
        prefix = torch.full((3, 1), BOS)
        for _ in range(12):
            logits = model(source, prefix)[:, -1]
            logits[:, [PAD, BOS]] = float("-inf")
            prefix = torch.cat([prefix, logits.argmax(-1, keepdim=True)], 1)
        for row in range(3):
            ids = prefix[row, 1:].tolist()
            ids = ids[:ids.index(EOS) + 1] if EOS in ids else ids
            assert greedy[row, :len(ids)].tolist() == ids and (greedy[row, len(ids):] == PAD).all()
        beams = beam_search(PyTorchDecoder(model), source, beam=4, max_length=12)
    assert beams.shape[0] == 3 and ((beams == EOS).sum(1) <= 1).all()


# ------------------------------------------------------------------------------ a run end to end

def test_a_translation_run_trains_translates_exports_and_infers(tmp_path, pairs_dir, capsys):
    run = tmp_path / "run"
    code = main(["train", "--data", str(pairs_dir), "--source-lang", "de", "--target-lang", "en", "--model-args",
                 "layers=1,heads=2,width=64,hidden=128,dropout=0.0", "--vocab-size", "60", "--context", "32",
                 "--optimizer", "adamw", "--lr", "3e-3", "--schedule", "constant", "--warmup-epochs", "0",
                 "--epochs", "12", "--batch-tokens", "512", "--beam-size", "2", "--device", "cpu", "--no-monitor",
                 "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(run), "--json"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["task"] == "translation" and summary["model"] == "transformer_seq2seq"
    assert summary["metrics"]["bleu"] > 60 and summary["best_model"]["metric"] == "bleu"
    assert summary["metric_signatures"]["bleu"].startswith("nrefs:1|case:mixed|eff:no|tok:13a")
    from gpuaccel.deploy.artifact import load_run_state

    assert kind_of_run(load_run_state(run)[0]) is kind_named("translation")

    text = tmp_path / "in.de"
    text.write_text("Ein blau katze schläft.\n\nEin klein kind springt.\n")
    assert main(["translate", str(run), str(text), "--out", str(tmp_path / "out.en")]) == 0
    lines = (tmp_path / "out.en").read_text().split("\n")
    assert lines[1] == "" and len(lines) == 4  # the empty line kept, in order
    assert lines[0] == "A blue cat sleeps." and lines[2] == "A small child jumps."

    assert main(["export", str(run), "--verify", "20", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["same_translations"] == 1.0 and report["format"] == "pt2"
    archive = Path(report["artifact"])
    assert archive.name == "translator.zip"
    assert main(["translate", str(archive), str(text), "--out", str(tmp_path / "out2.en")]) == 0
    assert (tmp_path / "out2.en").read_text() == (tmp_path / "out.en").read_text()
    capsys.readouterr()
    assert main(["infer", str(archive), str(text), str(text)]) == 0  # every input, in order
    assert capsys.readouterr().out.split("\n")[:6] == lines[:3] + lines[:3]

    empty = tmp_path / "empty.de"
    empty.write_text("")
    assert main(["translate", str(run), str(empty)]) == 0
    assert capsys.readouterr().out == ""
    assert main(["export", str(run), "--format", "onnx"]) == 2
    assert "a translation model exports as pt2" in capsys.readouterr().err
