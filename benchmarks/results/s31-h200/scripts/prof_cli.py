# session 31: `gpuaccel train --recipe cifar10-fast --data /tmp/data/cifar10 --json` in this process,
# either under cProfile (argv[1] = stats file) or with wall clocks around the warm-up's parts ("timed")
import sys, time
t0 = time.perf_counter()
mode, out = sys.argv[1], sys.argv[2]
sys.argv = ["gpuaccel", "train", "--recipe", "cifar10-fast", "--data", "/tmp/data/cifar10", "--json"]
if mode == "variant":  # out: a JSON file; variant from PROBE_CUDNN (on|off|limit1) and PROBE_EVAL (compiled|eager)
    import json, os
    import torch
    import gpuaccel.cli
    from gpuaccel.train import trainer as T
    init = T.Trainer.__init__
    def patched(self, *a, **k):
        init(self, *a, **k)
        cudnn = os.environ.get("PROBE_CUDNN", "on")
        if cudnn == "off":
            torch.backends.cudnn.benchmark = False
        elif cudnn == "limit1":
            torch.backends.cudnn.benchmark_limit = 1
        if os.environ.get("PROBE_EVAL", "compiled") == "eager":
            self.eval_forward = self.model
    T.Trainer.__init__ = patched
    pretune_mode = os.environ.get("PROBE_PRETUNE", "none")
    if pretune_mode != "none":
        import copy, threading
        from gpuaccel.tasks.base import call_model
        from gpuaccel.train import step_graph as S
        def pretune(trainer, model, inputs, targets, eval_inputs):
            """cuDNN's algorithm search for every convolution shape training and evaluation will
            run, on a copy of the model, eagerly"""
            t = time.perf_counter()
            with trainer.precision.autocast(trainer.device):
                trainer.task.loss(call_model(model, inputs), targets).backward()
            model.eval()
            with torch.no_grad(), trainer.precision.autocast(trainer.device):
                call_model(model, eval_inputs)
            torch.cuda.synchronize()
            print("pretune took", round(time.perf_counter() - t, 3), file=sys.stderr)
        orig_warm_up = T.Trainer.warm_up
        def warm_up(self, evaluate=True, batch=None):
            batch = batch if batch is not None else next(iter(self.train_loader.batches(0)))
            inputs, targets = self.task.split(batch)
            eval_inputs, _ = self.task.split(next(iter(self.eval_loader.batches())))
            args = (self, copy.deepcopy(self.model), inputs, targets, eval_inputs)
            if pretune_mode == "seq":
                pretune(*args)
            else:
                thread = threading.Thread(target=pretune, args=args); thread.start()
                capture = self.step_graph.capture
                def joined_capture():
                    thread.join(); capture()
                self.step_graph.capture = joined_capture
            return orig_warm_up(self, evaluate, batch)
        T.Trainer.warm_up = warm_up
    import contextlib, io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        gpuaccel.cli.main()
    summary = json.loads(buf.getvalue())
    summary["probe"] = {"pretune": pretune_mode, "cudnn": os.environ.get("PROBE_CUDNN", "on"), "eval": os.environ.get("PROBE_EVAL", "compiled"),
                        "in_process_seconds": round(time.perf_counter() - t0, 3)}
    json.dump(summary, open(out, "w"))
    print(summary["probe"], summary["test_accuracy"], summary["train_seconds"], summary.get("warmup_seconds"),
          {k[:10]: v for k, v in summary["phases"].items()}, file=sys.stderr)
elif mode == "profile":
    import cProfile
    pr = cProfile.Profile(); pr.enable()
    import gpuaccel.cli
    gpuaccel.cli.main()
    pr.disable(); pr.dump_stats(out)
    import pstats
    with open(out + ".txt", "w") as f:
        p = pstats.Stats(out, stream=f); p.sort_stats("cumulative").print_stats(260); p.sort_stats("tottime").print_stats(70)
else:
    import functools, json
    import torch
    import gpuaccel.cli
    from gpuaccel.train import trainer as T, step_graph as S
    clocks = {}
    def timed(owner, name):
        fn = getattr(owner, name)
        @functools.wraps(fn)
        def wrapper(*a, **k):
            if torch.cuda.is_initialized(): torch.cuda.synchronize()
            s = time.perf_counter(); r = fn(*a, **k)
            if torch.cuda.is_initialized(): torch.cuda.synchronize()
            clocks.setdefault(f"{owner.__name__}.{name}", []).append(round(time.perf_counter() - s, 3)); return r
        setattr(owner, name, wrapper)
    for owner, name in [(T.Trainer, "warm_up"), (T.Trainer, "evaluate"), (T.Trainer, "forward_backward"), (T.Trainer, "optimizer_step"),
                        (S.StepGraph, "warm"), (S.StepGraph, "capture")]:
        if hasattr(owner, name): timed(owner, name)
    import torch._dynamo.convert_frame as cf, torch._inductor.compile_fx as cfx
    timed(cf, "_compile"); timed(cfx, "compile_fx")
    gpuaccel.cli.main()
    from torch._dynamo.utils import compile_times
    json.dump({"clocks": clocks, "compile_times": compile_times(repr="csv"), "total": time.perf_counter() - t0}, open(out, "w"), indent=1, default=str)
    print({k: v for k, v in clocks.items()}, file=sys.stderr)
