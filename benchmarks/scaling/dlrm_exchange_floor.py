"""What a sharded DLRM step's exchanges and copies cost at its sizes on this host, apart from the
step: all_to_all_single of the rows (bf16 and fp32) and of the ids, a plain copy of each, a 10 MB
all-reduce (the MLPs' gradients), the gradient's gather into the exchange's layout against a
transposing copy and against the same gather of 8-byte words, a lookup of the rows (fp32 table, bf16
result) against index_select, and the update's index_put_ and index_fill_ of fp32 rows against the
same of 8-byte words (models/dlrm.py's _as_words). CUDA
events, median / min / max of 20 after 5 warm-up calls; rank 0 writes the JSON.

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/scaling/dlrm_exchange_floor.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

from gpuaccel.models.dlrm import _as_words

RECORDS, TABLES, DIM = 32768, 26, 128  # dlrm_trainer.py --batch 32768: Criteo's 26 tables, 128 wide


def timed_ms(fn, repeats: int = 20) -> list[float]:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(start.elapsed_time(end) for start, end in events)
    return [round(times[repeats // 2], 4), round(times[0], 4), round(times[-1], 4)]


def main() -> None:
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    results = {}
    for name, dtype in (("rows_bf16", torch.bfloat16), ("ids_i64", torch.int64), ("rows_fp32", torch.float32)):
        count = RECORDS * TABLES * (DIM if name.startswith("rows") else 1)
        sent = torch.randn(count, device=device).to(dtype) if dtype.is_floating_point else \
            torch.randint(0, 9, (count,), device=device)
        received = torch.empty_like(sent)
        results["a2a_" + name] = timed_ms(lambda: dist.all_to_all_single(received, sent))
        results["copy_" + name] = timed_ms(lambda: received.copy_(sent))
    gradients = torch.randn(2_500_000, device=device)
    results["allreduce_10MB_fp32"] = timed_ms(lambda: dist.all_reduce(gradients))
    # the interaction's gradient, (records, tables + 1, dim); the tables' part into (tables, records, dim)
    interaction = torch.randn(RECORDS, TABLES + 1, DIM, device=device, dtype=torch.bfloat16)
    order = torch.arange(TABLES, device=device)
    results["by_slot_gather"] = timed_ms(lambda: interaction[:, 1:].transpose(0, 1)[order])
    results["transpose_copy"] = timed_ms(lambda: interaction[:, 1:].transpose(0, 1).contiguous())
    words = _as_words(interaction[:, 1:])  # the same bits as 8-byte words: a quarter of the elements
    results["by_slot_gather_words"] = timed_ms(lambda: words.transpose(0, 1)[order].view(torch.bfloat16))
    table = torch.randn(20_000_000, DIM, device=device)
    rows = torch.randint(0, table.shape[0], (RECORDS * TABLES,), device=device)
    results["lookup_fp32_to_bf16"] = timed_ms(lambda: table[rows].to(torch.bfloat16))
    results["lookup_index_select"] = timed_ms(lambda: torch.index_select(table, 0, rows))
    # the update's writes: each looked-up row written back (index_put_) and its gradient sum cleared
    # (index_fill_), fp32 elements against the same bits as 8-byte words
    new_rows = table[rows]
    results["index_put_fp32"] = timed_ms(lambda: table.index_put_((rows,), new_rows))
    results["index_put_words"] = timed_ms(lambda: _as_words(table).index_put_((rows,), _as_words(new_rows)))
    results["index_fill_fp32"] = timed_ms(lambda: table.index_fill_(0, rows, 0.0))
    results["index_fill_words"] = timed_ms(lambda: _as_words(table).index_fill_(0, rows, 0))
    if rank == 0:
        out = {"world": dist.get_world_size(), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
               "ms_median_min_max": results}
        print(json.dumps(out))
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
