"""gpuaccel's multi30k recipe beside the textbook loop (textbook.py), in one command on one GPU.

    python benchmarks/translation/run.py --data multi30k/ --out results/ [--textbook-epochs 18]

1. ``gpuaccel train --recipe multi30k`` as a user runs it, twice: cold (a new, empty gpuaccel
   cache: data, compiled kernels and bytecode made anew) and warm (the same cache again); the
   whole command's wall time, the training time and the validation BLEU curve of each.
2. The warm run's kept model (best validation BLEU) translates test_2016_flickr with beam 5 and
   greedily (``gpuaccel.deploy.translation.Translator``): sacreBLEU BLEU and chrF, cased and
   detokenized (13a), with signatures.
3. The reverse direction, ``--source-lang en --target-lang de``: its test BLEU cased, and
   lowercased with 13a tokenisation (near the tokenized, lowercased BLEU published for
   English-German; not the same measure: that one scores Moses-tokenized text).
4. The textbook loop (textbook.py): BLEU on validation and test after each epoch, against
   seconds of training.

Writes ``translation.json`` (and each run's summary) under ``--out``; prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def train(data: str, run_dir: Path, cache: Path, extra: list[str]) -> dict:
    """``gpuaccel train --recipe multi30k`` in its own process; (summary, whole-command seconds)."""
    env = {**os.environ, "GPUACCEL_CACHE_DIR": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    cmd = [sys.executable, "-m", "gpuaccel", "train", "--recipe", "multi30k", "--data", data,
           "--run-dir", str(run_dir), "--json", *extra]
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    curve = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return {"command": " ".join(cmd[1:]), "command_seconds": round(seconds, 2),
            "train_seconds": summary["train_seconds"], "warmup_seconds": summary["warmup_seconds"],
            "setup_seconds": summary["setup_seconds"], "steps": summary["steps"],
            "samples_per_second": summary["samples_per_second"], "best_model": summary["best_model"],
            "val_curve": [{"epoch": r["epoch"], "train_seconds": r["elapsed"], "val_bleu": round(r["bleu"], 2)}
                          for r in curve],
            "summary": summary}


def test_scores(run_dir: Path, best: dict, data: Path, source: str, target: str, split: str) -> dict:
    import sacrebleu
    from gpuaccel.deploy.translation import Translator, score

    from textbook import split_files

    sources, references = split_files(data, split, source, target)
    model_file = run_dir / (best["file"] if best else "model.pt")
    out = {"model_file": model_file.name}
    for beam in (5, 1):
        translator = Translator.from_run(model_file, beam_size=beam)
        start = time.perf_counter()
        hypotheses = translator.translate(sources)
        seconds = time.perf_counter() - start
        scores = score(hypotheses, references)
        lower = sacrebleu.metrics.BLEU(lowercase=True, tokenize="13a")
        scores["bleu_lowercased"] = lower.corpus_score(hypotheses, [references]).score
        scores["bleu_lowercased_signature"] = str(lower.get_signature())
        scores["translate_seconds"] = round(seconds, 3)
        out[f"beam{beam}"] = scores
        if beam == 5:
            out["examples"] = [{"source": s, "reference": r, "translation": h}
                               for s, r, h in list(zip(sources, references, hypotheses))[:5]]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--test", default="test_2016_flickr")
    ap.add_argument("--textbook-epochs", type=int, default=18)
    ap.add_argument("--skip", action="append", default=[], help="cold, reverse or textbook")
    ap.add_argument("--train-args", default="", help="more options for every gpuaccel train (a smoke test's)")
    args = ap.parse_args()
    import torch

    sys.path.insert(0, str(HERE))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = Path(args.data).resolve()
    result = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "data": data.name}
    cache = Path(tempfile.mkdtemp(prefix="gpuaccel-cache-"))
    runs = Path(tempfile.mkdtemp(prefix="runs-"))
    if "cold" not in args.skip:
        result["cold"] = train(str(data), runs / "cold", cache, args.train_args.split())
        print(f"cold: command {result['cold']['command_seconds']} s, training {result['cold']['train_seconds']} s",
              flush=True)
    result["warm"] = train(str(data), runs / "warm", cache, args.train_args.split())
    print(f"warm: command {result['warm']['command_seconds']} s, training {result['warm']['train_seconds']} s",
          flush=True)
    result["warm"]["test"] = test_scores(runs / "warm", result["warm"]["best_model"], data, "de", "en", args.test)
    print(f"de-en test BLEU {result['warm']['test']['beam5']['bleu']:.2f}", flush=True)
    if "reverse" not in args.skip:
        result["reverse"] = train(str(data), runs / "reverse", cache, ["--source-lang", "en", "--target-lang", "de",
                                                                               *args.train_args.split()])
        result["reverse"]["test"] = test_scores(runs / "reverse", result["reverse"]["best_model"], data, "en", "de",
                                                args.test)
    if "textbook" not in args.skip:
        textbook_json = out / "textbook.json"
        start = time.perf_counter()
        subprocess.run([sys.executable, str(HERE / "textbook.py"), "--data", str(data), "--epochs",
                        str(args.textbook_epochs), "--test", args.test, "--out", str(textbook_json)], check=True)
        result["textbook"] = json.loads(textbook_json.read_text())
        result["textbook"]["command_seconds"] = round(time.perf_counter() - start, 2)
    for name in ("cold", "warm", "reverse"):
        if name in result:
            (out / f"summary_{name}.json").write_text(json.dumps(result[name].pop("summary"), indent=2))
    (out / "translation.json").write_text(json.dumps(result, indent=2))
    print(f"\n{'':28s} {'train s':>8s} {'command s':>10s} {'test BLEU':>10s}")
    for name in ("cold", "warm", "reverse"):
        if name in result:
            r = result[name]
            bleu = r.get("test", {}).get("beam5", {}).get("bleu")
            print(f"gpuaccel {name:19s} {r['train_seconds']:8.1f} {r['command_seconds']:10.1f} "
                  f"{'' if bleu is None else f'{bleu:10.2f}'}")
    if "textbook" in result:
        last = result["textbook"]["curve"][-1]
        print(f"textbook ({last['epoch']} epochs)        {last['train_seconds']:8.1f} "
              f"{result['textbook']['command_seconds']:10.1f} {last[args.test + '_bleu']:10.2f}")


if __name__ == "__main__":
    main()
