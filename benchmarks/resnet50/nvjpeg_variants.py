"""nvJPEG's hardware batch decoder under each backend, flag and output format, alone and
beside busy GPU work (a CUDA graph of eight 4096 x 4096 bf16 matrix products replayed on a
thread), against torchvision's decode_jpeg beside the same work. Needs a GPU with a JPEG
hardware decoder (A100 and later).

    python benchmarks/resnet50/nvjpeg_variants.py --out variants.json
    CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/resnet50/nvjpeg_variants.py --backends 3 --flags 0 2 \
        --formats 3 --out connections32.json
    python benchmarks/resnet50/nvjpeg_variants.py --backends 3 --flags 0 --formats 3 --load-stream own \
        --out load_on_own_stream.json

``--load-stream``: where the load's graph is replayed: PyTorch's default stream (``default``,
the legacy NULL stream, where a training loop's kernels go unless it picks a stream) or a
stream of its own (``own``, created non-blocking like every stream PyTorch makes).
``--decode-stream``: the stream the direct call is given: a high-priority stream of its own
(``side``, as the streaming loader does) or the default stream (``default``). torchvision's
decode_jpeg always runs on the default stream here.

Per variant: the nvjpegDecodeBatched status, the largest pixel difference from torchvision
(RGB and interleaved RGB), the calling thread's time and the time until the GPU is done
(medians of 5), the CUDA runtime calls and GPU operations of one call (torch.profiler), and
the median time of 3 calls beside the load. Backends: 3 hardware, 5 hardware with the
bitstreams on the device. Flags: nvjpegCreateEx's (1: no pipelining in the hardware
decoder, 2: memory pools). Formats: 3 RGB planes, 5 interleaved RGB, 1 YUV.
"""
import argparse
import io, time, json, threading, ctypes, collections
import numpy as np, torch
from PIL import Image
from gpuaccel.data import nvjpeg
from torchvision.io import decode_jpeg, ImageReadMode
from torch.profiler import profile, ProfilerActivity

ap = argparse.ArgumentParser()
ap.add_argument("--backends", nargs="+", type=int, default=[3, 5])
ap.add_argument("--flags", nargs="+", type=int, default=[0, 1, 2])
ap.add_argument("--formats", nargs="+", type=int, default=[3, 5, 1])
ap.add_argument("--load-stream", choices=["default", "own"], default="default")
ap.add_argument("--decode-stream", choices=["side", "default"], default="side")
ap.add_argument("--out", required=True)
args = ap.parse_args()
rng = np.random.default_rng(0)
blobs = []
for k in range(256):
    h, w = int(rng.integers(300, 500)), int(rng.integers(300, 520))
    base = Image.fromarray(rng.integers(0, 256, (h // 8 + 2, w // 8 + 2, 3), dtype=np.uint8)).resize((w, h), Image.Resampling.BICUBIC)
    buf = io.BytesIO(); base.save(buf, "JPEG", quality=90); blobs.append(buf.getvalue())
frames = [nvjpeg.frame(b) for b in blobs]
dev = torch.device("cuda"); torch.zeros(1, device=dev)
import torchvision.io.image
lib = ctypes.CDLL(nvjpeg._library_candidates()[0])
vp = ctypes.c_void_p
lib.nvjpegCreateEx.argtypes = [ctypes.c_int, vp, vp, ctypes.c_uint, ctypes.POINTER(vp)]
lib.nvjpegJpegStateCreate.argtypes = [vp, ctypes.POINTER(vp)]
lib.nvjpegDecodeBatchedInitialize.argtypes = [vp, vp, ctypes.c_int, ctypes.c_int, ctypes.c_int]
lib.nvjpegDecodeBatched.argtypes = [vp] * 6
lengths = np.array([len(b) for b in blobs], dtype=np.int64)
offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
host = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).pin_memory()
ondev = host.to(dev)
H = np.array([f.height for f in frames], dtype=np.int64); W = np.array([f.width for f in frames], dtype=np.int64)
side = torch.cuda.Stream(dev, priority=-1) if args.decode_stream == "side" else torch.cuda.default_stream(dev)
tv = decode_jpeg([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs], mode=ImageReadMode.RGB, device=dev)

def make(backend, flags):
    h, s = vp(), vp()
    st = lib.nvjpegCreateEx(backend, None, None, flags, ctypes.byref(h))
    if st: return None, st
    assert lib.nvjpegJpegStateCreate(h, ctypes.byref(s)) == 0
    return (h, s), 0

def decoder(hs, backend, fmt):
    h, s = hs
    planes = 3 * H * W
    starts = np.concatenate([[0], np.cumsum(planes)[:-1]]).astype(np.int64)
    out = torch.zeros(int(planes.sum()), dtype=torch.uint8, device=dev)
    imgs = np.zeros((256, 8), dtype=np.uint64)
    first = out.data_ptr() + starts
    if fmt == 5:
        imgs[:, 0] = first; imgs[:, 4] = 3 * W
    else:
        for c in range(3):
            imgs[:, c] = first + c * H * W; imgs[:, 4 + c] = W
    src = ((ondev if backend == 5 else host).data_ptr() + offsets).astype(np.uint64)
    sizes = lengths.astype(np.uint64)
    assert lib.nvjpegDecodeBatchedInitialize(h, s, 256, 1, fmt) == 0
    def run():
        with torch.cuda.stream(side):
            return lib.nvjpegDecodeBatched(h, s, src.ctypes.data, sizes.ctypes.data, imgs.ctypes.data, side.cuda_stream)
    return run, out, starts

# load: graph of 8 bf16 4096 matmuls on a normal stream, replayed from a thread
a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
g = torch.cuda.CUDAGraph(); ls = torch.cuda.Stream(dev)
with torch.cuda.stream(ls):
    for _ in range(3): a @ a
    with torch.cuda.graph(g):
        c = a
        for _ in range(8): c = c @ a
load_stream = ls if args.load_stream == "own" else torch.cuda.default_stream(dev)


def under_load_ms(call) -> float:
    """Median ms of three ``call()``s while another thread replays the graph of matrix products."""
    stop = threading.Event()

    def load():
        with torch.cuda.stream(load_stream):
            while not stop.is_set():
                g.replay(); time.sleep(0)
    th = threading.Thread(target=load); th.start(); time.sleep(0.3)
    ws = []
    for _ in range(3):
        t = time.perf_counter(); call(); ws.append(time.perf_counter() - t)
    stop.set(); th.join(); torch.cuda.synchronize()
    return round(np.median(ws) * 1e3, 1)


results = {"load_stream": args.load_stream, "decode_stream": args.decode_stream}
for backend in args.backends:
    for flags in args.flags:
        hs, st = make(backend, flags)
        if hs is None:
            results[f"b{backend}_f{flags}"] = {"create_status": st}; continue
        for fmt in args.formats:
            key = f"b{backend}_f{flags}_o{fmt}"
            r = {}
            try:
                run, out, starts = decoder(hs, backend, fmt)
                r["status"] = run(); side.synchronize()
                if r["status"] == 0 and fmt in (3, 5):
                    d = 0
                    for k in range(0, 256, 17):
                        seg = out[starts[k]:starts[k] + 3 * H[k] * W[k]]
                        img = seg.view(3, H[k], W[k]) if fmt == 3 else seg.view(H[k], W[k], 3).permute(2, 0, 1)
                        d = max(d, int((img.int() - tv[k].int()).abs().max()))
                    r["max_diff"] = d
                if r["status"] == 0:
                    ts = []
                    for _ in range(5):
                        torch.cuda.synchronize(); t = time.perf_counter(); run(); h_ = time.perf_counter() - t; side.synchronize(); ts.append((h_, time.perf_counter() - t))
                    r["host_ms"] = round(np.median([x[0] for x in ts]) * 1e3, 2); r["done_ms"] = round(np.median([x[1] for x in ts]) * 1e3, 2)
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                        run(); side.synchronize()
                    ev = [e for e in p.events()]
                    cnt = collections.Counter(e.name[:45] for e in ev if e.device_type.name == "CPU" and e.name.startswith("cuda"))
                    r["runtime_calls"] = dict(cnt)
                    r["gpu_ops"] = dict(collections.Counter(e.name[:45] for e in ev if e.device_type.name == "CUDA"))
                    r["under_load_ms"] = under_load_ms(lambda: (run(), side.synchronize()))
            except Exception as e:
                r["error"] = repr(e)[:300]
            results[key] = r
            print(key, json.dumps(r), flush=True)
# torchvision under the same load
tvin = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in blobs]
results["torchvision_under_load_ms"] = under_load_ms(lambda: decode_jpeg(tvin, mode=ImageReadMode.RGB, device=dev))
print("torchvision under load", results["torchvision_under_load_ms"])
json.dump(results, open(args.out, "w"), indent=1)
