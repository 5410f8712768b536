"""DLRM through `gpuaccel.Trainer` on one process of a data-parallel run (or alone): synthetic
click records shaped like Criteo's (13 dense features, 26 ids drawn with a heavy head from
MLPerf's table sizes capped at --max-rows), --batch records per process per step, --steps
steps whatever the number of processes (weak scaling), the whole step as one CUDA graph with
the tables sharded across the processes (whole tables each), their all-to-alls inside it
(models/dlrm.py). Rank 0 prints the
run's summary as one JSON line; its ``held_out`` holds the loss on records the run never trained
on beside the floor the true click probabilities give and a constant prediction's loss (the
labels are drawn from a fixed function of the features: recsys_throughput.click_logits).

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        benchmarks/scaling/dlrm_trainer.py --run-dir DIR [--batch 16384 --steps 200 --epoch-steps 50 --max-rows 2000000 --exchange-chunks K --profile]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recsys_throughput"))
from recsys_throughput import CRITEO_SIZES, label_losses, synthetic_batches  # noqa: E402

import gpuaccel  # noqa: E402
from gpuaccel.models import create_model  # noqa: E402
from gpuaccel.tasks import CustomTask  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--batch", type=int, default=16384, help="records per process per step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--epoch-steps", type=int, default=50,
                    help="steps' worth of records generated, seen steps / epoch-steps times (50: a short set-up; "
                         "--epoch-steps equal to --steps sees each record once, so that the held-out loss "
                         "measures learning rather than memorising)")
    ap.add_argument("--max-rows", type=int, default=2_000_000)
    ap.add_argument("--exchange-chunks", type=int, default=None,
                    help="the chunks of records each all-to-all of rows and gradients is sent in "
                         "(default: the model's choice, 4 on 4 or more GPUs, else 1; models/dlrm.py)")
    ap.add_argument("--profile", action="store_true",
                    help="rank 0 writes a torch.profiler trace of steps 6-12 and its costliest kernels "
                         "(RUN_DIR/profile/trace.json, ops.txt)")
    args = ap.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sizes = [min(n, args.max_rows) for n in CRITEO_SIZES]
    records = synthetic_batches(sizes, args.batch * world, args.epoch_steps, "cpu")
    train = tuple(torch.cat([b[k] for b in records]) for k in range(3))
    held = synthetic_batches(sizes, args.batch, 1, "cpu", seed=1)[0]
    config = gpuaccel.TrainConfig(
        batch_size=args.batch, eval_batch_size=args.batch, epochs=args.steps / args.epoch_steps, optimizer="adamw",
        lr=1e-3, weight_decay=0.0, schedule="constant", warmup_epochs=0.0, compile=True,
        compile_mode="reduce-overhead", eval_every=10 ** 9, monitor=False, checkpoint_seconds=10 ** 9,
        checkpoint_epochs=0, run_dir=args.run_dir, profile=args.profile)
    torch.manual_seed(0)
    model = create_model("dlrm", table_sizes=sizes, exchange_chunks=args.exchange_chunks, required=())
    task = CustomTask(lambda out, y: F.binary_cross_entropy_with_logits(out.float(), y))
    trainer = gpuaccel.Trainer(config, model=model, train_data=train, eval_data=held, task=task, quiet=True)
    summary = trainer.fit()
    if trainer.dist.rank == 0:
        summary["held_out"] = {"loss": summary["metrics"]["loss"], **label_losses(*held)}
        print("SUMMARY " + json.dumps(summary), flush=True)
    trainer.dist.close()


if __name__ == "__main__":
    main()
