"""Zero the GPU code for other architectures inside a shared library's CUDA fat binary, so the
library compresses small enough to carry to the device (onnxruntime-gpu's CUDA provider: 284 MB,
185 MB with xz -9; with only its sm_90 cubins left, 52 MB with xz -6).

    python strip_fatbin.py libonnxruntime_providers_cuda.so stripped.so [--keep 90]

The entries' headers stay in place, so the CUDA runtime still sees every entry and picks the one
for the GPU it runs on; only the payloads of the others become zeros. The library then works only
on the kept architectures (H100 and H200 are sm_90). Layout used, as read from this library
(the fat binary format is not documented by NVIDIA): the .nv_fatbin section holds containers,
each a header (magic 0xBA55ED50, u16 version, u16 header size, u64 size of what follows) then
entries, each a header (u16 kind, u16 flags, u32 header size, u64 payload size, ..., the SM
architecture as u32 at offset 28) then its payload.
"""

import argparse
import collections
import struct

MAGIC = 0xBA55ED50


def section(data: bytes, wanted: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 section by name."""
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names_offset = headers[shstrndx][4]
    for name_at, _, _, _, offset, size, *_ in headers:
        name = data[names_offset + name_at:data.index(b"\0", names_offset + name_at)].decode()
        if name == wanted:
            return offset, size
    raise SystemExit(f"no {wanted} section")


def entries(data: bytes, start: int, size: int):
    """(payload offset, payload size, kind, arch) of every entry in the fat binary."""
    pos, end = start, start + size
    while pos < end:
        magic, _, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != MAGIC:  # containers are aligned; skip the padding between them
            pos += 8
            continue
        entry, body_end = pos + header_size, pos + header_size + body_size
        while entry < body_end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            arch, = struct.unpack_from("<I", data, entry + 28)
            yield entry + entry_header, payload, kind, arch
            entry += entry_header + payload
        pos = body_end


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("library")
    ap.add_argument("out")
    ap.add_argument("--keep", type=int, nargs="+", default=[90], help="SM architectures to keep (90)")
    args = ap.parse_args()
    data = bytearray(open(args.library, "rb").read())
    kept, zeroed = collections.Counter(), collections.Counter()
    for offset, size, kind, arch in list(entries(data, *section(data, ".nv_fatbin"))):
        if arch in args.keep:
            kept[(kind, arch)] += size
        else:
            data[offset:offset + size] = bytes(size)
            zeroed[(kind, arch)] += size
    print("kept (kind, sm): MB", {k: round(v / 1e6, 1) for k, v in sorted(kept.items())})
    print("zeroed (kind, sm): MB", {k: round(v / 1e6, 1) for k, v in sorted(zeroed.items())})
    open(args.out, "wb").write(data)


if __name__ == "__main__":
    main()
