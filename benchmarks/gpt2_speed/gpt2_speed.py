"""GPT-2 small's shape trained by nanoGPT's own ``train.py`` and by ``gpuaccel train --recipe
gpt2-small``, side by side on one GPU, on the same token ids, for the same number of steps.

    PYTHONPATH=src python benchmarks/gpt2_speed/gpt2_speed.py --data tinyshakespeare.txt --nanogpt NANOGPT \\
        --tokenizer bpe --steps 300 --out gpt2_speed.json [--variant NAME="--model-args ..."]

A variant whose options start with ``@SCRIPT`` runs that script with the command's arguments in
place of ``python -m gpuaccel`` (``fp8_linear.py``: the recipe's model with FP8 linear layers).
``--eval-every N`` evaluates the gpuaccel runs every N steps too, each evaluation's training and
validation loss in the JSON (not counted as training time).

``NANOGPT``: a checkout of github.com/karpathy/nanoGPT (its train.py, model.py and
configurator.py are copied into the work folder and run as published). Both read the token ids
that gpuaccel's corpus reader makes (``--tokenizer char`` or ``bpe``: a byte-level BPE
vocabulary learned from the training split), nanoGPT through the ``train.bin`` / ``val.bin`` /
``meta.pkl`` its data folders hold. The shape: 12 layers, 12 heads, 768 wide, context 1024,
batch 16, bf16, no dropout, AdamW 6e-4 (betas 0.9/0.95, weight decay 0.1, clipping 1.0), a
tenth of the steps warming up, cosine decay over the rest; nanoGPT with ``compile=True``.

Reported per run: tokens/s over the steps after the first ``--skip`` (nanoGPT: from the times
its log lines arrive, each printed after a loss read that waits for the GPU; gpuaccel: its
summary's, training time only), MFU (6 x the matrices' parameters + 12 x layers x context x
width FLOPs per token, nanoGPT's own count, against 989.4 TFLOP/s dense bf16), and the
validation loss after the last step (nanoGPT: its estimate over ``--eval-iters`` random
batches; gpuaccel: every validation window), the whole command's seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

PEAK_FLOPS = 989.4e12  # H100 / H200 SXM, dense bf16
LAYERS, HEADS, WIDTH, CONTEXT, BATCH = 12, 12, 768, 1024, 16
NANOGPT_FILES = ("train.py", "model.py", "configurator.py")


def flops_per_token(vocab: int) -> float:
    matrices = 12 * LAYERS * WIDTH * WIDTH + vocab * WIDTH
    return 6 * matrices + 12 * LAYERS * CONTEXT * WIDTH


def read_tokens(data: str, tokenizer: str, vocab_size: int, cache: Path):
    from gpuaccel.data.text import load_corpus

    return load_corpus(Path(data), tokenizer=tokenizer, vocab_size=vocab_size, cache_dir=cache)


def nanogpt(source: Path, corpus, steps: int, skip: int, eval_iters: int, work: Path) -> dict:
    """nanoGPT's train.py on ``corpus``'s ids, run as published with the shape above."""
    folder = work / "nanogpt"
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data" / "bench").mkdir(parents=True)
    for name in NANOGPT_FILES:
        shutil.copy(source / name, folder / name)
    corpus.train.astype(np.uint16).tofile(folder / "data" / "bench" / "train.bin")
    corpus.val.astype(np.uint16).tofile(folder / "data" / "bench" / "val.bin")
    with open(folder / "data" / "bench" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": corpus.vocab_size}, f)
    overrides = dict(dataset="bench", out_dir=str(folder / "out"), n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH,
                     block_size=CONTEXT, batch_size=BATCH, gradient_accumulation_steps=1, dropout=0.0,
                     bias=False, compile=True, dtype="bfloat16", max_iters=steps, lr_decay_iters=steps,
                     warmup_iters=steps // 10, learning_rate=6e-4, min_lr=6e-5, eval_interval=steps,
                     eval_iters=eval_iters, log_interval=10, always_save_checkpoint=False)
    command = [sys.executable, "train.py", *(f"--{k}={v}" for k, v in overrides.items())]
    start = time.perf_counter()
    arrivals, lines = {}, []
    with subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as p:
        for line in p.stdout:
            lines.append(line.rstrip())
            if line.startswith("iter "):
                arrivals[int(line.split()[1].rstrip(":"))] = time.perf_counter()
    seconds = time.perf_counter() - start
    val = [float(x.split("val loss")[1]) for x in lines if x.startswith(f"step {steps}:")]
    logged = sorted(i for i in arrivals if skip <= i < steps)
    if p.returncode or not val or len(logged) < 2:
        return {"error": "\n".join(lines[-30:])}
    first, last = logged[0], logged[-1]
    rate = (last - first) * BATCH * CONTEXT / (arrivals[last] - arrivals[first])
    return {"steps": steps, "tokens_per_second": round(rate),
            "ms_per_step": round(1000 * BATCH * CONTEXT / rate, 2),
            "mfu": round(rate * flops_per_token(corpus.vocab_size) / PEAK_FLOPS, 4), "val_loss": val[0],
            "command_seconds": round(seconds, 1), "timed_steps": [first, last]}


def gpuaccel(data: str, tokenizer: str, corpus, steps: int, eval_every: int, extra: list[str], work: Path) -> dict:
    """``gpuaccel train --recipe gpt2-small`` for ``steps`` steps, evaluated every ``eval_every``
    steps and at the end (the evaluations' time is not training time)."""
    per_epoch = ((len(corpus.train) - 1) // CONTEXT) // BATCH
    epochs = (steps - 0.5) / per_epoch  # (the loop runs ceil(epochs x steps per epoch) steps)
    run_dir = work / "gpuaccel-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    # (options starting with @SCRIPT: that script takes the command's arguments instead of gpuaccel's CLI)
    script = extra[0][1:] if extra and extra[0].startswith("@") else None
    entry, extra = ([script], extra[1:]) if script else (["-m", "gpuaccel"], extra)
    command = [sys.executable, *entry, "train", "--recipe", "gpt2-small", "--data", data,
               "--tokenizer", tokenizer, "--epochs", f"{epochs:.6f}", "--warmup-epochs", f"{epochs / 10:.6f}",
               "--eval-every", str(eval_every), "--run-dir", str(run_dir), "--cache-dir", str(work / "cache"),
               "--json", "--no-compile-background", *extra]  # (the compiled speed, on a cold cache too)
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        return {"error": (done.stdout + done.stderr)[-3000:]}
    s = json.loads(done.stdout[done.stdout.index("{"):])
    rate = s["tokens_per_second"]
    return {"steps": s["steps"], "tokens_per_second": rate, "ms_per_step": round(1000 * BATCH * CONTEXT / rate, 2),
            "mfu": round(rate * flops_per_token(corpus.vocab_size) / PEAK_FLOPS, 4),
            "val_loss": s["metrics"]["loss"], "command_seconds": round(seconds, 1),
            "warmup_seconds": s["warmup_seconds"], "train_seconds": s["train_seconds"],
            "evaluations": [{"step": r["step"], "val_loss": round(r["loss"], 4),
                             "train_loss": None if r["train_loss"] is None else round(r["train_loss"], 4)}
                            for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a text corpus, e.g. tinyshakespeare.txt")
    p.add_argument("--nanogpt", required=True, help="a checkout of karpathy/nanoGPT")
    p.add_argument("--tokenizer", choices=("char", "bpe"), default="bpe")
    p.add_argument("--vocab-size", type=int, default=50257, help="bpe: the most tokens to learn")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="steps left out of the tokens/s (compiling, settling)")
    p.add_argument("--eval-iters", type=int, default=20, help="nanoGPT: batches in its validation estimate")
    p.add_argument("--eval-every", type=int, help="gpuaccel: evaluate every this many steps too (default: at the end)")
    p.add_argument("--repeats", type=int, default=1, help="each run this many times, alternated")
    p.add_argument("--variant", action="append", default=[], metavar='NAME="OPTIONS"',
                   help="also run gpuaccel with these options (the recipe itself is variant 'recipe')")
    p.add_argument("--no-nanogpt", action="store_true")
    p.add_argument("--work", default="/tmp/gpt2_speed")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = read_tokens(args.data, args.tokenizer, args.vocab_size, work / "cache")
    result = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "command": " ".join(sys.argv),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "tokenizer": args.tokenizer,
              "vocab_size": corpus.vocab_size, "train_tokens": len(corpus.train), "val_tokens": len(corpus.val),
              "steps": args.steps, "shape": {"layers": LAYERS, "heads": HEADS, "width": WIDTH, "context": CONTEXT,
                                             "batch": BATCH}, "runs": {}}
    runs = [] if args.no_nanogpt else [("nanogpt", None)]
    runs += [("recipe", [])] + [(v.partition("=")[0], shlex.split(v.partition("=")[2])) for v in args.variant]
    eval_every = args.eval_every or args.steps
    for _ in range(args.repeats):
        for name, extra in runs:
            if extra is None:
                row = nanogpt(Path(args.nanogpt), corpus, args.steps, args.skip, args.eval_iters, work)
            else:
                row = {"options": extra,
                       **gpuaccel(args.data, args.tokenizer, corpus, args.steps, eval_every, extra, work)}
            result["runs"].setdefault(name, []).append(row)
            print(name, json.dumps(row)[:3000], flush=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    base = [r["tokens_per_second"] for r in result["runs"].get("nanogpt", []) if "tokens_per_second" in r]
    for name, rows in result["runs"].items():
        rates = [r["tokens_per_second"] for r in rows if "tokens_per_second" in r]
        if rates and base:
            result.setdefault("speedup_over_nanogpt", {})[name] = round(statistics.median(rates) /
                                                                        statistics.median(base), 3)
    print(json.dumps(result.get("speedup_over_nanogpt")))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
