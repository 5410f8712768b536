"""Probe: the cache hits, misses and bypasses (with their key components) from a TORCH_TRACE folder."""
import glob, sys
out = []
for path in sorted(glob.glob(sys.argv[1] + "/*.log")):
    keep = False
    for line in open(path, errors="replace"):
        if not line.startswith("\t"):
            keep = any(k in line for k in ("cache_miss", "cache_hit", "cache_bypass", "guard_added", "recompile", "dynamo_start"))
            if keep:
                out.append(line[:600].rstrip())
        elif keep:
            out.append(line[:400].rstrip())
open(sys.argv[2], "w").write("\n".join(out)[-400000:] + "\n")
print(sys.argv[1], len(out), "lines")
