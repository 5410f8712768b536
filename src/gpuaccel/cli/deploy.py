"""The deployment commands: export, infer, generate, recommend, quantize, prune, bench-infer. Each
parses its options, calls the deploy API (``gpuaccel.deploy``) and prints what it returned."""

from __future__ import annotations

import contextlib
import json
import sys

from ..errors import GpuaccelError
from ..files import output_file


def add_deploy_parsers(sub) -> None:
    for add in (_export_parser, _infer_parser, _generate_parser, _translate_parser, _recommend_parser,
                _quantize_parser, _prune_parser, _bench_infer_parser):
        add(sub)


def _export_parser(sub) -> None:
    e = sub.add_parser("export", help="export a trained model (ONNX, torch.export, TorchScript) and verify it",
                       description="Export a trained model and verify the export: the original and the exported "
                                   "model run on real held-out images of the run's data set; the command fails "
                                   "(exit 1) if their top-1 predictions agree on fewer than 99.9% of them. The "
                                   "exported model takes float32 images in [0, 1] (normalisation is inside it); "
                                   "class names and input shape are written to <artefact>.json beside it. A text "
                                   "classifier exports as onnx or pt2 (token ids in, any batch and length), its "
                                   "tokeniser in the .json, verified on held-out sentences; an audio classifier "
                                   "as onnx or pt2 (waveforms in), verified on held-out recordings. A translation "
                                   "model exports as one archive (translator.zip: its encoder and decoder step as "
                                   "torch.export programs, and its tokeniser), verified by translating held-out "
                                   "sentences. 'gpuaccel infer' and 'gpuaccel quantize' take every artefact export "
                                   "writes.")
    e.add_argument("checkpoint", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    e.add_argument("--format", help="onnx (the default for classifiers, detectors and segmenters), pt2 "
                                    "(torch.export; a translation model's only format) or torchscript")
    e.add_argument("--out", metavar="PATH", help="where to write (default: next to the checkpoint)")
    e.add_argument("--static-batch", type=int, metavar="N",
                   help="fix the batch size at N, for runtimes that need static shapes (default: any batch size)")
    e.add_argument("--opset", type=int, metavar="N", help="ONNX opset version (default: the exporter's)")
    e.add_argument("--data", metavar="SPEC", help="verify on this data set's held-out split (default: the run's)")
    e.add_argument("--verify-images", "--verify", type=int, default=1000, metavar="N",
                   help="held-out images (sentences, recordings) to compare (1000)")
    e.add_argument("--keep-unverified", action="store_true",
                   help="keep an artefact that fails its verification (it is removed otherwise)")
    e.add_argument("--json", action="store_true", help="print the verification as JSON")
    e.set_defaults(handler=_run_export)


def _infer_parser(sub) -> None:
    i = sub.add_parser("infer", help="predict with a trained or exported model: classes of images, sentences or "
                                     "recordings, boxes (detection), masks (segmentation), translations",
                       description="Predict classes for image files, a folder of images, or a data set's held-out "
                                   "split (with its accuracy); or, with a detector, boxes (CSV, or JSON for --out "
                                   "*.json); with a segmenter, masks (one PNG per image in the --out folder); with "
                                   "a checkpoint (PyTorch), an .onnx file (ONNX Runtime), a .pt2 or a "
                                   ".ts file; or, with a run of a text classifier, for text files (a sentence per "
                                   "line) or a labelled .tsv/.csv/.jsonl (scored); with a run of an audio classifier, for WAV files "
                                   "and folders of them (the same with their exported or quantised files); with a "
                                   "translation model, text files, a translation per line (as 'gpuaccel "
                                   "translate'). Writes CSV "
                                   "(input, class_1, "
                                   "prob_1, ...) and prints latency statistics.")
    i.add_argument("model", metavar="MODEL", help="run directory, model.pt, .onnx, .pt2 or .ts")
    i.add_argument("inputs", nargs="+", metavar="INPUTS",
                   help="image files, a folder of images, or a data set spec; for a text classifier, text files or "
                        "a labelled sentences file or folder; for an audio classifier, WAV files or folders")
    i.add_argument("--device", default="auto",
                   help="auto (default: a CUDA GPU when there is one and the model's runtime can use it), cpu, "
                        "cuda or cuda:N")
    i.add_argument("--batch-size", "--batch", type=int, default=256, help="images per batch (default 256)")
    i.add_argument("--top-k", type=int, default=1, metavar="K", help="classes per image in the CSV (default 1)")
    i.add_argument("--out", metavar="PATH", help="write predictions here: a CSV (detection: CSV, or JSON for a .json "
                                                 "name; segmentation: a folder, one mask PNG per image; translation: "
                                                 "text) (default: standard output; an existing file only with --force; "
                                                 "a run's own files never)")
    i.add_argument("--force", action="store_true", help="replace an existing --out file")
    i.add_argument("--threads", type=int, metavar="N", help="CPU threads (default: every core)")
    i.add_argument("--runtime", default="onnxruntime",
                   help="what runs .onnx files: onnxruntime (default) or openvino (CPU only; needs gpuaccel[openvino])")
    i.add_argument("--skip-bad", action="store_true",
                   help="leave out files that cannot be read (each is named), instead of stopping at the first one")
    i.add_argument("--score", type=float, default=0.3, metavar="S",
                   help="detection: report boxes scored at least S (default 0.3)")
    i.add_argument("--iou", type=float, default=0.5, metavar="T",
                   help="detection: drop a box overlapping a better one of its class by more than T (default 0.5)")
    i.add_argument("--overlay", metavar="DIR",
                   help="detection and segmentation: also write each image with its boxes or mask drawn on it here")
    i.set_defaults(handler=_run_infer)


def _generate_parser(sub) -> None:
    g = sub.add_parser("generate", help="sample text from a trained language model",
                       description="Continue a prompt with a language model trained by 'gpuaccel train' on text "
                                   "(a key/value cache makes each new token one position's work); prints the "
                                   "text, and the speed in tokens per second on standard error.")
    g.add_argument("run", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    g.add_argument("--prompt", default="\n", metavar="TEXT", help="the text to continue (default: a new line)")
    g.add_argument("--tokens", type=int, default=500, metavar="N", help="tokens to generate (default 500)")
    g.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="sampling temperature; 0 takes the most likely token (default 0.8)")
    g.add_argument("--top-k", type=int, default=200, metavar="K",
                   help="sample among the K most likely tokens (default 200; 0: all)")
    g.add_argument("--samples", type=int, default=1, metavar="S", help="independent continuations (default 1)")
    g.add_argument("--seed", type=int, default=0, help="seeds the sampling (default 0)")
    g.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    g.add_argument("--no-cache", action="store_true",
                   help="recompute the whole context for every token (for comparison; slower)")
    g.add_argument("--json", action="store_true", help="print the texts and the speed as JSON")
    g.set_defaults(handler=_run_generate)


def _translate_parser(sub) -> None:
    t = sub.add_parser("translate", help="translate text with a trained translation model (or its export)",
                       description="Translate a file (or standard input), a sentence per line, with a model trained "
                                   "by 'gpuaccel train' on sentence pairs, or its export (translator.zip). Writes one "
                                   "translation per input line, in order; an empty line gives an empty line. Lines "
                                   "are read and written in chunks, so any length of input fits in memory. With "
                                   "--reference, prints sacreBLEU's BLEU and chrF (cased, detokenized) and their "
                                   "signatures on standard error.")
    t.add_argument("model", metavar="MODEL", help="a run directory, its model.pt / best.pt, or translator.zip")
    t.add_argument("input", nargs="?", default="-", metavar="FILE", help="the text to translate (default: - , "
                                                                           "standard input)")
    t.add_argument("--out", metavar="FILE", help="write the translations here (default: standard output; an existing "
                                                 "file only with --force)")
    t.add_argument("--force", action="store_true", help="replace an existing --out file")
    t.add_argument("--beam", type=int, metavar="K", help="beam size (default: the run's; 1: greedy)")
    t.add_argument("--length-penalty", type=float, metavar="P",
                   help="rank hypotheses by log-probability / length ** P (default: the run's)")
    t.add_argument("--batch-tokens", type=int, default=16384, metavar="N",
                   help="source tokens x beam per decoding batch (default 16384)")
    t.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    t.add_argument("--reference", metavar="FILE", help="score the translations against these reference lines")
    t.add_argument("--json", action="store_true", help="print the statistics (and scores) as JSON on standard error")
    t.set_defaults(handler=_run_translate)


def _recommend_parser(sub) -> None:
    r = sub.add_parser("recommend", help="the items a trained rating model predicts a user will rate highest",
                       description="Score every item the user has not rated in the run's training data with a "
                                   "model trained by 'gpuaccel train' on ratings; print the best, with titles "
                                   "where the data has them (MovieLens' u.item, movies.dat or movies.csv).")
    r.add_argument("run", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    r.add_argument("--user", required=True, help="the user's id, as in the ratings file")
    r.add_argument("--top", type=int, default=10, metavar="K", help="how many items (default 10)")
    r.add_argument("--include-rated", action="store_true", help="also rank the items the user rated in training")
    r.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    r.add_argument("--json", action="store_true", help="print the list as JSON")
    r.set_defaults(handler=_run_recommend)


def _quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="int8 (calibrated, ONNX Runtime) or fp16 ONNX models, with a report",
                       description="Quantise a trained model (a checkpoint, or an .onnx made by 'gpuaccel export'): "
                                   "--int8 with ONNX Runtime's static quantisation, calibrated on N real training "
                                   "samples (images, sentences or recordings), or --fp16 for GPU runtimes; reports "
                                   "size, held-out accuracy and latency before and after (on the GPU for --fp16 where onnxruntime-gpu can use one).")
    q.add_argument("model", metavar="RUN|MODEL.onnx", help="a run directory (or its model.pt), or an .onnx file "
                                                           "made by 'gpuaccel export'")
    q.add_argument("--int8", action="store_true", help="weights int8, activations uint8 (QDQ), for CPUs")
    q.add_argument("--fp16", action="store_true",
                   help="weights and compute in fp16, inputs and outputs float32, for GPU runtimes")
    q.add_argument("--calib", type=int, default=512, metavar="N", help="calibration samples (default 512)")
    q.add_argument("--per-channel", action="store_true", help="one weight scale per output channel")
    q.add_argument("--data", metavar="SPEC", help="the data set (default: the run's)")
    q.add_argument("--out", metavar="PATH", help="default: model.int8.onnx or model.fp16.onnx beside the checkpoint")
    q.add_argument("--device", metavar="DEV", help="where to evaluate and time the models: cpu or cuda[:N] (default: "
                                                   "cuda for --fp16 where onnxruntime-gpu and a GPU are present, else cpu)")
    q.add_argument("--runtime", default="onnxruntime",
                   help="what evaluates and times the models: onnxruntime (default) or openvino (CPU only)")
    q.add_argument("--json", action="store_true", help="print the report as JSON")
    q.set_defaults(handler=_run_quantize)


def _prune_parser(sub) -> None:
    p = sub.add_parser("prune", help="prune a trained model (weights or whole channels), fine-tune, report",
                       description="Prune a trained model: --structured removes whole channels with torch-pruning "
                                   "(the model gets smaller and faster), otherwise the smallest weights are zeroed. "
                                   "Optionally fine-tunes with the training engine on the run's data. Writes a run "
                                   "directory (model.pt, prune.json) usable by export, quantize, infer; reports "
                                   "parameters, FLOPs, file size, held-out accuracy and CPU latency before and after.")
    p.add_argument("checkpoint", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    p.add_argument("--sparsity", type=float, default=0.5,
                   help="share of weights (or, with --structured, of each layer's channels) to remove (default 0.5)")
    p.add_argument("--structured", action="store_true", help="remove whole channels (needs torch-pruning)")
    p.add_argument("--finetune-epochs", type=float, default=0, metavar="E",
                   help="train E epochs after pruning (a fraction: part of one)")
    p.add_argument("--lr", type=float, help="fine-tuning peak learning rate (default: half the run's)")
    p.add_argument("--data", metavar="SPEC", help="the data set (default: the run's)")
    p.add_argument("--out", metavar="DIR", help="default: pruned-<method>-<sparsity>/ beside the checkpoint")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(handler=_run_prune)


def _bench_infer_parser(sub) -> None:
    b = sub.add_parser("bench-infer", help="inference latency and throughput on every backend available",
                       description="Batch-1 latency (p50/p90/p99) and best-batch throughput of a trained model: "
                                   "PyTorch eager on the CPU, ONNX Runtime (and, where installed, OpenVINO) fp32 and "
                                   "int8 on the CPU, and on a GPU "
                                   "PyTorch fp32, bf16 and bf16 compiled with CUDA graphs, and (with onnxruntime-gpu) "
                                   "ONNX Runtime fp32, fp16 and fp16 with CUDA graphs.")
    b.add_argument("model", metavar="RUN", help="a run directory, or its model.pt / checkpoint.pt")
    b.add_argument("--data", metavar="SPEC", help="calibration data for the int8 row (default: the run's)")
    b.add_argument("--repeats", type=int, default=200, help="timed batch-1 calls (default 200)")
    b.add_argument("--threads", type=int, metavar="N",
                   help="CPU threads of the CPU backends (default: every core); small models at batch 1 are "
                        "often fastest on a few")
    b.add_argument("--json", action="store_true", help="print the results as JSON")
    b.set_defaults(handler=_run_bench_infer)


def _run_quantize(args) -> int:
    from ..deploy.quantize import quantize_model

    if args.int8 == args.fp16:
        raise GpuaccelError("say what to quantise to: --int8 (CPU) or --fp16 (GPU runtimes), one of them")
    kind = "int8" if args.int8 else "fp16"
    say = None if args.json else (lambda line: print(f"gpuaccel: {line} ...", file=sys.stderr, flush=True))
    report = quantize_model(args.model, kind, calibration_samples=args.calib, per_channel=args.per_channel,
                            data=args.data, out=args.out, device=args.device, runtime=args.runtime, say=say)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name in ("fp32", kind):
        r = report[name]
        print(f"{name}: {r['size_bytes'] / 1e6:.2f} MB, test accuracy {100 * r['test_accuracy']:.2f}%, "
              f"batch-1 latency in {args.runtime} on {report['device']} {r['latency_p50_ms']:.3f} ms, "
              f"{r['best_images_per_second']:,.0f} {report['unit']}/s")
    if kind == "fp16" and report["device"] == "cpu":
        print("fp16 is for GPU runtimes (onnxruntime-gpu, TensorRT); ONNX Runtime's CPU kernels are fp32 at heart")
    print(f"saved {report['artifact']}")
    return 0


def _run_prune(args) -> int:
    from ..deploy.artifact import load_trained
    from ..deploy.prune import prune_trained

    trained = load_trained(args.checkpoint)
    data = trained.load_data(args.data, "no data to evaluate and fine-tune the pruned model with")
    report = prune_trained(trained, data, sparsity=args.sparsity, structured=args.structured,
                           finetune_epochs=args.finetune_epochs, lr=args.lr, out_dir=args.out, quiet=args.json)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name in ("before", "after"):
        r = report[name]
        print(f"{name:6s}: {r['parameters']:,} parameters ({r['nonzero_parameters']:,} non-zero), "
              f"{r['flops_per_image'] / 1e6:,.1f} MFLOP/image, {r['file_bytes'] / 1e6:.2f} MB, "
              f"test accuracy {100 * r['test_accuracy']:.2f}%, CPU batch-1 {r['latency_p50_ms']:.3f} ms, "
              f"{r['best_images_per_second']:,.0f} images/s")
    print(f"{report['method']} pruning at {report['sparsity']:g}: accuracy {100 * report['pruned_accuracy']:.2f}% "
          f"before fine-tuning; CPU batch-1 speed {report['speedup_batch1']:.2f}x the original "
          f"({report['speedup_batch1_min']:.2f}-{report['speedup_batch1_max']:.2f} over "
          f"{report['speedup_batch1_rounds']} alternating rounds), throughput {report['speedup_throughput']:.2f}x; "
          f"saved {report['out']}")
    return 0


def _run_bench_infer(args) -> int:
    from ..deploy.artifact import load_trained
    from ..deploy.bench import bench_inference
    from ..deploy.quantize import calibration_sample

    trained = load_trained(args.model)
    calibration = None
    try:
        calibration = calibration_sample(trained.load_data(args.data, "no calibration data").train_images, 256)
    except GpuaccelError as exc:
        print(f"gpuaccel: note: no int8 row ({exc})", file=sys.stderr)
    if args.threads is not None and args.threads < 1:
        raise GpuaccelError("--threads must be at least 1")
    result = bench_inference(trained, calibration, repeats=args.repeats, threads=args.threads)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{trained.model_name}, {trained.image_size} px; CPU {result['cpu']} ({result['cpu_threads']} threads)"
          + (f"; GPU {result['gpu']}" if result["gpu"] else ""))
    width = max(len(r["backend"]) for r in result["rows"])
    print(f"{'backend':{width}s} {'p50 ms':>8s} {'p90 ms':>8s} {'p99 ms':>8s} {'best img/s':>12s}")
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['backend']:{width}s} failed: {r['error']}")
        else:
            print(f"{r['backend']:{width}s} {r['latency_p50_ms']:8.3f} {r['latency_p90_ms']:8.3f} "
                  f"{r['latency_p99_ms']:8.3f} {r['best_images_per_second']:12,.0f}")
    return 0


def _run_export(args) -> int:
    from ..deploy.exports import export_run

    report, what = export_run(args.checkpoint, args.format, args.out, data=args.data, verify_count=args.verify_images,
                              static_batch=args.static_batch, opset=args.opset, keep_unverified=args.keep_unverified)
    return _export_report(args, report, f"held-out {what}", report[what])


def _export_report(args, report: dict, what: str, count: int) -> int:
    if args.json:
        print(json.dumps(report, indent=2))
    elif "max_box_diff" in report:  # a detector
        print(f"exported {report['artifact']} ({report['size_bytes'] / 1e6:.2f} MB); on {count} {what}: "
              f"{report['detections_compared']} detections, boxes within {report['max_box_diff']:.2e} px; after "
              f"NMS {report['boxes_after_nms']} boxes, within {report['max_box_diff_after_nms']:.2e} px")
    elif "same_translations" in report:  # a translation model
        print(f"exported {report['artifact']} ({report['size_bytes'] / 1e6:.2f} MB); on {count} {what}: "
              f"{100 * report['same_translations']:.1f}% of the translations the same, BLEU "
              f"{report['bleu_export']:.2f} against {report['bleu_original']:.2f} in PyTorch")
    elif "pixel_agreement" in report:  # a segmenter
        print(f"exported {report['artifact']} ({report['size_bytes'] / 1e6:.2f} MB); on {count} {what}: class maps "
              f"agree on {100 * report['pixel_agreement']:.3f}% of pixels, max |diff| {report['max_abs_diff']:.2e}")
    else:
        print(f"exported {report['artifact']} ({report['size_bytes'] / 1e6:.2f} MB); on {count} {what}: "
              f"top-1 agreement {100 * report['top1_agreement']:.2f}%, max |diff| {report['max_abs_diff']:.2e}, "
              f"mean |diff| {report['mean_abs_diff']:.2e}")
    if not report["passed"]:
        reason = ("boxes further than 1e-3 px apart or different after NMS" if "max_box_diff" in report else
                  "under 99% of the translations the same, or BLEU more than 0.1 apart" if "same_translations" in report
                  else "the outputs differ by more than 1% of their size" if not report.get("outputs_close", True)
                  else
                  "class maps agree on under 99.9% of pixels" if "pixel_agreement" in report else
                  "top-1 agreement under 99.9%")
        kept = "removed it (--keep-unverified keeps it)" if report.get("removed") else "kept it (--keep-unverified)"
        print(f"gpuaccel: export verification FAILED: {reason}; {kept}", file=sys.stderr)
        return 1
    return 0


def _run_generate(args) -> int:
    from ..deploy.text import generate

    result = generate(args.run, args.prompt, args.tokens, temperature=args.temperature, top_k=args.top_k or None,
                      samples=args.samples, device=args.device, seed=args.seed, use_cache=not args.no_cache)
    speed = (f"{result.new_tokens} tokens x {len(result.texts)} sample(s) in {result.seconds:.2f} s on "
             f"{result.device}: {result.tokens_per_second:,.0f} tokens/s")
    if args.json:
        print(json.dumps({"texts": result.texts, "new_tokens": result.new_tokens, "seconds": round(result.seconds, 4),
                          "tokens_per_second": round(result.tokens_per_second, 1), "device": result.device}))
    else:
        print("\n---\n".join(result.texts))
        print(f"gpuaccel: {speed}", file=sys.stderr)
    return 0


def _run_recommend(args) -> int:
    from dataclasses import asdict

    from ..deploy.recommend import recommend

    items = recommend(args.run, args.user, args.top, device=args.device, include_rated=args.include_rated)
    if args.json:
        print(json.dumps([asdict(i) for i in items], indent=1))
    else:
        for rank, item in enumerate(items, 1):
            print(f"{rank:3d}. {item.title or item.item}  (item {item.item}, score {item.score:.2f})")
    return 0


def _run_infer(args) -> int:
    from ..deploy.infer import Latency, predict, predictions_csv, read_inputs
    from ..deploy.runners import inference_device, load_runner

    if args.batch_size < 1 or args.top_k < 1:
        raise GpuaccelError("--batch-size and --top-k must be at least 1")
    if args.threads is not None:
        import torch

        if args.threads < 1:
            raise GpuaccelError("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    from ..tasks import SCENE_TASKS

    if _is_translation(args.model):  # text in, text out: as 'gpuaccel translate', over every input in order
        return _translate(args.model, args.inputs, out=args.out, device=args.device, batch_tokens=16384,
                          force=args.force)
    args.device = inference_device(args.model, args.device, args.runtime)
    runner = load_runner(args.model, args.device, threads=args.threads, runtime=args.runtime)
    if args.out and runner.task.name != "segmentation":  # before any work: a run that cannot write is wasted
        output_file(args.out, force=args.force)
    if runner.task.name in SCENE_TASKS:
        return _infer_scenes(args, runner)
    inputs = read_inputs(runner, args.inputs, skip_bad=args.skip_bad)
    latency, count, correct, labelled = Latency(), 0, 0, True
    with _output(args.out) as write:  # rows written as each chunk is done, in input order
        for chunk in inputs.chunks():
            probs, _ = predict(runner, chunk.samples, args.batch_size, inputs.prepare, latency=latency)
            write(predictions_csv(chunk.names, probs, runner.classes, args.top_k, header=count == 0))
            count += len(chunk.names)
            labelled = labelled and chunk.labels is not None
            if chunk.labels is not None:
                correct += int((probs.argmax(1) == chunk.labels).sum())
        if count == 0:
            raise GpuaccelError(f"no readable {inputs.unit} in {', '.join(args.inputs)}")
    skipped = [n for n in inputs.notes if n.startswith("skipped ")]  # each named; other notes, the first few
    for note in skipped + [n for n in inputs.notes if not n.startswith("skipped ")][:5]:
        print(f"gpuaccel: {note}", file=sys.stderr)
    unit, stats = inputs.unit, latency.summary(args.batch_size)
    line = (f"{counted(count, unit)} with {runner.kind} on {args.device}: "
            f"{stats['samples_per_second']:,.0f} {unit}/s, batch latency median {stats['latency_median_ms']:.2f} ms, "
            f"p90 {stats['latency_p90_ms']:.2f} ms")
    if labelled:
        line += f"; accuracy {100 * correct / count:.2f}%" + (f" on {inputs.split}" if inputs.split else "")
    print(line, file=sys.stderr)
    return 0


def _infer_scenes(args, runner) -> int:
    """Boxes (CSV, or JSON for an --out ending in .json) or masks (PNG files in the --out folder),
    chunk by chunk."""
    from pathlib import Path

    from ..deploy import vision
    from ..deploy.infer import Latency

    detection = runner.task.name == "detection"
    if not detection and not args.out:
        raise GpuaccelError("a segmentation model writes one mask PNG per image: give --out DIR")
    if not detection and Path(args.out).is_file():
        raise GpuaccelError(f"--out {args.out} is a file; a segmentation model writes its masks into a folder")
    chunks = vision.read_scene_inputs(runner, args.inputs, skip_bad=args.skip_bad)
    as_json = str(args.out).endswith(".json")
    latency, images, boxes = Latency(), 0, 0
    with (_output(args.out) if detection else contextlib.nullcontext(None)) as write:
        table = vision.DetectionsWriter(write, "json" if as_json else "csv") if detection else None
        for inputs in chunks():
            outputs, _ = vision.run_batches(runner, inputs.images, args.batch_size, latency)
            if detection:
                kept = vision.scaled_to_images(vision.kept_detections(outputs, args.score, args.iou), inputs.sizes,
                                               inputs.images.shape[2:])
                rows = vision.detections_table(inputs.names, kept, runner.classes)
                table.add(rows)
                boxes += len(rows)
                if args.overlay:
                    vision.draw_overlays(Path(args.overlay), inputs, runner.classes, kept=kept)
            else:
                maps = vision.class_maps(outputs, inputs.sizes)
                vision.write_masks(Path(args.out), inputs.names, maps)
                if args.overlay:
                    vision.draw_overlays(Path(args.overlay), inputs, runner.classes[1:], maps=maps)
            images += len(inputs.names)
        if table is not None:
            table.close()
    found = f"{boxes} boxes" if detection else f"masks in {args.out}"
    stats = latency.summary(args.batch_size)
    print(f"{counted(images, 'images')} with {runner.kind} on {args.device}: {found}; "
          f"{stats['samples_per_second']:,.0f} images/s at batch {args.batch_size}, batch latency median "
          f"{stats['latency_median_ms']:.2f} ms, p90 {stats['latency_p90_ms']:.2f} ms", file=sys.stderr)
    return 0


@contextlib.contextmanager
def _output(out: str | None):
    """``write(text)`` to ``out`` (a new file that replaces the old one only once it is whole) or
    standard output, as the text comes; a name that is not valid UTF-8 is written with its odd
    bytes escaped (\\udcXX)."""
    from pathlib import Path

    from ..files import replaced_atomically

    def escaped(text: str) -> str:
        return text.encode("utf-8", "backslashreplace").decode()

    if not out:
        yield lambda text: sys.stdout.write(escaped(text))
        sys.stdout.flush()
        return
    with replaced_atomically(Path(out)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        yield lambda text: f.write(escaped(text))


def counted(n: int, unit: str) -> str:
    """'1 image', '3 images', '1 sentence pair'."""
    return f"{n:,} {unit[:-1] if n == 1 and unit.endswith('s') else unit}"


def _is_translation(model: str) -> bool:
    from pathlib import Path

    from ..deploy.translation import is_translation_export

    path = Path(model)
    if is_translation_export(path):
        return True
    from ..deploy.artifact import load_run_state

    if not (path.is_dir() or path.suffix == ".pt"):
        return False
    try:
        return load_run_state(path)[0].get("data_kind") == "translation"
    except GpuaccelError:
        return False


def _run_translate(args) -> int:
    if args.batch_tokens < 1:
        raise GpuaccelError("--batch-tokens must be at least 1")
    return _translate(args.model, [args.input], out=args.out, device=args.device, beam_size=args.beam,
                      length_penalty=args.length_penalty, batch_tokens=args.batch_tokens, reference=args.reference,
                      as_json=args.json, force=args.force)


def _translate(model: str, inputs: list[str], *, out: str | None, device: str, batch_tokens: int, force: bool,
               reference: str | None = None, as_json: bool = False, **decoding) -> int:
    """Translates the lines of ``inputs`` (files, or - for standard input) in order into ``out``
    (or standard output), written as a new file that replaces any old one only when whole."""
    from pathlib import Path

    from ..deploy.translation import Translator, is_translation_export, read_lines, score
    from ..files import atomic_write

    if out:
        output_file(out, force=force)
    translator = (Translator.from_export if is_translation_export(model) else Translator.from_run)(
        model, device=device, **decoding)
    lines = read_lines(inputs)
    kept: list[str] = [] if reference else None

    def emit(write):
        def each(text):
            write(text + "\n")
            if kept is not None:
                kept.append(text)
        return translator.translate_stream(lines, each, batch_tokens)

    if out:
        stats = None

        def write_file(f):
            nonlocal stats
            stats = emit(lambda text: f.write(text.encode("utf-8")))
        atomic_write(Path(out), write_file)
    else:
        stats = emit(sys.stdout.write)
        sys.stdout.flush()
    report = {"lines": stats.lines, "target_tokens": stats.tokens, "seconds": round(stats.seconds, 3),
              "tokens_per_second": round(stats.tokens / stats.seconds, 1) if stats.seconds else None,
              "device": str(translator.device), "beam": translator.beam_size}
    if reference:
        refs = read_lines([reference])
        report.update(score(kept, [r.rstrip("\n").rstrip("\r") for r in refs]))
    for note in stats.notes:
        print(f"gpuaccel: {note}", file=sys.stderr)
    if as_json:
        print(json.dumps(report), file=sys.stderr)
    elif stats.lines == 0:
        print("gpuaccel: the input is empty: nothing to translate", file=sys.stderr)
    else:
        line = (f"gpuaccel: {stats.lines} lines, {stats.tokens} tokens in {stats.seconds:.2f} s on {translator.device}"
                f" (beam {translator.beam_size}): {report['tokens_per_second'] or 0:,.0f} tokens/s")
        if reference:
            line += (f"; BLEU {report['bleu']:.2f} ({report['bleu_signature']}), chrF {report['chrf']:.2f} "
                     f"({report['chrf_signature']})")
        print(line, file=sys.stderr)
    return 0
