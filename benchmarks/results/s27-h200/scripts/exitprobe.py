"""Probe: where the seconds after gpuaccel's summary go. Usage: python3 exitprobe.py START_EPOCH -m gpuaccel ARGS"""
import atexit, os, runpy, sys, threading, time
START = float(sys.argv[1]); del sys.argv[1]
LOG = open(os.environ.get("EXITPROBE_LOG", "/tmp/exitprobe.log"), "a")
def mark(what): LOG.write(f"{time.time() - START:8.3f} {what}\n"); LOG.flush()
_register = atexit.register
def register(fn, *a, **k):
    name = f"{getattr(fn, '__module__', None)}.{getattr(fn, '__qualname__', repr(fn))}"
    def timed(*aa, **kk):
        t = time.perf_counter()
        try:
            return fn(*aa, **kk)
        finally:
            mark(f"atexit {name} {time.perf_counter() - t:.3f} s")
    _register(timed, *a, **k)
    return fn
atexit.register = register
_shutdown = threading._shutdown
def shutdown():
    mark("threading._shutdown begins: " + ", ".join(t.name for t in threading.enumerate() if not t.daemon))
    _shutdown()
    mark("threading._shutdown ends")
threading._shutdown = shutdown
mark("probe start")
assert sys.argv[1] == "-m"
mod = sys.argv[2]; sys.argv = [mod] + sys.argv[3:]
try:
    runpy.run_module(mod, run_name="__main__", alter_sys=True)
except SystemExit as e:
    mark(f"main returned {e.code}")
    try:
        import torch._dynamo.utils as u
        mark("compile_times " + u.compile_times(repr="str").replace("\n", " | ")[:3000])
        mark("counters " + repr({k: dict(v) for k, v in u.counters.items() if v})[:3000])
    except Exception as x:
        mark(f"no compile times: {x}")
    if os.environ.get("EXITPROBE_FAST") == "1":  # atexit's handlers, then no interpreter finalisation
        threading._shutdown()
        atexit._run_exitfuncs()
        sys.stdout.flush(); sys.stderr.flush()
        mark("os._exit")
        os._exit(e.code or 0)
    raise
