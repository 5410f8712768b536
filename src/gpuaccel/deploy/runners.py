"""One interface over every form a model can take: ``runner(inputs) -> logits``.

``inputs`` are what the model takes, as numpy: an image classifier float32 images (N, C, H, W)
in [0, 1], a text classifier int64 token ids (N, T), an audio classifier float32 waveforms
(N, samples); ``runner.inputs`` describes them (:func:`input_description`). Logits come back as
float32 numpy.
A gpuaccel checkpoint runs in PyTorch; ``.onnx`` in ONNX Runtime, or in OpenVINO on the CPU;
``.pt2`` through torch.export; ``.ts`` / ``.torchscript`` through TorchScript. On a GPU,
``.onnx`` needs onnxruntime-gpu, which uses the CUDA and cuDNN libraries PyTorch has already
loaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..errors import GpuaccelError, choice_error
from ..tasks import SCENE_TASKS, Classification, Task, task_of

FORMAT_SUFFIX = {"onnx": ".onnx", "pt2": ".pt2", "torchscript": ".ts"}
ONNX_RUNTIMES = ("onnxruntime", "openvino")


@dataclass
class Runner:
    run: Callable[[np.ndarray], np.ndarray]
    classes: list[str]
    inputs: dict  # what the model takes (input_description)
    kind: str  # what runs it: pytorch, onnxruntime, openvino, torch.export, torchscript
    task: Task = field(default_factory=Classification)  # decodes the outputs (task.predict)

    def __call__(self, inputs: np.ndarray) -> np.ndarray:
        inputs = np.ascontiguousarray(inputs)
        return self.run(inputs.astype(np.float32, copy=False) if inputs.dtype.kind == "f" else inputs)

    @property
    def scales_images(self) -> bool:
        """Whether ``run`` takes uint8 images as stored and scales them to [0, 1] itself, on its
        device (PyTorch's runners): a quarter of the bytes cross to the GPU, and the host does
        not convert 50 M pixels per batch of 1,024 128-px images."""
        return self.kind in ("pytorch", "torch.export", "torchscript")

    @property
    def modality(self) -> str:
        return self.inputs["modality"]

    @property
    def in_channels(self) -> int:
        return self.inputs["in_channels"]

    @property
    def image_size(self) -> int:
        return self.inputs["image_size"]


def input_description(meta: dict) -> dict:
    """What a model takes, from its artefact's .json or a run's checkpoint state: {"modality":
    "text", "tokenizer", "max_tokens"}, {"modality": "audio", "sample_rate", "clip_samples"} or
    {"modality": "image", "in_channels", "image_size"}. KeyError where a key is missing."""
    if meta.get("tokenizer"):
        return {"modality": "text", "tokenizer": meta["tokenizer"], "max_tokens": meta["max_tokens"]}
    if meta.get("clip_samples") or meta.get("audio"):
        audio = meta.get("audio") or meta
        return {"modality": "audio", "sample_rate": audio["sample_rate"], "clip_samples": audio["clip_samples"]}
    return {"modality": "image", "in_channels": meta["in_channels"], "image_size": meta["image_size"]}


def metadata_path(artifact: Path) -> Path:
    return artifact.with_name(artifact.name + ".json")


def torch_runner(module, device: torch.device, set_eval: bool = True):
    """``run(images) -> logits`` for a PyTorch module on ``device`` (numpy in, numpy out)."""
    module = module.to(device)
    if set_eval:  # an exported program is already in inference form and refuses .eval()
        module.eval()

    @torch.no_grad()
    def run(images):
        x = torch.from_numpy(images).to(device)
        if x.dtype == torch.uint8:  # (images as stored: scaled here, as images_for_model does on the host)
            x = x.float().div_(255.0)
        return module(x).float().cpu().numpy()
    return run


def exported_on(program: "torch.export.ExportedProgram", device: torch.device) -> torch.nn.Module:
    """An exported program's module on ``device``. ``.to(device)`` moves its weights but not the
    devices its graph was traced with (its tensor checks and new tensors): a program exported on
    the CPU and run on a GPU failed with "Tensor device mismatch! Expected: cpu". PyTorch's
    ``move_to_device_pass`` rewrites those too."""
    from torch.export.passes import move_to_device_pass

    return move_to_device_pass(program, device).module()


def check_runtime(runtime: str) -> None:
    if runtime not in ONNX_RUNTIMES:
        raise choice_error("runtime", runtime, ONNX_RUNTIMES)


def load_runner(path, device: str = "cpu", threads: int | None = None, runtime: str = "onnxruntime") -> Runner:
    """``threads``: CPU threads of the ONNX runtime (default: its own choice, every core);
    PyTorch's CPU threads are set with ``torch.set_num_threads``. ``runtime``: what runs
    ``.onnx`` files, one of ``ONNX_RUNTIMES``."""
    path = Path(path)
    check_runtime(runtime)
    if runtime != "onnxruntime" and path.suffix != ".onnx":
        raise GpuaccelError(f"--runtime {runtime} runs .onnx files; {path.name} is not one "
                            f"(make one with 'gpuaccel export --format onnx')")
    if not path.exists():
        raise GpuaccelError(f"model file {path} does not exist")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise GpuaccelError(f"--device {device} was asked for but no CUDA GPU is visible; use --device cpu")
    if path.is_dir() or path.suffix == ".pt":
        return _run_runner(path, dev)
    meta_file = metadata_path(path)
    if not meta_file.exists():
        raise GpuaccelError(f"{path} has no {meta_file.name} beside it (class names, input size); "
                            f"export models with 'gpuaccel export'")
    try:
        meta = json.loads(meta_file.read_text())
        meta["classes"]  # noqa: B018  (it must be there)
        inputs = input_description(meta)
    except (ValueError, KeyError, TypeError, AttributeError):
        raise GpuaccelError(f"{meta_file} is damaged (not the JSON 'gpuaccel export' writes); export the model "
                            f"again") from None
    task = task_of(meta.get("task"))
    if path.suffix == ".onnx":
        run = openvino_runner(path, dev, threads) if runtime == "openvino" else _onnx_runner(path, dev, threads)
        kind = runtime
    elif path.suffix == ".pt2":
        try:
            program = torch.export.load(str(path))
        except Exception as exc:  # torch raises several types for a damaged archive
            raise GpuaccelError(f"{path} is not a readable torch.export (.pt2) file ({type(exc).__name__})") from None
        run, kind = torch_runner(exported_on(program, dev), dev, set_eval=False), "torch.export"
    elif path.suffix in (".ts", ".torchscript"):
        try:
            module = torch.jit.load(str(path), map_location=dev)
        except Exception as exc:
            raise GpuaccelError(f"{path} is not a readable TorchScript file ({type(exc).__name__})") from None
        run, kind = torch_runner(module, dev), "torchscript"
    else:
        raise GpuaccelError(f"cannot run {path}: expected a gpuaccel checkpoint (.pt), .onnx, .pt2 or .ts")
    return Runner(run, meta["classes"], inputs, kind, task)


def _run_runner(path: Path, device: torch.device) -> Runner:
    """A run's classifier (image, text or audio) in PyTorch on ``device``."""
    from .artifact import load_run_state, load_trained, max_tokens, rebuild_model, run_kind

    if run_kind(path) in ("image", *SCENE_TASKS):
        trained = load_trained(path)
        inputs = {"modality": "image", "in_channels": trained.in_channels, "image_size": trained.image_size}
        return Runner(torch_runner(trained.task.deployed(trained.module), device), trained.classes, inputs, "pytorch",
                      trained.task)
    state, path = load_run_state(path)
    if not state.get("classes"):
        raise GpuaccelError(f"{path} is not a classifier (task {state.get('task', {}).get('name')!r})" + (
            "; it is a language model: sample from it with 'gpuaccel generate'" if state.get("tokenizer") else ""))
    inputs = input_description({**state, "max_tokens": max_tokens(state) if state.get("tokenizer") else None})
    task = task_of(state.get("task"))
    return Runner(torch_runner(rebuild_model(state, path), device), list(state["classes"]), inputs, "pytorch", task)


def onnx_has_cuda() -> bool:
    """Whether the installed ONNX Runtime can run on NVIDIA GPUs (the onnxruntime-gpu build)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return False
    return "CUDAExecutionProvider" in ort.get_available_providers()


def cuda_provider(device: torch.device, cuda_graph: bool = False) -> tuple[str, dict]:
    """onnxruntime-gpu's CUDA provider with its options for ``device``.

    prefer_nhwc: channels-last convolutions, the layout the GPU's tensor cores convolve fastest
    (docs/results.md, "Deployment"). The ordinal is torch's, so "cuda" means the same GPU for
    every kind of model; device_id 0 is the provider's default and is left out, as onnxruntime
    1.31 logs a warning about plugin devices whenever it is given. cuda_graph: the session
    captures its first run as a CUDA graph and replays it, which needs inputs and outputs bound
    to fixed GPU memory (one session per input shape).
    """
    options = {"prefer_nhwc": "1"}
    if cuda_graph:
        options["enable_cuda_graph"] = "1"
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index:
        options["device_id"] = str(index)
    return "CUDAExecutionProvider", options


def _onnx_runner(path: Path, device: torch.device, threads: int | None = None):
    try:
        import onnxruntime as ort
    except ImportError:
        raise GpuaccelError("running .onnx files needs onnxruntime: pip install 'gpuaccel[deploy]'") from None
    providers = ["CPUExecutionProvider"]
    if device.type == "cuda":
        if not onnx_has_cuda():
            raise GpuaccelError(f"running {path.name} on {device} needs onnxruntime-gpu (the installed onnxruntime "
                                f"has only its CPU provider): pip install 'gpuaccel[deploy-gpu]', or use --device cpu")
        providers.insert(0, cuda_provider(device))
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    try:
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception classes for bad files
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise GpuaccelError(f"{path} is not a valid ONNX model ({first})") from None
    if device.type == "cuda" and "CUDAExecutionProvider" not in session.get_providers():
        # onnxruntime falls back to the CPU when its CUDA libraries fail to load, and only logs it
        raise GpuaccelError(f"onnxruntime-gpu could not start its CUDA provider for {path.name} (its log above "
                            f"says why; usually CUDA or cuDNN libraries it cannot find); use --device cpu")
    name = session.get_inputs()[0].name
    return lambda images: session.run(None, {name: images})[0]


def openvino_version() -> str | None:
    try:
        import openvino
    except ImportError:
        return None
    return openvino.__version__.split("-")[0]


def openvino_runner(path: Path, device: torch.device = torch.device("cpu"), threads: int | None = None):
    """OpenVINO on the CPU. int8 QDQ models run with int8 kernels (VNNI / AMX where the CPU has
    them). The precision hint is f32: by default OpenVINO computes fp32 models in bf16 on CPUs
    with bf16 instructions, which is not the model that was exported and verified.

    A dynamic-batch model is compiled once per input shape, with that shape fixed: OpenVINO's
    kernels for a fixed shape are faster than its dynamic-shape ones.
    """
    if device.type != "cpu":
        raise GpuaccelError("--runtime openvino runs on the CPU here (its GPU plugin is for Intel GPUs); "
                            "use --device cpu, or --runtime onnxruntime on NVIDIA GPUs")
    try:
        import openvino as ov
    except ImportError:
        raise GpuaccelError("--runtime openvino needs OpenVINO: pip install 'gpuaccel[openvino]'") from None
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    if threads:
        config["INFERENCE_NUM_THREADS"] = threads
    core = ov.Core()
    try:
        model = core.read_model(str(path))
    except Exception as exc:
        raise _openvino_error(path, exc) from None
    dynamic = model.inputs[0].partial_shape.is_dynamic
    requests = {}  # input shape (None for a fixed-shape model) -> request of the model compiled for it

    def request_for(shape):
        key = shape if dynamic else None
        if key not in requests:
            if dynamic:
                model.reshape(list(shape))
            try:
                requests[key] = core.compile_model(model, "CPU", config).create_infer_request()
            except Exception as exc:
                raise _openvino_error(path, exc) from None
        return requests[key]

    def run(images):
        request = request_for(images.shape)
        # the tensor API, not request.infer([images]): that builds a result dict on every call,
        # about 0.1 ms, which is most of a small model's batch-1 time
        request.set_input_tensor(ov.Tensor(images, shared_memory=True))
        request.infer()
        return request.get_output_tensor().data.copy()  # the request reuses its output buffer
    return run


def _openvino_error(path: Path, exc: Exception) -> GpuaccelError:
    # OpenVINO's report names where it was raised on each line, then, last, what went wrong
    lines = [line for line in str(exc).splitlines() if line.strip() and not line.startswith("Exception from")]
    reason = lines[-1].strip()[:200] if lines else type(exc).__name__
    return GpuaccelError(f"OpenVINO cannot read or compile {path} ({reason})")


def inference_device(model, asked: str = "auto", runtime: str = "onnxruntime") -> str:
    """Where ``infer`` runs ``model``: what was asked for, else a CUDA GPU when there is one and
    the model's runtime can use it (ONNX files need onnxruntime-gpu), else the CPU."""
    if asked != "auto":
        return asked
    from ..device import resolve_device

    gpu = resolve_device("auto").type == "cuda"
    usable = not str(model).endswith(".onnx") or (runtime == "onnxruntime" and onnx_has_cuda())
    return "cuda" if gpu and usable else "cpu"
