"""The output layer and cross-entropy as one operator (models/cross_entropy_kernel.py) give
``F.cross_entropy`` of the vocabulary's logits, values and gradients: on the CPU through Triton's
interpreter, and on a GPU compiled under bf16 autocast (where a large vocabulary takes the
operator); GPT's forward with ``labels`` returns the loss the language-modelling task computes from
its logits, and the trainer passes the labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_runs_interpreted

from gpuaccel.models import create_model
from gpuaccel.models.cross_entropy_kernel import linear_cross_entropy
from gpuaccel.tasks.language import LanguageModelling

# (rows, width, padded vocabulary rows, vocabulary): padding, no padding, rows of three blocks (of 4,096);
# then which vocabularies take the operator
_INTERPRETED_LOSS = r"""
import torch, torch.nn.functional as F
from gpuaccel.models import cross_entropy_kernel
generator = torch.Generator().manual_seed(0)
for rows, width, padded, vocab in [(37, 16, 64, 50), (9, 8, 7, 7), (3, 4, 9000, 8500)]:
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = torch.randn(padded, width, generator=generator, requires_grad=True)
    targets = torch.randint(vocab, (rows,), generator=generator)
    targets[1] = -100  # ignored, as F.cross_entropy ignores it
    targets[0] = vocab - 1  # the last column inside the vocabulary
    loss = cross_entropy_kernel.fused_linear_cross_entropy(hidden, weight, targets, vocab)
    got = torch.autograd.grad(loss * 0.5, (hidden, weight))
    ref = F.cross_entropy((hidden @ weight.T)[:, :vocab], targets)
    expected = torch.autograd.grad(ref * 0.5, (hidden, weight))
    torch.testing.assert_close(loss, ref)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e)
    assert got[1][vocab:].abs().max() == 0 if padded > vocab else True  # padding rows learn nothing
# linear_cross_entropy takes the operator from FUSED_FROM_VOCAB tokens up, PyTorch's loss below
fused, calls = cross_entropy_kernel.fused_linear_cross_entropy, []
cross_entropy_kernel.fused_linear_cross_entropy = lambda *args: calls.append(args[3]) or fused(*args)
for vocab in (cross_entropy_kernel.FUSED_FROM_VOCAB - 1, cross_entropy_kernel.FUSED_FROM_VOCAB):
    cross_entropy_kernel.linear_cross_entropy(torch.randn(2, 3, 4), torch.randn(vocab + 5, 4),
                                              torch.randint(vocab, (2, 3)), vocab)
assert calls == [cross_entropy_kernel.FUSED_FROM_VOCAB], calls
torch.library.opcheck(torch.ops.gpuaccel.linear_cross_entropy,
                      (torch.randn(6, 8, requires_grad=True), torch.randn(24, 8, requires_grad=True),
                       torch.randint(20, (6,)), 20))
print("loss ok")
"""


def test_the_interpreted_kernel_gives_cross_entropys_loss_and_gradients():
    assert_runs_interpreted(_INTERPRETED_LOSS, "loss ok")


def test_gpt_given_labels_returns_the_tasks_loss_of_its_logits_and_the_trainer_passes_them():
    from gpuaccel.tasks.base import takes_labels

    torch.manual_seed(0)
    model = create_model("gpt", vocab_size=30, context_length=16, layers=1, heads=2, width=16, pad_vocab=64)
    ids, labels = torch.randint(30, (2, 9)), torch.randint(30, (2, 9))
    own = model(ids, labels=labels)["loss"]
    own_grad = torch.autograd.grad(own, model.embedding.weight)[0]
    task = LanguageModelling().loss(model(ids), labels)
    task_grad = torch.autograd.grad(task, model.embedding.weight)[0]
    torch.testing.assert_close(own, task)
    torch.testing.assert_close(own_grad, task_grad)
    assert takes_labels(model)


@pytest.mark.gpu
def test_compiled_under_bf16_the_operator_matches_the_sliced_logits_loss():
    torch.manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", requires_grad=True)
    weight = (0.1 * torch.randn(20352, 256, device="cuda")).requires_grad_()
    targets = torch.randint(20319, (4096,), device="cuda")

    def reference(h, w, t):
        return F.cross_entropy(F.linear(h, w)[:, :20319].float(), t)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = torch.compile(linear_cross_entropy)(hidden, weight, targets, 20319)
        expected = torch.compile(reference)(hidden, weight, targets)
    got_grads = torch.autograd.grad(got, (hidden, weight))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=1e-3)
    for g, e in zip(got_grads, expected_grads):
        assert g.dtype == e.dtype == torch.float32
        torch.testing.assert_close(g, e, atol=1e-5, rtol=0.02)
    assert got_grads[1][20319:].abs().max() == 0
