"""How fast a folder of JPEG frames is decoded for inference, with the decoding processes writing
into shared memory and with their images sent back through pipes, alternated in one
process after a warm-up pass: ``decode_images`` at the model's size in chunks of 4,096 (as
``gpuaccel infer`` reads them), on one pool of a process per core.

    PYTHONPATH=src python benchmarks/infer_memory/decode_speed.py FRAMES/ --size 128 --count 20480
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ProcessPoolExecutor

import gpuaccel.data.images as readers
from gpuaccel.deploy.infer import CHUNK, images_in


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("frames")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--count", type=int, default=20480)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    sources = [readers.ImageSource(f, f) for f in images_in(args.frames)[:args.count]]
    shared_rows = readers._shared_rows
    rates: dict[str, list[int]] = {}
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        for way in ["warm-up"] + ["shared", "pickled"] * args.rounds:
            readers._shared_rows = shared_rows if way != "pickled" else (lambda count, size: None)
            start = time.perf_counter()
            for first in range(0, len(sources), CHUNK):
                readers.decode_images(sources[first:first + CHUNK], image_size=args.size, pool=pool, sizes=True)
            rates.setdefault(way, []).append(round(len(sources) / (time.perf_counter() - start)))
    readers._shared_rows = shared_rows
    print(json.dumps({"frames_per_second_decoded": rates, "frames": len(sources), "cores": os.cpu_count()}))


if __name__ == "__main__":
    main()
