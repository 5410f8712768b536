export GPUACCEL_CACHE_DIR=/tmp/gpuaccel-cache PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
unset PYTHONDONTWRITEBYTECODE; export PYTHONPYCACHEPREFIX=/tmp/pyc
export PYTHONPATH=$PWD/src:$PWD/benchmarks
R=$OUT/r; mkdir -p $R
finish() { tar czf $OUT/r.tgz -C $OUT r; }
trap finish EXIT
# e2e KEY SECONDS [extra train args]: gpuaccel train from the JPEG folder; NO_WAIT=1 disables the nvJPEG wait,
# SWITCH=s sets sys.setswitchinterval, SHARING=file_system torch.multiprocessing's sharing strategy, YUV=1 nvJPEG's
# output format to YUV (a timing probe: wrong colours), DEPTH=n the batches made ahead by the pipeline thread,
# NO_FREEZE=1 disables the trainer's gc.freeze(), GCLOG=path records full garbage collections;
# ablations (throughput probes: every batch is then the first one's images): NODECODE=1 decodes each
# loader's first batch only and resamples it again for every later batch, NORESAMPLE=1 decodes every
# batch but hands out the first finished batch again instead of resampling; OWNSTREAM=1 runs
# Trainer.fit on a CUDA stream of its own and gives the direct nvJPEG call the (then idle) default
# stream; PRODLOG=path records per batch the pipeline thread's seconds in BatchDecoder.decode, in
# the nvjpegDecodeBatched call inside it, in its ordering wait and in the whole batch
# (StreamLoader._images); PROFILE_STEPS=n makes --profile trace n steps from step 20; THREADS=n
# gives the streaming loader n pipeline threads; NORESERVE=1 stops the direct nvJPEG
# call reserving the engines' buffers (nvjpegDecodeBatchedPreAllocate) in commit 3b518b9 (reverted: no gain)
e2e() {
  local key=$1 limit=$2; shift 2
  rm -rf /tmp/imagenet/run-$key
  timeout $limit python3 -c "
import faulthandler, os, sys
f = open('$R/stacks_$key.txt', 'w'); faulthandler.dump_traceback_later($limit - 15, repeat=True, file=f)
if os.environ.get('SWITCH'):  # probe: the interpreter's thread switch interval, seconds
    sys.setswitchinterval(float(os.environ['SWITCH']))
if os.environ.get('SHARING'):  # probe: how reader processes hand tensors over
    import torch.multiprocessing; torch.multiprocessing.set_sharing_strategy(os.environ['SHARING'])
if os.environ.get('YUV'):  # probe: nvJPEG writes its YUV planes (no conversion kernel; colours then wrong)
    import gpuaccel.data.nvjpeg as n; n._OUTPUT_RGB = 1
if os.environ.get('DEPTH'):  # probe: batches the pipeline thread makes ahead (default 3)
    import gpuaccel.data.prefetch as p; p.in_threads.__defaults__ = (int(os.environ['DEPTH']),)
if os.environ.get('NO_FREEZE'):  # probe: the trainer's gc.freeze() after the warm-up made a no-op
    import gc; gc.freeze = lambda: None
if os.environ.get('GCLOG'):  # probe: each garbage collection of generation 2, (seconds since start, ms) -> GCLOG
    import atexit, gc, json, time
    t0, full, began = time.perf_counter(), [], [0.0]
    def on_gc(phase, info):
        if info['generation'] == 2:
            if phase == 'start': began[0] = time.perf_counter()
            else: full.append((round(began[0] - t0, 3), round((time.perf_counter() - began[0]) * 1e3, 2)))
    gc.callbacks.append(on_gc)
    atexit.register(lambda: json.dump(full, open(os.environ['GCLOG'], 'w')))
if os.environ.get('NODECODE'):
    import gpuaccel.data.stream as s
    decoded = s.StreamLoader._decoded
    def first_decoded(self, host):
        if len(getattr(self, '_probe_decoded', ((),))[0]) != len(host.shapes) + len(host.frames):
            self._probe_decoded = decoded(self, host)
        return self._probe_decoded
    s.StreamLoader._decoded = first_decoded
if os.environ.get('NORESAMPLE'):
    import gpuaccel.data.stream as s
    made, resample = {}, s.resample_boxes
    def first_made(table, boxes, size, flip=None, **form):
        key = (len(table), size, str(form.get('dtype')), form.get('channels_last'), flip is None)
        if key not in made:
            made[key] = resample(table, boxes, size, flip, **form)
        return made[key]
    s.resample_boxes = first_made
if os.environ.get('OWNSTREAM'):
    import torch, gpuaccel.train.trainer as t, gpuaccel.data.nvjpeg as n
    fit, decode = t.Trainer.fit, n.BatchDecoder.decode
    def fit_on_own_stream(self):
        before = torch.cuda.current_stream(self.device)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(before)
        try:
            with torch.cuda.stream(stream):
                return fit(self)
        finally:
            before.wait_stream(stream)
    def decode_on_default_stream(self, *args):
        side, default = torch.cuda.current_stream(self.device), torch.cuda.default_stream(self.device)
        side.synchronize()  # the hazard drain_before_decoding guards against, for blocks of this stream
        with torch.cuda.stream(default):
            planes, starts = decode(self, *args)
        side.wait_stream(default)
        planes.record_stream(side)
        return planes, starts
    t.Trainer.fit, n.BatchDecoder.decode = fit_on_own_stream, decode_on_default_stream
if os.environ.get('PROFILE_STEPS'):
    import gpuaccel.monitor.profiling as pr; pr.StepProfiler.__init__.__defaults__ = (20, 2, int(os.environ['PROFILE_STEPS']))
if os.environ.get('THREADS'):  # the streaming loader's pipeline threads (default 1)
    import gpuaccel.data.stream as s; s.StreamLoader.__init__.__kwdefaults__['threads'] = int(os.environ['THREADS'])
if os.environ.get('NORESERVE'):
    import gpuaccel.data.nvjpeg as n; n._RESERVE_LIMIT = 0
if os.environ.get('PRODLOG'):
    import atexit, json, time, gpuaccel.data.nvjpeg as n, gpuaccel.data.stream as s
    spans = {'decode_call': [], 'nvjpeg_decode_batched': [], 'drain': [], 'images': []}
    def timed(name, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spans[name].append(round(time.perf_counter() - t0, 5))
        return run
    n.BatchDecoder.decode = timed('decode_call', n.BatchDecoder.decode)
    opened = n.BatchDecoder.__init__
    def open_timed(self, library, *args, **kwargs):
        opened(self, library, *args, **kwargs)
        library.nvjpegDecodeBatched = timed('nvjpeg_decode_batched', library.nvjpegDecodeBatched)
    n.BatchDecoder.__init__ = open_timed
    n.drain_before_decoding = timed('drain', n.drain_before_decoding)
    s.StreamLoader._images = timed('images', s.StreamLoader._images)
    atexit.register(lambda: json.dump(spans, open(os.environ['PRODLOG'], 'w')))
if os.environ.get('NO_WAIT'):
    import gpuaccel.data.nvjpeg as n; n.drain_before_decoding = lambda device: None
from gpuaccel.cli import main; sys.exit(main(sys.argv[1:]))" train --data /tmp/imagenet/folder --loader stream --model resnet50 --image-size 224 --precision bf16 --compile --compile-mode default --batch-size 256 --eval-batch-size 256 --lr 0.1 --run-dir /tmp/imagenet/run-$key "$@" > $R/$key.log 2>&1
  echo "$key rc $?"
  grep -iE "epoch|loss|accura|img/s" $R/$key.log | grep -v "Warn\|warn\|fork" | tail -6 | cut -c1-220
  cp /tmp/imagenet/run-$key/summary.json $R/summary_$key.json 2>/dev/null
  cp /tmp/imagenet/run-$key/metrics.jsonl $R/metrics_$key.jsonl 2>/dev/null
}
# A/B runs: PYTHONPATH of this tree (NEW) and of the code before (HEAD, carried as .carry/src_head);
# report KEY prints a finished run's img/s, seconds, test loss and per-epoch data wait
NEW=$PWD/src:$PWD/benchmarks
HEAD=$PWD/.carry/src_head/src:$PWD/benchmarks
report() {
  python3 -c "
import json; s=json.load(open('$R/summary_$1.json')); m=[json.loads(l) for l in open('$R/metrics_$1.jsonl')]
print('  ', s['images_per_second'], s['train_seconds'], s['test_loss'], 'wait', [r['data_wait'] for r in m])" 2>/dev/null
}
