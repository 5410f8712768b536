"""GPT-2 small's training step in bf16 against torchao's float8 training, in one process on one GPU.

The model is gpuaccel's ``gpt`` at the gpt2-small recipe's shape (12 layers x 768, context 1024,
16 windows, the BPE vocabulary of tiny Shakespeare padded to 64: 20,352 rows; ``--vocab``), under
bf16 autocast, compiled, with fused AdamW. The float8 variants convert every linear layer
(``torchao.float8.convert_to_float8_training``) before compiling, with torchao's recipes
(``tensorwise``: one scale per tensor; ``rowwise``: one per row); ``--skip-head`` keeps the output
layer (tied to the embedding) in bf16. Each variant trains ``--steps`` steps on the same random
token windows after ``--warmup`` steps (the compile), timed by CUDA events; the loss after the
steps shows the numerics stay close (random tokens: the loss falls toward log(vocabulary)).

    PYTHONPATH=src python benchmarks/gpt2_speed/fp8_training.py --out fp8_training.json

torchao is not a gpuaccel dependency; this measures whether it should become an optional one.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from datetime import datetime, timezone

import torch
import torch.nn as nn
import torch.nn.functional as F

from gpuaccel.models import create_model


def float8_model(model: nn.Module, recipe: str, skip_head: bool) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    def chosen(module: nn.Module, name: str) -> bool:
        if skip_head and name == "head":
            return False
        return module.in_features % 16 == 0 and module.out_features % 16 == 0

    config = Float8LinearConfig.from_recipe_name(recipe)
    return convert_to_float8_training(model, config=config, module_filter_fn=chosen)


def run(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], warmup: int) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    compiled = torch.compile(model)

    def step(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(compiled(x).flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    for x, y in batches[:warmup]:
        step(x, y)
    times, losses = [], []
    for x, y in batches[warmup:]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(x, y)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
        losses.append(loss.item())
    tokens = batches[0][0].numel()
    median = statistics.median(times)
    return {"step_ms_median": round(median, 3), "step_ms_min": round(min(times), 3),
            "step_ms_max": round(max(times), 3), "tokens_per_second": round(tokens / median * 1000),
            "loss_last": round(statistics.mean(losses[-10:]), 4), "peak_memory_gib":
            round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=20352)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--variants", nargs="+", default=["bf16", "tensorwise", "rowwise", "tensorwise-skip-head"])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    base = create_model("gpt", vocab_size=args.vocab, context_length=args.context, layers=12, heads=12, width=768,
                        dropout=0.0).to(device)
    generator = torch.Generator(device).manual_seed(1)
    batches = [tuple(torch.randint(args.vocab, (args.batch, args.context), device=device, generator=generator)
                     for _ in range(2)) for _ in range(args.warmup + args.steps)]
    rows = []
    for variant in args.variants:
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        model = copy.deepcopy(base)
        if variant != "bf16":
            recipe = variant.removesuffix("-skip-head")
            model = float8_model(model, recipe, skip_head=variant.endswith("-skip-head"))
        row = {"variant": variant, **run(model, batches, args.warmup)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del model
    reference = rows[0]["step_ms_median"] if rows and rows[0]["variant"] == "bf16" else None
    for row in rows:
        if reference:
            row["speed_vs_bf16"] = round(reference / row["step_ms_median"], 3)
    import torchao
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "torchao": torchao.__version__,
            "date": datetime.now(timezone.utc).date().isoformat(),
            "command": "PYTHONPATH=src python benchmarks/gpt2_speed/fp8_training.py " +
                       f"--steps {args.steps} --warmup {args.warmup} --out fp8_training.json",
            "shape": {"layers": 12, "width": 768, "heads": 12, "context": args.context, "batch": args.batch,
                      "vocab_rows": args.vocab}}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
