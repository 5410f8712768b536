"""Where a command's memory is: runs it, reads every 20 ms the resident memory of it and of each
of its descendant processes (``/proc/PID/status``: VmRSS and its anonymous, file and shared
parts), and prints each one's peaks in MiB as JSON (the command's own process as "main", the
others by their command line, with how many processes had it).

    python benchmarks/infer_memory/rss_parts.py python -m gpuaccel infer RUN FRAMES/ --out p.csv --force

Linux only. A peak of each part is its own maximum: the parts need not peak at once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

PARTS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def children(pid: int) -> list[int]:
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
    except OSError:  # (it ended meanwhile)
        pass
    return found


def status(pid: int) -> dict | None:
    values = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in PARTS:
                    values[key] = int(value.split()[0]) // 1024
        with open(f"/proc/{pid}/cmdline") as f:
            values["cmd"] = f.read().replace("\0", " ")[:60]
    except OSError:
        return None
    return values


def main() -> None:
    proc = subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL)
    peaks: dict[str, dict] = {}
    while proc.poll() is None:
        todo, seen = [proc.pid], []
        while todo:
            pid = todo.pop()
            seen.append(pid)
            todo += children(pid)
        for pid in seen:
            values = status(pid)
            if not values:
                continue
            peak = peaks.setdefault("main" if pid == proc.pid else f"child:{values['cmd'][:40]}", {"pids": set()})
            peak["pids"].add(pid)
            for part in PARTS:
                peak[part] = max(peak.get(part, 0), values.get(part, 0))
        time.sleep(0.02)
    print(json.dumps({name: {**{k: v for k, v in peak.items() if k != "pids"}, "processes": len(peak["pids"])}
                      for name, peak in peaks.items()}, indent=1))


if __name__ == "__main__":
    main()
