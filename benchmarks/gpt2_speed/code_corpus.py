"""Writes a text corpus that 300 steps of gpt2-small do not repeat: the Python standard library's
own ``.py`` sources in sorted path order (then, with ``--site-packages``, the installed packages'),
up to ``--megabytes``.

Why: tiny Shakespeare's 267 k BPE training tokens are seen 18 times in 300 steps of 16 x 1024
tokens, so a model that learns faster overfits sooner and its validation loss says little about
a change to the model. The data sets at hand hold no larger natural-language text; every Python
installation holds this one (26 MB give about 6 M training tokens with a 50,257-token BPE
vocabulary, more than 300 steps read; a standard library without its tests is about 11 MB).

    python benchmarks/gpt2_speed/code_corpus.py --megabytes 26 --site-packages --out code.txt
"""

import argparse
import site
import sys
import sysconfig
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--megabytes", type=float, default=26.0)
    ap.add_argument("--site-packages", action="store_true", help="the installed packages' sources after the library's")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in sorted(stdlib.rglob("*.py")) if not {"site-packages", "dist-packages"} & set(p.parts)]
    if args.site_packages:
        paths += [p for folder in site.getsitepackages() for p in sorted(Path(folder).rglob("*.py"))]
    limit, written, files = int(args.megabytes * 1e6), 0, 0
    with open(args.out, "w", encoding="utf-8") as out:
        for path in paths:
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            out.write(text + "\n")
            written, files = written + len(text) + 1, files + 1
            if written >= limit:
                break
    print(f"{args.out}: {written / 1e6:.1f} MB from {files} files of Python {sys.version.split()[0]}'s {stdlib}"
          + (f" and {', '.join(site.getsitepackages())}" if args.site_packages else ""))


if __name__ == "__main__":
    main()
