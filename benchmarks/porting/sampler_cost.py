"""What the Accelerator's GPU sampler costs a launch-bound loop.

``Accelerator(monitor=True)`` (the default) starts a thread that reads the GPU's utilisation,
memory, power, temperature and clock through NVML ten times a second, for ``acc.stats()``. A
loop whose speed is the host's (Python launching small kernels, a ``.item()`` every step) shares
the interpreter with that thread. This times word_language_model's step at its own shapes (a
2-layer LSTM of 200 units, batch 20, 35 tokens, gradient clipping, the script's hand-written
SGD update and ``loss.item()`` every step) in rounds, alternately with and without the sampler
running, in one process; each pair of rounds gives a ratio.

    python benchmarks/porting/sampler_cost.py --rounds 10 --steps 400 --out sampler_cost.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpuaccel.monitor.gpu import GpuSampler


class LstmLanguageModel(nn.Module):
    """word_language_model's RNNModel('LSTM'), untied, with its defaults."""

    def __init__(self, vocab: int, width: int = 200, layers: int = 2, dropout: float = 0.2):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, layers, dropout=dropout)
        self.decoder = nn.Linear(width, vocab)

    def forward(self, tokens, hidden):
        output, hidden = self.rnn(self.drop(self.encoder(tokens)), hidden)
        return F.log_softmax(self.decoder(self.drop(output)), dim=-1), hidden


def steps_per_second(model, steps: int, vocab: int, device) -> float:
    tokens = torch.randint(vocab, (steps + 1, 35, 20), device=device)
    hidden = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        hidden = tuple(h.detach() for h in hidden) if hidden is not None else None
        model.zero_grad()
        output, hidden = model(tokens[i], hidden)
        loss = F.nll_loss(output.view(-1, vocab), tokens[i + 1].view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-20.0)
        loss.item()
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10, help="rounds of each kind, alternated")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--vocab", type=int, default=10000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(0)
    model = LstmLanguageModel(args.vocab).to(device)
    steps_per_second(model, 50, args.vocab, device)  # cuDNN's and the allocator's first calls
    rows = []
    for round_ in range(args.rounds):
        for sampled in ((False, True) if round_ % 2 == 0 else (True, False)):
            sampler = GpuSampler(None, [torch.cuda.current_device()]) if sampled else None
            if sampler is not None:
                sampler.start()
            rate = steps_per_second(model, args.steps, args.vocab, device)
            if sampler is not None:
                sampler.stop()
            rows.append({"round": round_, "sampler": sampled, "steps_per_second": round(rate, 1),
                         "samples": len(sampler.samples) if sampler is not None else 0})
            print(json.dumps(rows[-1]), flush=True)
    ratios = [next(r["steps_per_second"] for r in rows if r["round"] == k and r["sampler"]) /
              next(r["steps_per_second"] for r in rows if r["round"] == k and not r["sampler"])
              for k in range(args.rounds)]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "rows": rows,
              "with_sampler_vs_without": [round(r, 4) for r in ratios],
              "median_ratio": round(statistics.median(ratios), 4)}
    print(json.dumps({k: result[k] for k in ("with_sampler_vs_without", "median_ratio")}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
