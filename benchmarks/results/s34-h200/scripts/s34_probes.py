"""Session 34: `gpuaccel train` with throughput probes set by environment variables, then the CLI.

Probes (each a timing experiment, not a product setting):
  NODECODE=1   each loader decodes its first batch only and resamples it again for every later batch
  THREADS=n    the streaming loader's pipeline threads (default 1)
  HIPRIO=1     Trainer.fit runs on a CUDA stream of the highest priority (nvJPEG's internal streams
               and the pipeline's side stream then yield to training's kernels)
  AFFINITY=k   the training process on cores 0..k-1, its reader processes on the rest
  COUNTERS=path  torch._dynamo's counters (FX graph cache hits and misses, ...) written at exit
  STEPLOG=path per training step, host seconds of forward_backward + optimizer_step
  PRODLOG=path per batch, the pipeline thread's seconds: waiting for the reader's host batch
               (read), in BatchDecoder.decode (decode_call), in nvjpegDecodeBatched (nvjpeg),
               in drain_before_decoding (drain), in the whole StreamLoader._made (made)
  SWITCH=s     sys.setswitchinterval(s)
"""
import atexit
import json
import os
import sys
import time

if os.environ.get("NODECODE"):
    import gpuaccel.data.stream as s
    decoded = s.StreamLoader._decoded

    def first_decoded(self, host):
        if len(getattr(self, "_probe_decoded", ((),))[0]) != len(host.shapes) + len(host.frames):
            self._probe_decoded = decoded(self, host)
        return self._probe_decoded
    s.StreamLoader._decoded = first_decoded

if os.environ.get("THREADS"):
    import gpuaccel.data.stream as s
    s.StreamLoader.__init__.__kwdefaults__["threads"] = int(os.environ["THREADS"])

if os.environ.get("HIPRIO"):
    import torch
    import gpuaccel.train.trainer as t
    fit = t.Trainer.fit

    def fit_on_high_priority_stream(self):
        before = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device, priority=-100)  # mapped to the device's highest
        print("HIPRIO stream priority", stream.priority, file=sys.stderr)
        stream.wait_stream(before)
        try:
            with torch.cuda.stream(stream):
                return fit(self)
        finally:
            before.wait_stream(stream)
    t.Trainer.fit = fit_on_high_priority_stream

if os.environ.get("AFFINITY"):
    cores = sorted(os.sched_getaffinity(0))
    k = int(os.environ["AFFINITY"])
    mine, readers = set(cores[:k]), set(cores[k:])
    import gpuaccel.data.stream as s
    getitem = s._FileBatches.__getitem__

    def getitem_on_reader_cores(self, ids):
        if os.sched_getaffinity(0) != readers:
            os.sched_setaffinity(0, readers)
        return getitem(self, ids)
    s._FileBatches.__getitem__ = getitem_on_reader_cores
    os.sched_setaffinity(0, mine)  # threads started from here on inherit it
    print("AFFINITY main", sorted(mine), "readers", sorted(readers), file=sys.stderr)

if os.environ.get("COUNTERS"):
    def write_counters():
        from torch._dynamo.utils import counters
        json.dump({k: dict(v) for k, v in counters.items()}, open(os.environ["COUNTERS"], "w"), indent=1)
    atexit.register(write_counters)

if os.environ.get("STEPLOG"):
    import gpuaccel.train.trainer as t
    spans = []
    forward_backward, optimizer_step = t.Trainer.forward_backward, t.Trainer.optimizer_step

    def timed_forward_backward(self, *args, **kwargs):
        self._probe_t0 = time.perf_counter()
        return forward_backward(self, *args, **kwargs)

    def timed_optimizer_step(self, *args, **kwargs):
        try:
            return optimizer_step(self, *args, **kwargs)
        finally:
            spans.append(round(time.perf_counter() - getattr(self, "_probe_t0", time.perf_counter()), 5))
    t.Trainer.forward_backward, t.Trainer.optimizer_step = timed_forward_backward, timed_optimizer_step
    atexit.register(lambda: json.dump(spans, open(os.environ["STEPLOG"], "w")))

if os.environ.get("SWITCH"):
    sys.setswitchinterval(float(os.environ["SWITCH"]))

if os.environ.get("PRODLOG"):
    import gpuaccel.data.nvjpeg as n
    import gpuaccel.data.stream as s
    prod_spans = {"read": [], "decode_call": [], "nvjpeg": [], "drain": [], "made": []}

    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                prod_spans[name].append(round(time.perf_counter() - t0, 5))
        return run
    n.BatchDecoder.decode = timed("decode_call", n.BatchDecoder.decode)
    opened = n.BatchDecoder.__init__

    def open_timed(self, library, *args, **kwargs):
        opened(self, library, *args, **kwargs)
        library.nvjpegDecodeBatched = timed("nvjpeg", library.nvjpegDecodeBatched)
    n.BatchDecoder.__init__ = open_timed
    n.drain_before_decoding = timed("drain", n.drain_before_decoding)
    s.StreamLoader._made = timed("made", s.StreamLoader._made)
    read = s.StreamLoader._read

    def timed_read(self, epoch, start):
        steps = read(self, epoch, start)
        while True:
            t0 = time.perf_counter()
            try:
                step = next(steps)
            except StopIteration:
                return
            prod_spans["read"].append(round(time.perf_counter() - t0, 5))
            yield step
    s.StreamLoader._read = timed_read
    atexit.register(lambda: json.dump(prod_spans, open(os.environ["PRODLOG"], "w")))

from gpuaccel.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
