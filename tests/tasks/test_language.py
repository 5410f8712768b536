"""Text: the corpus and sentence readers (and their bad inputs), the GPT (causal, its cache),
language-model and sentence-classification runs, and text generation."""

from __future__ import annotations

import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from gpuaccel.cli import main
from gpuaccel.data import parse_spec
from gpuaccel.data.sentences import load_sentences
from gpuaccel.data.text import CharTokenizer, load_corpus, validation_windows
from gpuaccel.errors import GpuaccelError
from gpuaccel.kinds.corpus import window_loader
from gpuaccel.kinds.sentences import sentence_loader
from gpuaccel.models import create_model
from gpuaccel.train import TrainConfig, Trainer


def markov_text(length: int, seed: int = 0) -> str:
    """Text whose next character is nearly always determined by the one before (a fixed cycle
    through 12 letters, with 5% random characters): unigram entropy about ln 12, while a model
    that reads the previous character can do far better."""
    rng = random.Random(seed)
    letters = "abcdefghijkl"
    out, i = [], 0
    for _ in range(length):
        i = rng.randrange(12) if rng.random() < 0.05 else (i + 1) % 12
        out.append(letters[i])
    return "".join(out)


@pytest.fixture
def corpus_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(markov_text(6000))
    return path


def tiny_lm_config(tmp_path, data, **overrides):
    settings = dict(data=str(data), model="gpt", model_args={"layers": 1, "heads": 2, "width": 32}, context=16,
                    batch_size=32, optimizer="adamw", lr=1e-2, weight_decay=0.0, schedule="constant",
                    warmup_epochs=0.0, epochs=3, eval_batch_size=64, monitor=False, cache_dir=str(tmp_path / "cache"),
                    run_dir=str(tmp_path / "run"), device="cpu")
    return TrainConfig(**{**settings, **overrides})


# ------------------------------------------------------------------------------ corpus reader

def test_a_corpus_is_split_at_its_last_tenth_and_read_again_from_the_cache(tmp_path, corpus_file):
    first = load_corpus(corpus_file, cache_dir=tmp_path / "cache")
    assert parse_spec(str(corpus_file))[0] == "text"
    assert len(first.train) == 5400 and len(first.val) == 600
    text = corpus_file.read_text()
    assert first.tokenizer.decode(first.val) == text[5400:]
    again = load_corpus(corpus_file, cache_dir=tmp_path / "cache")
    assert np.array_equal(again.train, first.train) and again.tokenizer.state() == first.tokenizer.state()
    assert list((tmp_path / "cache").glob("*.npz"))


def test_a_folder_of_text_files_is_one_corpus_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("second part\n" * 20)
    (tmp_path / "a.txt").write_text("first part\n" * 20)
    corpus = load_corpus(tmp_path, tokenizer="byte")
    assert parse_spec(str(tmp_path))[0] == "text"
    assert corpus.files == 2 and corpus.vocab_size == 256
    assert corpus.tokenizer.decode(corpus.train).startswith("first part")


def test_bpe_tokens_are_learned_from_the_training_split(tmp_path, corpus_file):
    pytest.importorskip("tokenizers")
    corpus = load_corpus(corpus_file, tokenizer="bpe", vocab_size=300)
    assert 256 < corpus.vocab_size <= 300
    assert len(corpus.train) < 5400  # pairs of letters merged
    assert corpus.tokenizer.decode(corpus.val) == corpus_file.read_text()[5400:]


def test_bpe_learns_and_encodes_a_text_in_pieces_as_it_would_the_whole_text():
    """The corpus is cut into pieces (tokenized in parallel) only where byte-level BPE cuts it
    anyway: its ids, and the vocabulary learned from it, are those of the text taken whole, also
    where blank lines, indentation, CRLF endings and trailing spaces meet a line's end."""
    tokenizers = pytest.importorskip("tokenizers")
    from gpuaccel.data.text import BpeTokenizer, byte_level_pieces

    code = ("def f(x):\n    return x  \n\n\n\nclass A:\n\tpass\r\nprint('it''s')\n \nz = 1\n"
            "    # indented\nend\n\n") * 40 + "naïve café\nlast"
    pieces = byte_level_pieces(code)
    assert len(pieces) > 40 and "".join(pieces) == code
    learned = BpeTokenizer.train([code], 400)
    whole = tokenizers.Tokenizer(tokenizers.models.BPE())
    whole.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    whole.train_from_iterator([code], trainer=tokenizers.trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    assert learned.tokenizer.get_vocab() == whole.get_vocab()
    assert learned.encode(code).tolist() == learned.tokenizer.encode(code).ids
    assert learned.decode(learned.encode(code)) == code
    assert learned.encode("").tolist() == []


def test_a_tokenizer_file_is_used_as_it_is_and_recorded_for_generation(tmp_path, corpus_file, capsys):
    """--tokenizer-file: a HuggingFace tokenizer.json (as GPT-2's is published) tokenises the
    corpus instead of a learned vocabulary; the run records it, so generation decodes with it."""
    pytest.importorskip("tokenizers")
    from gpuaccel.data.text import BpeTokenizer

    other_text = " ".join(["abc", "abd", "bcd", "cab"] * 200)
    given = BpeTokenizer.train([other_text], 270)
    file = tmp_path / "tokenizer.json"
    given.tokenizer.save(str(file))
    corpus = load_corpus(corpus_file, tokenizer="bpe", tokenizer_file=file, cache_dir=tmp_path / "cache")
    assert corpus.vocab_size == given.vocab_size
    assert np.array_equal(corpus.val, given.encode(corpus_file.read_text()[5400:]))
    learned = load_corpus(corpus_file, tokenizer="bpe", vocab_size=270, cache_dir=tmp_path / "cache")
    assert not np.array_equal(learned.val, corpus.val)  # (not the vocabulary learned from this corpus)

    Trainer(tiny_lm_config(tmp_path, corpus_file, tokenizer=None, tokenizer_file=str(file), epochs=1),
            quiet=True).fit()
    assert main(["generate", str(tmp_path / "run"), "--prompt", "abc", "--tokens", "4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["texts"][0].startswith("abc")
    with pytest.raises(GpuaccelError, match="no such file"):
        load_corpus(corpus_file, tokenizer="bpe", tokenizer_file=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(GpuaccelError, match="is not a HuggingFace tokenizer.json"):
        load_corpus(corpus_file, tokenizer="bpe", tokenizer_file=tmp_path / "bad.json")
    with pytest.raises(GpuaccelError, match="goes with (--)?tokenizer bpe, not char"):
        load_corpus(corpus_file, tokenizer="char", tokenizer_file=file)


def test_char_tokens_round_trip_and_unknown_characters_are_named():
    tok = CharTokenizer("hello world")
    assert tok.decode(tok.encode("hello")) == "hello"
    with pytest.raises(GpuaccelError, match="lacks: 'z'"):
        tok.encode("hez")


@pytest.mark.parametrize("content, message", [
    (b"", "is empty"),
    (b"   \n\n", "only whitespace"),
    (b"good line\nsecond line\nbad \xff byte\n", "line 3 is not UTF-8"),
])
def test_bad_corpus_files_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(GpuaccelError, match=message):
        load_corpus(path)


def test_a_corpus_shorter_than_one_window_is_refused(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("to be or not to be " * 20)  # 38 validation characters
    with pytest.raises(GpuaccelError, match="fewer than one window of context 64"):
        Trainer(tiny_lm_config(tmp_path, path, context=64), quiet=True)
    with pytest.raises(GpuaccelError, match="tokenizer for language modelling"):
        load_corpus(path, tokenizer="word")


def test_windows_are_the_text_shifted_by_one_and_a_resume_continues_the_same_draw(corpus_file):
    corpus = load_corpus(corpus_file)
    loader = window_loader(torch.from_numpy(corpus.train), context=16, batch_size=8, device=torch.device("cpu"), seed=3)
    batches = list(loader.batches(epoch=1))
    assert len(batches) == len(loader) == (5400 - 1) // 16 // 8
    x, y = batches[0]
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    resumed = list(loader.batches(epoch=1, start=2))
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches[2:], resumed))
    other = list(loader.batches(epoch=2))
    assert not torch.equal(other[0][0], x)
    vx, vy = validation_windows(corpus.val, 16)
    assert vx.shape == ((600 - 1) // 16, 16) and torch.equal(vx.flatten()[1:], vy.flatten()[:-1])


# ------------------------------------------------------------------------------ the GPT

def test_no_position_sees_the_future():
    torch.manual_seed(0)
    model = create_model("gpt", vocab_size=20, context_length=12, layers=2, heads=2, width=16).eval()
    ids = torch.randint(20, (2, 12))
    changed = ids.clone()
    changed[:, 7:] = (changed[:, 7:] + 5) % 20
    a, b = model(ids), model(changed)
    assert torch.allclose(a[:, :7], b[:, :7], atol=1e-5)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-3)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generation_with_the_cache_equals_recomputing_the_whole_context(temperature):
    torch.manual_seed(0)
    model = create_model("gpt", vocab_size=30, context_length=16, layers=2, heads=2, width=32).eval()
    prompt = torch.randint(30, (2, 5))
    runs = [model.generate(prompt, 30, temperature=temperature, top_k=10, use_cache=cache,
                           generator=torch.Generator().manual_seed(1)) for cache in (True, False)]
    assert runs[0].shape == (2, 35)  # past the 16-token context: the window slides
    assert torch.equal(runs[0], runs[1])


def test_a_padded_vocabulary_gives_the_vocabularys_logits_and_the_same_generation():
    """pad_vocab rounds the embedding up (rows no token reaches); the logits stay the
    vocabulary's, so the loss, generation and decoding never see a padding row."""
    torch.manual_seed(0)
    model = create_model("gpt", vocab_size=30, context_length=16, layers=1, heads=2, width=16, pad_vocab=64).eval()
    assert model.embedding.num_embeddings == 64 and model.head.weight.shape == (64, 16)
    ids = torch.randint(30, (2, 9))
    assert model(ids).shape == (2, 9, 30)
    assert model.generate(ids, 20, temperature=1.0, generator=torch.Generator().manual_seed(0)).max() < 30
    with pytest.raises(GpuaccelError, match="pad_vocab must be a whole number"):
        create_model("gpt", vocab_size=30, pad_vocab=0)


def test_an_attention_kernel_is_named_and_math_gives_pytorchs_default_result():
    torch.manual_seed(0)
    default = create_model("gpt", vocab_size=20, context_length=8, layers=1, heads=2, width=16).eval()
    math_only = create_model("gpt", vocab_size=20, context_length=8, layers=1, heads=2, width=16,
                             attention="math").eval()
    math_only.load_state_dict(default.state_dict())
    ids = torch.randint(20, (2, 8))
    assert torch.allclose(default(ids), math_only(ids), atol=1e-5)
    with pytest.raises(GpuaccelError, match="attention is auto or one of flash, cudnn"):
        create_model("gpt", vocab_size=20, attention="fast")


def test_the_gpt2_small_recipe_builds_gpt2s_shape_on_a_learned_bpe_vocabulary(tmp_path):
    """The recipe as a CPU can afford it: its settings (BPE, context 1024, 12 x 768, padded
    vocabulary) built into a Trainer on a small corpus; the model is GPT-2 small's shape."""
    from gpuaccel.train.recipes import load_recipe

    corpus = tmp_path / "words.txt"
    corpus.write_text(" ".join(random.Random(0).choice(["the", "cat", "sat", "on", "a", "mat", "and", "dog"])
                               for _ in range(40000)))
    settings = {**load_recipe("gpt2-small"), "data": str(corpus), "device": "cpu", "compile": False,
                "monitor": False, "run_dir": None, "cache_dir": str(tmp_path / "cache")}
    trainer = Trainer(TrainConfig.from_dict(settings), quiet=True)
    model = trainer.model
    assert len(model.blocks) == 12 and model.embedding.embedding_dim == 768 and model.context_length == 1024
    assert trainer.inputs.tokenizer["kind"] == "bpe"
    assert model.blocks[0].mlp.activation == "relu2" and model.blocks[0].norm1.weight is None
    vocabulary = model.vocab_size
    assert 256 < vocabulary <= 50257 and model.embedding.num_embeddings == -(-vocabulary // 64) * 64
    matrices = sum(p.numel() for n, p in model.named_parameters() if p.ndim == 2)
    assert matrices - model.embedding.weight.numel() == 12 * 12 * 768 * 768  # GPT-2 small's blocks


# ------------------------------------------------------------------------------ training and generation

def test_a_tiny_language_model_learns_far_below_the_unigram_entropy(tmp_path, corpus_file, capsys):
    summary = Trainer(tiny_lm_config(tmp_path, corpus_file, target="val_loss=0.6", epochs=40), quiet=True).fit()
    ids = load_corpus(corpus_file).train
    freq = np.bincount(ids) / len(ids)
    unigram = -float((freq[freq > 0] * np.log(freq[freq > 0])).sum())
    assert unigram > 2.4
    assert summary["best_metrics"]["loss"] < 0.5 * unigram, summary["best_metrics"]
    assert summary["stopped_by"] == "target" and summary["target_metric"] == "loss"
    assert summary["task"] == "language_modelling" and summary["tokens_per_second"] > 0
    assert math.isclose(summary["metrics"]["perplexity"], math.exp(summary["metrics"]["loss"]), rel_tol=1e-4)

    assert main(["generate", str(tmp_path / "run"), "--prompt", "abc", "--tokens", "24", "--temperature", "0",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["texts"][0].startswith("abc") and len(out["texts"][0]) == 27
    assert "defghijkl" in out["texts"][0]  # the cycle it learned
    assert main(["generate", str(tmp_path / "run"), "--prompt", "xyz"]) == 2
    assert "lacks" in capsys.readouterr().err


def test_model_arguments_reach_the_factory_and_unknown_ones_are_named(tmp_path, corpus_file):
    trainer = Trainer(tiny_lm_config(tmp_path, corpus_file, model_args={"layers": 3, "heads": 2, "width": 32}),
                      quiet=True)
    assert len(trainer.model.blocks) == 3 and trainer.model_args["layers"] == 3
    with pytest.raises(GpuaccelError, match="takes no argument.s. depth; it takes: context_length, layers"):
        Trainer(tiny_lm_config(tmp_path, corpus_file, model_args={"depth": 3}), quiet=True)


def test_norms_without_weights_leave_only_the_matrices_and_the_same_forward_at_unit_scale():
    torch.manual_seed(0)
    plain = create_model("gpt", vocab_size=50, context_length=16, layers=2, heads=2, width=16)
    bare = create_model("gpt", vocab_size=50, context_length=16, layers=2, heads=2, width=16, norm_weights=False)
    assert not [n for n, _ in bare.named_parameters() if "norm" in n]
    assert {n for n, p in plain.named_parameters() if p.ndim == 2} == {n for n, _ in bare.named_parameters()}
    bare.load_state_dict({k: v for k, v in plain.state_dict().items() if "norm" not in k})
    idx = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(bare(idx), plain(idx))  # (a fresh RMSNorm's scale is one)


# ------------------------------------------------------------------------------ labelled sentences

def write_sentences(folder, rows, name="train.tsv", header="label\tsentence"):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(header + "\n" + "\n".join(rows) + "\n")


def sentiment_rows(count: int, seed: int, names=("0", "1")) -> list[str]:
    rng = random.Random(seed)
    good, bad, filler = ["good", "great", "fine", "lovely"], ["bad", "awful", "dull", "poor"], \
        ["the", "film", "was", "a", "plot", "and", "story", "'s", "quite"]
    rows = []
    for _ in range(count):
        label = rng.randrange(2)
        words = rng.sample(filler, rng.randint(1, 6)) + [rng.choice(good if label else bad)] + \
            rng.sample(filler, rng.randint(0, 8))
        rows.append(f"{names[label]}\t{' '.join(words)}")
    return rows


def test_an_sst2_style_folder_is_read_with_its_dev_file_and_its_own_column_names(tmp_path):
    write_sentences(tmp_path / "d", sentiment_rows(300, 0))
    write_sentences(tmp_path / "d", sentiment_rows(40, 1), name="dev.tsv", header="label\tcontent")
    (tmp_path / "d" / "test.tsv").write_text("index\tsentence\n0\tno labels here\n")
    data = load_sentences(tmp_path / "d", cache_dir=tmp_path / "cache")
    assert parse_spec(str(tmp_path / "d"))[0] == "sentences"
    assert len(data.train_labels) == 300 and len(data.test_labels) == 40 and data.classes == ["0", "1"]
    assert data.train_ids.shape[1] == max(data.train_lengths.max(), data.test_lengths.max())
    assert data.tokenizer.decode(data.train_ids[0]).split()[0] in {"the", "film", "was", "a", "plot", "and",
                                                                    "story", "'", "quite"}


def test_csv_and_jsonl_with_label_names_and_a_held_out_split(tmp_path):
    rows = sentiment_rows(200, 2, names=("neg", "pos"))
    csv_file = tmp_path / "reviews.csv"
    csv_file.write_text("sentiment,review\n" + "\n".join(f'{r.split(chr(9))[0]},"{r.split(chr(9))[1]}"'
                                                          for r in rows) + "\n")
    data = load_sentences(csv_file, val_split=0.25)
    assert data.classes == ["neg", "pos"] and len(data.test_labels) == 50 and len(data.train_labels) == 150
    jsonl = tmp_path / "reviews.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": r.split("\t")[1], "label": r.split("\t")[0]}) for r in rows))
    assert load_sentences(jsonl).classes == ["neg", "pos"]


@pytest.mark.parametrize("text, options, message", [
    ("", {}, "is empty"),
    ("label\tsentence\n", {}, "header and no rows"),
    ("stars\tsentence\n1\tok\n", {}, "cannot tell which column is the label"),
    ("label\tsentence\n1\tok\n", {"text_column": "body"}, "no text column 'body'; its columns: label, sentence"),
    ("label\tsentence\n0.5\tok\n1\tfine\n", {}, "integers or names, not numbers like '0.5'"),
    ("label\tsentence\n\tok\n", {}, "line 2 has no label"),
])
def test_bad_sentence_files_are_one_line_errors(tmp_path, text, options, message):
    path = tmp_path / "data.tsv"
    path.write_text(text)
    with pytest.raises(GpuaccelError, match=message):
        load_sentences(path, **options)


def test_a_jsonl_null_label_is_a_missing_label_named_by_its_line(tmp_path):
    """JSON null is no label (not a class named "None"), and the line named is the file's line."""
    path = tmp_path / "data.jsonl"
    records = [{"text": f"fine {i}", "label": "pos" if i % 2 else "neg"} for i in range(300)]
    records[150]["label"] = None
    path.write_text("\n".join(json.dumps(r) for r in records[:100]) + "\n\n" +
                    "\n".join(json.dumps(r) for r in records[100:]))  # (a blank line before line 102)
    with pytest.raises(GpuaccelError, match=r"data\.jsonl: line 152 has no label"):
        load_sentences(path)


def test_non_utf8_sentences_name_the_file_and_line(tmp_path):
    path = tmp_path / "data.tsv"
    path.write_bytes(b"label\tsentence\n1\tfine\n0\tna\xefve\n")
    with pytest.raises(GpuaccelError, match="data.tsv: line 3 is not UTF-8"):
        load_sentences(path)


def test_batches_are_cut_to_their_longest_sentence_and_evaluation_sees_each_once(tmp_path):
    write_sentences(tmp_path / "d", sentiment_rows(500, 3))
    data = load_sentences(tmp_path / "d" / "train.tsv", val_split=0.2)
    loader = sentence_loader(data.train_ids, data.train_lengths, data.train_labels, batch_size=16,
                             device=torch.device("cpu"), train=True, seed=1)
    widths = set()
    for ids, labels in loader.batches(0):
        width = ids.shape[1]
        widths.add(width)
        assert width % 8 == 0 or width == data.train_ids.shape[1]
        assert (ids != 0).sum(1).max() > width - 8  # no all-padding columns beyond the rounding
    assert len(widths) > 1
    evaluation = sentence_loader(data.test_ids, data.test_lengths, data.test_labels, batch_size=16,
                                 device=torch.device("cpu"), train=False)
    seen = torch.cat([labels for _, labels in evaluation.batches()])
    assert sorted(seen.tolist()) == sorted(data.test_labels.tolist())


@pytest.mark.parametrize("model", ["bag_of_ngrams", "text_cnn", "text_transformer"])
def test_a_tiny_sentence_classifier_beats_chance_and_infers_as_it_evaluated(tmp_path, model, capsys):
    write_sentences(tmp_path / "d", sentiment_rows(800, 4))
    write_sentences(tmp_path / "d", sentiment_rows(200, 5), name="dev.tsv")
    args = {"bag_of_ngrams": {"width": 32, "buckets": 4096}, "text_cnn": {"width": 32, "filters": 16},
            "text_transformer": {"layers": 1, "heads": 2, "width": 32, "pooling": "mean_max",
                                 "word_dropout": 0.1}}[model]
    summary = Trainer(TrainConfig(data=str(tmp_path / "d"), model=model, model_args=args, optimizer="adamw", lr=1e-2,
                                  weight_decay=0.0, batch_size=32, epochs=3, monitor=False, cache_dir=None,
                                  run_dir=str(tmp_path / "run"), device="cpu"), quiet=True).fit()
    assert summary["task"] == "classification" and summary["sample_unit"] == "sentences"
    assert summary["metrics"]["accuracy"] > 0.9, summary["metrics"]
    # gpuaccel infer: the labelled folder scores as the run's evaluation did; plain lines get labels
    assert main(["infer", str(tmp_path / "run"), str(tmp_path / "d")]) == 0
    err = capsys.readouterr().err
    # (on the GPU when there is one: infer chooses its device as train does)
    assert re.search(r"200 sentences with pytorch on (cpu|cuda(:\d+)?): ", err)
    assert f"accuracy {100 * summary['metrics']['accuracy']:.2f}%" in err
    lines = tmp_path / "lines.txt"
    lines.write_text("the film was lovely and great\n\nthe plot was awful\n")
    assert main(["infer", str(tmp_path / "run"), str(lines), "--out", str(tmp_path / "p.csv")]) == 0
    rows = (tmp_path / "p.csv").read_text().splitlines()
    assert rows[0] == "input,class_1,prob_1" and rows[1].startswith("the film was lovely and great,1,")
    assert rows[2].startswith("the plot was awful,0,") and len(rows) == 3
    if model == "text_transformer":  # export parity: ONNX Runtime against the model, on the dev sentences
        assert main(["export", str(tmp_path / "run"), "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["passed"] and report["sentences"] == 200 and report["max_abs_diff"] < 1e-4
        meta = json.loads(Path(report["artifact"] + ".json").read_text())
        assert meta["classes"] == ["0", "1"] and meta["tokenizer"]["kind"] == "word"
        # the artefact alone (its tokeniser in the .json) labels sentences as the run does
        assert main(["infer", report["artifact"], str(lines), "--out", str(tmp_path / "onnx.csv")]) == 0
        assert (tmp_path / "onnx.csv").read_text().splitlines()[1].split(",")[:2] == rows[1].split(",")[:2]
        assert main(["infer", report["artifact"], str(tmp_path / "d")]) == 0
        assert "200 sentences with onnxruntime on cpu: " in capsys.readouterr().err
        # int8, calibrated on training sentences, from the run and from its artefact
        for source in (str(tmp_path / "run"), report["artifact"]):
            assert main(["quantize", source, "--int8", "--calib", "64", "--json"]) == 0
            quantized = json.loads(capsys.readouterr().out)
            assert quantized["unit"] == "sentences" and quantized["calibration_samples"] == 64
            assert quantized["int8"]["test_accuracy"] > 0.85 and quantized["fp32"]["test_accuracy"] > 0.9
        assert main(["infer", quantized["artifact"], str(lines), "--out", str(tmp_path / "int8.csv")]) == 0
        assert len((tmp_path / "int8.csv").read_text().splitlines()) == 3


def test_infer_reads_sentence_files_a_chunk_at_a_time(tmp_path):
    """Plain sentence files are read as their chunks are used, in order across files: a bad
    line further on stops the reading there, not before the first chunk; a missing file is an
    error before any."""
    from gpuaccel.deploy.text import sentence_chunks

    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"\xef\xbb\xbfone\n\ntwo\nthree\n")  # (a byte order mark, a blank line)
    second.write_bytes(b"four\nfive\nbad \xff\n")
    chunks = sentence_chunks([str(first), str(second)], ["0", "1"], 2)()
    assert next(chunks) == (["one", "two"], None) and next(chunks) == (["three", "four"], None)
    with pytest.raises(GpuaccelError, match="b.txt: line 3 is not UTF-8"):
        next(chunks)
    with pytest.raises(GpuaccelError, match="missing.txt is not a file"):
        sentence_chunks([str(first), str(tmp_path / "missing.txt")], ["0", "1"], 2)


def test_pooling_sees_words_only_and_word_dropout_leaves_every_sentence_a_word():
    from gpuaccel.models.text import masked_pool

    x = torch.tensor([[[1.0, -1.0], [3.0, 5.0], [9.0, 9.0]]])  # the third position is padding
    mask = torch.tensor([[True, True, False]])
    assert masked_pool(x, mask, "mean").tolist() == [[2.0, 2.0]]
    assert masked_pool(x, mask, "max").tolist() == [[3.0, 5.0]]
    assert masked_pool(x, mask, "mean_max").tolist() == [[2.0, 2.0, 3.0, 5.0]]
    model = create_model("text_transformer", vocab_size=10, num_classes=2, layers=1, heads=2, width=8,
                         word_dropout=0.99, pooling="max").train()
    ids = torch.tensor([[3, 4, 0, 0], [5, 0, 0, 0]])
    assert torch.isfinite(model(ids)).all()  # (with every word hidden, attention would give NaN)
    with pytest.raises(GpuaccelError, match="pooling 'sum' is not one of mean, max, mean_max"):
        create_model("text_transformer", vocab_size=10, num_classes=2, pooling="sum")


def test_a_language_model_resumes_on_its_text_and_refuses_changed_text(tmp_path, corpus_file):
    first = Trainer(tiny_lm_config(tmp_path, corpus_file, epochs=1), quiet=True).fit()
    resumed = Trainer.resume(tmp_path / "run", overrides={"epochs": 2}, quiet=True).fit()
    assert resumed["resumed"] and resumed["steps"] == 2 * first["steps"]
    corpus_file.write_text(markov_text(6000, seed=1) + "more text")  # another corpus at the same path
    with pytest.raises(GpuaccelError, match="the data changed since .* began: its vocab size 12 is now 18"):
        Trainer.resume(tmp_path / "run", overrides={"epochs": 3}, quiet=True)


def test_sentences_with_no_model_named_train_the_model_made_for_them(tmp_path, capsys):
    """The default model is an image network; sentence data (as text, recordings, ratings and
    scenes) trains its own kind's model instead of failing inside a convolution."""
    folder = tmp_path / "reviews"
    folder.mkdir()
    rows = "sentence\tlabel\n" + "".join(f"{'a fine' if i % 2 else 'a dull'} film {i}\t{i % 2}\n" for i in range(40))
    (folder / "train.tsv").write_text(rows)
    (folder / "dev.tsv").write_text(rows)
    assert main(["train", "--data", str(folder), "--epochs", "1", "--run-dir", str(tmp_path / "r"), "--json",
                 "--quiet", "--no-monitor"]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "text_transformer"
