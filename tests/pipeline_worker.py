"""One process of a 2-stage pipeline fed a batch that is a view with gaps between its rows (the
tokens of a language-model batch are x = window[:, :-1]), for training and for evaluation.

    torchrun --nproc-per-node 2 tests/pipeline_worker.py
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from gpuaccel.parallel.pipeline import Pipeline

torch.distributed.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
pipe = Pipeline(model, stages=2, microbatches=2, schedule="gpipe", split_points=["2"], device=torch.device("cpu"),
                input_shape=(8,), batch_size=8, eval_batch_size=8, channels_last=False, loss_fn=F.cross_entropy)
windows = torch.randn(8, 9)
images, labels = windows[:, :-1], torch.randint(4, (8,))
assert not images.is_contiguous()
loss = pipe.train_step(images, labels)
out = pipe.logits(windows[:6, 1:])
if pipe.is_last:
    assert torch.isfinite(loss) and out.shape == (6, 4), (loss, out.shape)
torch.distributed.destroy_process_group()
