"""Time to validation loss 1.47 on tiny Shakespeare (characters), side by side on one GPU:

  (a) a plain PyTorch loop written here with nanoGPT's train_shakespeare_char settings: 6
      layers, 6 heads, 384 wide, context 256, batch 64, dropout 0.2, learned positions,
      LayerNorm, GELU, AdamW (lr 1e-3, betas 0.9/0.99, weight decay 0.1, 100 warm-up steps,
      cosine to 1e-4 over 5000 steps), gradient clipping 1.0, bf16 autocast, torch.compile;
  (b) ``gpuaccel train --recipe shakespeare-char`` (and any ``--variant`` of it), each seed
      its own process.

Both evaluate on the whole validation split (the last 10% of the text, consecutive windows
of 256) every ``--eval-every`` steps (the baseline) or as the recipe says; evaluation time is
not training time. Reported: training time to the first evaluation at or below the target,
tokens per second, and MFU (6 x parameters + 12 x layers x context x width FLOPs per token,
against 989 TFLOP/s, the H100/H200 dense bf16 peak).

    python benchmarks/language_speed/language_speed.py --data tinyshakespeare.txt --seeds 3 --out results.json \\
        [--variant NAME="--batch-size 128 --lr 3e-3" ...] [--no-baseline] [--sst2 DIR [--sst2-variant ...]]

With ``--sst2``, ``gpuaccel train --recipe sst2`` (and each ``--sst2-variant``) also runs per
seed: dev accuracy and training time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

PEAK_FLOPS = 989.4e12  # H100 / H200 SXM, dense bf16


def flops_per_token(parameters: int, layers: int, context: int, width: int) -> float:
    return 6 * parameters + 12 * layers * context * width


# ------------------------------------------------------------------------------ (a) the baseline

class Block(nn.Module):
    def __init__(self, width, heads, dropout):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width, bias=False), nn.LayerNorm(width, bias=False)
        self.qkv, self.out = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.fc, self.proj = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)
        self.heads, self.dropout = heads, dropout
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0)
        x = x + self.drop(self.out(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class BaselineGPT(nn.Module):
    def __init__(self, vocab, context, layers=6, heads=6, width=384, dropout=0.2):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.Sequential(*[Block(width, heads, dropout) for _ in range(layers)])
        self.ln = nn.LayerNorm(width, bias=False)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight
        for name, p in self.named_parameters():
            if p.ndim == 2:
                nn.init.normal_(p, 0, 0.02 / math.sqrt(2 * layers) if name.endswith(("out.weight", "proj.weight"))
                                else 0.02)

    def forward(self, idx):
        x = self.drop(self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device)))
        return self.head(self.ln(self.blocks(x)))


def baseline(text: str, target: float, seed: int, eval_every: int, max_steps: int) -> dict:
    device = torch.device("cuda")
    torch.manual_seed(seed)
    chars = sorted(set(text))
    lookup = {c: i for i, c in enumerate(chars)}
    ids = torch.tensor([lookup[c] for c in text], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    train, val = ids[:cut].to(device), ids[cut:]
    context, batch = 256, 64
    n = (len(val) - 1) // context
    val_x = val[:n * context].view(n, context).to(device)
    val_y = val[1:n * context + 1].view(n, context).to(device)
    model = BaselineGPT(len(chars), context).to(device)
    params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99), fused=True)
    compiled = torch.compile(model)
    offsets = torch.arange(context + 1, device=device)

    def lr_at(step):  # nanoGPT's: linear warm-up over 100 steps, cosine to 1e-4 at 5000
        if step < 100:
            return 1e-3 * (step + 1) / 101
        ratio = min(1.0, (step - 100) / (5000 - 100))
        return 1e-4 + 0.5 * (1 + math.cos(math.pi * ratio)) * (1e-3 - 1e-4)

    def step(i):
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        w = train[torch.randint(len(train) - context - 1, (batch,), device=device)[:, None] + offsets]
        with torch.autocast("cuda", torch.bfloat16):
            loss = F.cross_entropy(compiled(w[:, :-1]).flatten(0, 1), w[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    @torch.no_grad()
    def evaluate():
        compiled.eval()
        total = 0.0
        with torch.autocast("cuda", torch.bfloat16):
            for i in range(0, n, 512):
                total += F.cross_entropy(compiled(val_x[i:i + 512]).flatten(0, 1).float(),
                                         val_y[i:i + 512].flatten(), reduction="sum").item()
        compiled.train()
        return total / (n * context)

    # warm-up: compile the training and evaluation graphs, then restore the initial state
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for i in range(3):
        step(i)
    evaluate()
    model.load_state_dict(state)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99), fused=True)
    torch.manual_seed(seed)
    torch.cuda.synchronize()
    trained, history, reached = 0.0, [], None
    for start in range(0, max_steps, eval_every):
        t0 = time.perf_counter()
        for i in range(start, start + eval_every):
            step(i)
        torch.cuda.synchronize()
        trained += time.perf_counter() - t0
        loss = evaluate()
        history.append({"step": start + eval_every, "train_seconds": round(trained, 3), "val_loss": round(loss, 4)})
        if loss <= target:
            reached = trained
            break
    steps = history[-1]["step"]
    rate = steps * batch * context / trained
    return {"seed": seed, "parameters": params, "steps": steps, "train_seconds": round(trained, 3),
            "time_to_target": None if reached is None else round(reached, 3),
            "best_val_loss": min(h["val_loss"] for h in history), "tokens_per_second": round(rate),
            "mfu": round(rate * flops_per_token(params, 6, context, 384) / PEAK_FLOPS, 4), "history": history}


# ------------------------------------------------------------------------------ (b) gpuaccel

def train(recipe: str, data: str, seed: int, extra: list[str], work: Path) -> tuple[dict, Path, float]:
    """``gpuaccel train --recipe RECIPE`` in its own process: (summary or {"error": ...}, run
    directory, seconds the whole command took)."""
    run_dir = work / f"{recipe}-{seed}-{abs(hash(tuple(extra))) % 10**8}"
    subprocess.run(["rm", "-rf", str(run_dir)])
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "gpuaccel", "train", "--recipe", recipe, "--data", data,
                           "--seed", str(seed), "--run-dir", str(run_dir), "--json", "--no-compile-background",
                           *extra],
                          capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        return {"error": (done.stdout + done.stderr)[-2000:]}, run_dir, seconds
    return json.loads(done.stdout[done.stdout.index("{"):]), run_dir, seconds


def ours(data: str, seed: int, extra: list[str], work: Path) -> dict:
    s, run_dir, command = train("shakespeare-char", data, seed, extra, work)
    if "error" in s:
        return {"seed": seed, **s}
    config = json.loads((run_dir / "config.json").read_text())
    args = {"layers": 6, "width": 384, **(config.get("model_args") or {})}
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"seed": seed, "parameters": s["parameters"], "steps": s["steps"], "train_seconds": s["train_seconds"],
            "time_to_target": s["time_to_target"], "best_val_loss": s["best_metrics"].get("loss"),
            "tokens_per_second": s["tokens_per_second"],
            "mfu": round(s["tokens_per_second"] * flops_per_token(s["parameters"], args["layers"], config["context"],
                                                                  args["width"]) / PEAK_FLOPS, 4),
            "setup_seconds": s["setup_seconds"], "warmup_seconds": s["warmup_seconds"],
            "command_seconds": round(command, 2), "stopped_by": s["stopped_by"],
            "history": [{"step": h["step"], "train_seconds": h["elapsed"], "val_loss": h["loss"]} for h in history]}


def sentences(data: str, seed: int, extra: list[str], work: Path) -> dict:
    """``gpuaccel train --recipe sst2``: dev accuracy and training time of one seed."""
    s, _, command = train("sst2", data, seed, extra, work)
    if "error" in s:
        return {"seed": seed, **s}
    return {"seed": seed, "model": s["model"], "parameters": s["parameters"], "train_seconds": s["train_seconds"],
            "test_accuracy": s["metrics"]["accuracy"], "best_accuracy": s["best_metrics"]["accuracy"],
            "samples_per_second": s["samples_per_second"], "warmup_seconds": s["warmup_seconds"],
            "command_seconds": round(command, 2)}


def summarise(rows: list[dict]) -> dict:
    times = [r["time_to_target"] for r in rows if r.get("time_to_target") is not None]
    ok = [r for r in rows if "error" not in r]
    return {"runs": len(rows), "reached": len(times),
            "time_to_target_median": statistics.median(times) if times else None,
            "time_to_target_range": [min(times), max(times)] if times else None,
            "tokens_per_second_median": statistics.median(r["tokens_per_second"] for r in ok) if ok else None,
            "mfu_median": statistics.median(r["mfu"] for r in ok) if ok else None,
            "best_val_loss_mean": statistics.fmean(r["best_val_loss"] for r in ok) if ok else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="tinyshakespeare.txt")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--baseline-seeds", type=int, default=1)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--eval-every", type=int, default=50, help="baseline: steps between evaluations")
    p.add_argument("--max-steps", type=int, default=4000, help="baseline: give up after this many steps")
    p.add_argument("--target", type=float, default=1.47)
    p.add_argument("--variant", action="append", default=[], metavar='NAME="OPTIONS"',
                   help="also run the recipe with these options (the recipe itself is variant 'recipe')")
    p.add_argument("--only-variants", action="store_true", help="skip the recipe as it is")
    p.add_argument("--sst2", metavar="DIR", help="also train --recipe sst2 on this folder (train.tsv, dev.tsv)")
    p.add_argument("--sst2-variant", action="append", default=[], metavar='NAME="OPTIONS"')
    p.add_argument("--work", default="/tmp/language_speed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "target": args.target,
              "variants": {}}
    variants = ([] if args.only_variants else [("recipe", [])]) + \
        [(v.partition("=")[0], shlex.split(v.partition("=")[2])) for v in args.variant]
    for name, extra in variants:
        rows = [ours(args.data, seed, extra, work) for seed in range(1, args.seeds + 1)]
        result["variants"][name] = {"options": extra, **summarise(rows), "rows": rows}
        print(name, json.dumps({k: v for k, v in result["variants"][name].items() if k != "rows"}), flush=True)
        for r in rows:
            if "error" in r:
                print(r["error"], file=sys.stderr)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.sst2:
        result["sst2"] = {}
        for name, extra in [("recipe", [])] + [(v.partition("=")[0], shlex.split(v.partition("=")[2]))
                                                for v in args.sst2_variant]:
            rows = [sentences(args.sst2, seed, extra, work) for seed in range(1, args.seeds + 1)]
            ok = [r for r in rows if "error" not in r]
            result["sst2"][name] = {
                "options": extra, "rows": rows,
                "test_accuracy_mean": statistics.fmean(r["test_accuracy"] for r in ok) if ok else None,
                "train_seconds_median": statistics.median(r["train_seconds"] for r in ok) if ok else None}
            print("sst2", name, json.dumps({k: v for k, v in result["sst2"][name].items() if k != "rows"}), flush=True)
            for r in rows:
                if "error" in r:
                    print(r["error"], file=sys.stderr)
            Path(args.out).write_text(json.dumps(result, indent=1))
    if not args.no_baseline:
        text = Path(args.data).read_text()
        rows = [baseline(text, args.target, seed, args.eval_every, args.max_steps)
                for seed in range(1, args.baseline_seeds + 1)]
        result["baseline"] = {**summarise(rows), "rows": rows}
        print("baseline", json.dumps({k: v for k, v in result["baseline"].items() if k != "rows"}), flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    if "baseline" in result and "recipe" in result["variants"]:
        ours_t = result["variants"]["recipe"]["time_to_target_median"]
        base_t = result["baseline"]["time_to_target_median"]
        if ours_t and base_t:
            result["speedup"] = round(base_t / ours_t, 2)
            print(f"recipe reaches {args.target} {result['speedup']}x faster than the baseline")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
