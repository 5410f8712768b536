"""The textbook translation loop, written as PyTorch's "Language Translation with nn.Transformer"
tutorial writes it, as the baseline gpuaccel's multi30k recipe is measured against.

``nn.Transformer`` with 3 + 3 layers, 512 wide, 8 heads, feed-forward 512, dropout 0.1; token
embeddings scaled by sqrt(512) plus sinusoidal positions; a separate output layer; Xavier
initialisation; cross-entropy ignoring padding (no label smoothing); Adam at 1e-4 with betas
(0.9, 0.98) and eps 1e-9; shuffled batches of 128 sentence pairs padded to their longest;
float32; greedy decoding. The vocabulary is one joint 8k sentencepiece model trained on the
training split (``tokenizers``' unigram model where sentencepiece is not installed).

    python benchmarks/translation/textbook.py --data multi30k/ --epochs 18 --out textbook.json

After each epoch it decodes the validation and test sources greedily (batched; not counted as
training time) and scores them with sacreBLEU (cased, detokenized, 13a), so the JSON holds BLEU
against seconds of training.
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def read(path: Path) -> list[str]:
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def split_files(folder: Path, split: str, source: str, target: str) -> tuple[list[str], list[str]]:
    def find(lang):
        for name in (f"{split}.{lang}.gz", f"{split}.{lang}"):
            if (folder / name).exists():
                return folder / name
        raise FileNotFoundError(f"{folder}/{split}.{lang}[.gz]")
    return read(find(source)), read(find(target))


class Vocabulary:
    """A joint subword vocabulary of ``size`` pieces: sentencepiece's unigram model, as the tutorial
    family uses, or the same model from HuggingFace tokenizers where sentencepiece is absent."""

    def __init__(self, texts: list[str], size: int):
        try:
            import sentencepiece as spm

            model = io.BytesIO()
            spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=model, vocab_size=size,
                                           pad_id=PAD, unk_id=UNK, bos_id=BOS, eos_id=EOS, model_type="unigram",
                                           character_coverage=1.0, minloglevel=2)
            self.sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
            self.kind = f"sentencepiece {spm.__version__}"
            self.encode = lambda lines: self.sp.encode(lines)
            self.decode = lambda ids: self.sp.decode(ids)
        except ImportError:
            from gpuaccel.data.text import UnigramTokenizer

            tok = UnigramTokenizer.train(texts, size)
            self.kind = "tokenizers unigram"
            self.encode = tok.encode_lines
            self.decode = tok.decode


class PositionalEncoding(nn.Module):
    def __init__(self, width: int, dropout: float, maxlen: int = 5000):
        super().__init__()
        den = torch.exp(-torch.arange(0, width, 2) * math.log(10000) / width)
        pos = torch.arange(0, maxlen).reshape(maxlen, 1)
        table = torch.zeros((maxlen, width))
        table[:, 0::2] = torch.sin(pos * den)
        table[:, 1::2] = torch.cos(pos * den)
        self.dropout = nn.Dropout(dropout)
        self.register_buffer("table", table.unsqueeze(-2))

    def forward(self, x):
        return self.dropout(x + self.table[:x.size(0), :])


class TokenEmbedding(nn.Module):
    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.embedding, self.width = nn.Embedding(vocab, width), width

    def forward(self, tokens):
        return self.embedding(tokens.long()) * math.sqrt(self.width)


class Seq2SeqTransformer(nn.Module):
    def __init__(self, vocab: int, layers: int = 3, width: int = 512, heads: int = 8, ffn: int = 512,
                 dropout: float = 0.1):
        super().__init__()
        self.transformer = nn.Transformer(d_model=width, nhead=heads, num_encoder_layers=layers,
                                          num_decoder_layers=layers, dim_feedforward=ffn, dropout=dropout)
        self.generator = nn.Linear(width, vocab)
        self.src_tok_emb, self.tgt_tok_emb = TokenEmbedding(vocab, width), TokenEmbedding(vocab, width)
        self.positional_encoding = PositionalEncoding(width, dropout)

    def forward(self, src, tgt, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, memory_key_padding_mask):
        src_emb = self.positional_encoding(self.src_tok_emb(src))
        tgt_emb = self.positional_encoding(self.tgt_tok_emb(tgt))
        outs = self.transformer(src_emb, tgt_emb, src_mask, tgt_mask, None, src_padding_mask, tgt_padding_mask,
                                memory_key_padding_mask)
        return self.generator(outs)

    def encode(self, src, src_mask, src_padding_mask):
        return self.transformer.encoder(self.positional_encoding(self.src_tok_emb(src)), src_mask, src_padding_mask)

    def decode(self, tgt, memory, tgt_mask, memory_key_padding_mask):
        return self.transformer.decoder(self.positional_encoding(self.tgt_tok_emb(tgt)), memory, tgt_mask,
                                        memory_key_padding_mask=memory_key_padding_mask)


def square_subsequent_mask(size: int, device) -> torch.Tensor:
    mask = (torch.triu(torch.ones((size, size), device=device)) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, 0.0)


def create_mask(src, tgt, device):
    src_len, tgt_len = src.shape[0], tgt.shape[0]
    tgt_mask = square_subsequent_mask(tgt_len, device)
    src_mask = torch.zeros((src_len, src_len), device=device).type(torch.bool)
    return src_mask, tgt_mask, (src == PAD).transpose(0, 1), (tgt == PAD).transpose(0, 1)


def pad_batch(rows: list[list[int]]) -> torch.Tensor:
    """(length, batch) token ids, as the tutorial's collate function makes them (pad_sequence)."""
    return nn.utils.rnn.pad_sequence([torch.tensor(r) for r in rows], padding_value=PAD)


@torch.no_grad()
def greedy(model, sources: list[list[int]], device, batch: int = 256, extra: int = 5) -> list[list[int]]:
    """Greedy decoding, batched (the tutorial decodes one sentence at a time; batching only speeds it
    up): up to source length + ``extra`` tokens, as the tutorial allows."""
    model.eval()
    out: list[list[int]] = [[] for _ in sources]
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        src = pad_batch([[BOS, *sources[i], EOS] for i in idx]).to(device)
        src_mask = torch.zeros((src.shape[0], src.shape[0]), device=device).type(torch.bool)
        memory = model.encode(src, src_mask, (src == PAD).transpose(0, 1))
        ys = torch.full((1, len(idx)), BOS, dtype=torch.long, device=device)
        done = torch.zeros(len(idx), dtype=torch.bool, device=device)
        for _ in range(src.shape[0] + extra - 1):
            tgt_mask = square_subsequent_mask(ys.size(0), device).type(torch.bool)
            hidden = model.decode(ys, memory, tgt_mask, (src == PAD).transpose(0, 1))
            word = model.generator(hidden[-1]).argmax(-1)
            word = torch.where(done, torch.full_like(word, PAD), word)
            ys = torch.cat([ys, word[None]], 0)
            done |= word == EOS
            if bool(done.all()):
                break
        for row, i in enumerate(idx):
            ids = []
            for t in ys[1:, row].tolist():
                if t in (EOS, PAD):
                    break
                ids.append(t)
            out[i] = ids
    model.train()
    return out


def bleu(hypotheses: list[str], references: list[str]) -> float:
    import sacrebleu

    return sacrebleu.metrics.BLEU().corpus_score(hypotheses, [references]).score


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--source-lang", default="de")
    ap.add_argument("--target-lang", default="en")
    ap.add_argument("--test", default="test_2016_flickr")
    ap.add_argument("--epochs", type=int, default=18)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    folder = Path(args.data)
    train_src, train_tgt = split_files(folder, "train", args.source_lang, args.target_lang)
    pairs = [(s, t) for s, t in zip(train_src, train_tgt) if s.strip() and t.strip()]
    vocab = Vocabulary([s for s, _ in pairs] + [t for _, t in pairs], args.vocab_size)
    src_ids, tgt_ids = vocab.encode([s for s, _ in pairs]), vocab.encode([t for _, t in pairs])
    evals = {}
    for split in ("val", args.test):
        s, t = split_files(folder, split, args.source_lang, args.target_lang)
        evals[split] = (vocab.encode(s), t)
    model = Seq2SeqTransformer(args.vocab_size).to(device)
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.xavier_uniform_(p)
    loss_fn = nn.CrossEntropyLoss(ignore_index=PAD)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    generator = torch.Generator().manual_seed(args.seed)
    curve, trained = [], 0.0
    for epoch in range(1, args.epochs + 1):
        model.train()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        order = torch.randperm(len(pairs), generator=generator).tolist()
        for b in range(0, len(order), args.batch_size):
            idx = order[b:b + args.batch_size]
            src = pad_batch([[BOS, *src_ids[i], EOS] for i in idx]).to(device)
            tgt = pad_batch([[BOS, *tgt_ids[i], EOS] for i in idx]).to(device)
            tgt_input = tgt[:-1, :]
            src_mask, tgt_mask, src_padding_mask, tgt_padding_mask = create_mask(src, tgt_input, device)
            logits = model(src, tgt_input, src_mask, tgt_mask, src_padding_mask, tgt_padding_mask, src_padding_mask)
            optimizer.zero_grad()
            loss = loss_fn(logits.reshape(-1, logits.shape[-1]), tgt[1:, :].reshape(-1))
            loss.backward()
            optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        trained += time.perf_counter() - start
        record = {"epoch": epoch, "train_seconds": round(trained, 3), "train_loss": round(loss.item(), 4)}
        for split, (sources, references) in evals.items():
            hypotheses = [vocab.decode(ids) for ids in greedy(model, sources, device)]
            record[f"{split}_bleu"] = round(bleu(hypotheses, references), 2)
        curve.append(record)
        print(json.dumps(record), flush=True)
    result = {"loop": "textbook nn.Transformer (PyTorch tutorial)", "vocabulary": vocab.kind,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "direction": f"{args.source_lang}-{args.target_lang}", "epochs": args.epochs, "curve": curve}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
