"""Session 33: how far the folded Gram batch norm (ConvBatchNormAct.gram_forward) and the plain
modules land from fp64 under CPU autocast (bf16), for a widening 1x1 convolution with and without
a ReLU. Run from the repository root: python benchmarks/results/s33-cpu/scripts/fold_precision.py OUT.json"""
import json
import sys

sys.path[:0] = ["tests", "src"]
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from test_fast_layers import _after_one_step, _autocast, _twins  # noqa: E402

from gpuaccel.models import layers  # noqa: E402
from gpuaccel.models.layers import ConvBatchNormAct, conv_bn_act  # noqa: E402

layers.FUSED_BATCH_NORM = "gram"
rows = []
for act in (None, nn.ReLU):
    plain, _ = _twins(lambda: conv_bn_act(8, 32, 1, act=act), torch.float64)
    x = torch.randn(4, 8, 10, 10, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    grad = torch.randn(4, 32, 10, 10, dtype=torch.float64)
    state = {k: v.clone() for k, v in plain.state_dict().items()}
    exact = _after_one_step(plain, x, grad, nn.Sequential.forward)

    def run(forward):
        module = conv_bn_act(8, 32, 1, act=act).float().train()
        module.load_state_dict(state)
        return _after_one_step(module, x.float(), grad.float(), _autocast(forward, "cpu"))

    flat = lambda step: [step[0], step[1], *step[2], *step[3]]  # noqa: E731
    names = ["output", "input gradient", "weight gradient", "scale gradient", "shift gradient",
             "running mean", "running variance", "batches tracked"]
    for name, e, p, f in zip(names, flat(exact), flat(run(nn.Sequential.forward)), flat(run(ConvBatchNormAct.gram_forward))):
        e = e.double()
        rel = lambda t: round(((t.double() - e).norm() / e.norm().clamp_min(1e-30)).item(), 5)  # noqa: E731
        rows.append({"activation": "relu" if act else "none", "tensor": name, "plain_bf16": rel(p), "folded_bf16": rel(f)})
result = {"torch": torch.__version__, "what": "relative L2 distance from fp64, CPU autocast bf16", "rows": rows}
json.dump(result, open(sys.argv[1], "w"), indent=1)
for r in rows:
    print(r)
