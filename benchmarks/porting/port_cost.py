"""What a plain port costs a launch-bound loop, part by part, in one process.

word_language_model's step at its own shapes (a 2-layer LSTM of 200 units, batch 20, 35 tokens,
gradient clipping, the script's hand-written SGD update and ``loss.item()`` every step) is timed
in rounds of each variant, the variants' order rotated from round to round, in one process, so
that the host's drift between processes and between minutes cancels out of each round's ratios:

- ``plain``: the script as written (fp32, cuBLAS without TF32);
- ``sampler``: plain, with the GPU sampler ``Accelerator(monitor=True)`` starts (NVML, ten reads
  a second) running;
- ``plain_tf32``: plain, with cuBLAS's TF32 matrix multiplies (what ``precision="auto"`` turns on
  for a model with recurrent layers);
- ``port``: the plain port as ``benchmarks/porting/word_language_model/port.diff`` writes it: the
  model through ``Accelerator().prepare``, the forward pass inside ``acc.autocast()``,
  ``acc.backward(loss)``, TF32 on and the sampler running;
- ``port_fp32``: the port with TF32 off (``port_fp32.diff``'s numerics), the sampler running.

Every variant trains the same model object; each round's ratio is a variant's rate over
``plain``'s in that round.

    python benchmarks/porting/port_cost.py --rounds 16 --steps 300 --out port_cost.json
    python benchmarks/porting/port_cost.py --variants plain sampler --rounds 8 --steps 400   # the sampler alone

Rounds of hundreds of steps resolve little on a host whose step time drifts by 10-20% from one
second to the next. ``--step-pairs N`` times the plain step and the port's step alternately, step
by step (each step ends with ``loss.item()``, so its wall time is its own), and the sampler in
short blocks on and off; each pair's ratio then sees the same host:

    python benchmarks/porting/port_cost.py --step-pairs 10000 --block 25 --out port_steps.json
    python benchmarks/porting/port_cost.py --step-pairs 10000 --block 25 --step-variant port_fp32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpuaccel import Accelerator
from gpuaccel.monitor.gpu import GpuSampler
from ratio_stats import interval95, median_interval95  # (this folder)

VARIANTS = ("plain", "sampler", "plain_tf32", "port", "port_fp32")


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


def train_step(model, inputs, targets, hidden, autocast=contextlib.nullcontext, backward=torch.Tensor.backward):
    """One step of the script's training loop, its ``loss.item()`` included; the new hidden state."""
    hidden = tuple(h.detach() for h in hidden) if hidden is not None else None
    model.zero_grad()
    with autocast():
        output, hidden = model(inputs, hidden)
    loss = F.nll_loss(output.view(-1, model.decoder.out_features), targets.view(-1))
    backward(loss)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    for p in model.parameters():
        p.data.add_(p.grad, alpha=-20.0)
    loss.item()
    return hidden


def steps_per_second(model, tokens: torch.Tensor, steps: int, autocast=contextlib.nullcontext,
                     backward=torch.Tensor.backward) -> float:
    """The script's training loop over ``steps`` batches of ``tokens`` (steps + 1, 35, batch)."""
    hidden = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(steps):
        hidden = train_step(model, tokens[i], tokens[i + 1], hidden, autocast, backward)
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - start)


def timed_round(variant: str, model, acc: Accelerator, tokens, steps: int) -> tuple[float, int]:
    """One variant's rate, and how many GPU samples its sampler took (0 without one)."""
    torch.backends.cuda.matmul.allow_tf32 = variant in ("plain_tf32", "port")
    sampler = GpuSampler(None, [torch.cuda.current_device()]) if variant in ("sampler", "port", "port_fp32") \
        else None
    if sampler is not None:
        sampler.start()
    if variant.startswith("port"):
        rate = steps_per_second(model, tokens, steps, acc.autocast, acc.backward)
    else:
        rate = steps_per_second(model, tokens, steps)
    if sampler is not None:
        sampler.stop()
    return rate, len(sampler.samples) if sampler is not None else 0


def step_by_step(model, acc: Accelerator, tokens, pairs: int, block: int, port_tf32: bool = True) -> dict:
    """The plain step and the port's step alternating step by step (which goes first swaps every
    pair), each step timed on its own (it ends with ``loss.item()``, which waits for the GPU); the
    GPU sampler runs in half the blocks of ``block`` pairs (off, on, on, off, ...), as it runs for a
    whole process. The port's cost per step is each pair's ratio; the sampler's, each pair of
    blocks' ratio of median step times (plain's and port's summed), so short blocks keep the host's
    drift out of it. ``port_tf32=False``: the port's step without TF32 (``port_fp32``)."""
    variants = {"plain": (False, contextlib.nullcontext, torch.Tensor.backward),
                "port": (port_tf32, acc.autocast, acc.backward)}
    batches, hidden, index = tokens.shape[0] - 1, None, 0
    ratios, block_medians = [], []
    for block_index in range(2 * math.ceil(pairs / block / 2)):
        sampler = GpuSampler(None, [torch.cuda.current_device()]) if block_index % 4 in (1, 2) else None
        if sampler is not None:
            sampler.start()
        seconds = {"plain": [], "port": []}
        for pair in range(block):
            for name in ("plain", "port") if pair % 2 == 0 else ("port", "plain"):
                tf32, autocast, backward = variants[name]
                torch.backends.cuda.matmul.allow_tf32 = tf32
                start = time.perf_counter()
                hidden = train_step(model, tokens[index % batches], tokens[index % batches + 1], hidden,
                                    autocast, backward)
                seconds[name].append(time.perf_counter() - start)
                index += 1
            ratios.append(seconds["port"][-1] / seconds["plain"][-1])
        if sampler is not None:
            sampler.stop()
        block_medians.append({"sampler": sampler is not None,
                              **{name: statistics.median(values) for name, values in seconds.items()}})
    sampler_ratios = [(on["plain"] + on["port"]) / (off["plain"] + off["port"])
                      for first, second in zip(block_medians[::2], block_medians[1::2])
                      for off, on in [(second, first) if first["sampler"] else (first, second)]]
    return {"pairs": len(ratios), "block": block,
            "port_over_plain_per_step": {"median": round(statistics.median(ratios), 4),
                                         "median_95_interval": median_interval95(ratios),
                                         "geometric_mean": round(math.exp(statistics.fmean(map(math.log, ratios))), 4)},
            "sampler_over_none_per_block_pair": {"median": round(statistics.median(sampler_ratios), 4),
                                                 "median_95_interval": median_interval95(sampler_ratios),
                                                 "mean": round(statistics.fmean(sampler_ratios), 4),
                                                 "mean_95_interval": interval95(sampler_ratios)},
            "step_ms_median": {name: round(1e3 * statistics.median(b[name] for b in block_medians), 4)
                               for name in variants},
            "blocks": [{k: round(1e3 * v, 4) if k != "sampler" else v for k, v in b.items()} for b in block_medians]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                    help="plain is always timed (the ratios' denominator)")
    ap.add_argument("--rounds", type=int, default=16, help="rounds of every variant, the order rotated")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--vocab", type=int, default=25671, help="tiny Shakespeare's words, as the script reads them")
    ap.add_argument("--step-pairs", type=int, default=0,
                    help="time plain and port step by step, alternating, this many pairs (instead of rounds)")
    ap.add_argument("--block", type=int, default=25, help="with --step-pairs: pairs per sampler on/off block")
    ap.add_argument("--step-variant", choices=("port", "port_fp32"), default="port",
                    help="with --step-pairs: the port's step as shipped (TF32) or forced to fp32")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    variants = ["plain", *[v for v in args.variants if v != "plain"]]
    torch.manual_seed(0)
    # the model and batches as the port has them; monitor=False: the rounds that need the sampler start their own
    acc = Accelerator(monitor=False)
    model = acc.prepare(LstmLanguageModel(args.vocab))
    tokens = torch.randint(args.vocab, (max(args.steps, 50) + 1, 35, 20), device=acc.device)
    for variant in variants:  # cuDNN's and cuBLAS's first calls in each setting, the allocator's pools
        timed_round(variant, model, acc, tokens, 50)
    if args.step_pairs:
        summary = step_by_step(model, acc, tokens, args.step_pairs, args.block, args.step_variant == "port")
        write_result(args, {"step_by_step": summary})
        return
    rows = []
    for round_ in range(args.rounds):
        shift = round_ % len(variants)
        for variant in variants[shift:] + variants[:shift]:
            rate, samples = timed_round(variant, model, acc, tokens, args.steps)
            rows.append({"round": round_, "variant": variant, "steps_per_second": round(rate, 2),
                         "gpu_samples": samples})
            print(json.dumps(rows[-1]), flush=True)
    rate = {(r["round"], r["variant"]): r["steps_per_second"] for r in rows}
    summary = {}
    for variant in variants[1:]:
        ratios = [rate[k, variant] / rate[k, "plain"] for k in range(args.rounds)]
        summary[variant] = {"over_plain_by_round": [round(r, 4) for r in ratios],
                            "median": round(statistics.median(ratios), 4),
                            "mean": round(statistics.fmean(ratios), 4), "mean_95_interval": interval95(ratios)}
    summary["plain_steps_per_second_median"] = round(statistics.median(rate[k, "plain"] for k in range(args.rounds)), 2)
    write_result(args, {"rows": rows, "summary": summary})


def write_result(args, measured: dict) -> None:
    summary = measured.get("summary", measured.get("step_by_step"))
    print(json.dumps({k: v for k, v in summary.items() if k != "blocks"}), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": datetime.now(timezone.utc).strftime("%Y-%m-%d"),
              "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "vocab": args.vocab, **measured}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
