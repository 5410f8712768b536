"""The output layer and cross-entropy as one operator (models/cross_entropy_kernel.py) give
``F.cross_entropy`` of the vocabulary's logits, values and gradients: on the CPU through Triton's
interpreter, and on a GPU compiled under bf16 autocast (where a large vocabulary takes the
operator); GPT's forward with ``labels`` returns the loss the language-modelling task computes from
its logits, and the trainer passes the labels."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_ran_interpreted, interpreted

from gpuaccel.models import create_model
from gpuaccel.models.cross_entropy_kernel import linear_cross_entropy
from gpuaccel.tasks.language import LanguageModelling

# (rows, width, padded vocabulary rows, vocabulary): padding, no padding, rows of three blocks (of 4,096);
# then which vocabularies take the operator
_INTERPRETED_LOSS = interpreted("cross-entropy", r"""
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
cross_entropy_kernel.fused_linear_cross_entropy = fused
torch.library.opcheck(torch.ops.gpuaccel.linear_cross_entropy,
                      (torch.randn(6, 8, requires_grad=True), torch.randn(24, 8, requires_grad=True),
                       torch.randint(20, (6,)), 20))
print("loss ok")
""")


# The FP8 operator (GPT's head_fp8): its loss is the cross-entropy of the FP8 operands' logits; its gradients are
# its own FP8 gradient of the logits, (softmax - one-hot) x GRAD_SCALE over the count, times those
# operands (Triton's interpreter rounds to FP8 without carrying into the exponent, so the
# interpreted FP8 gradient itself is checked against softmax only where it is exact, at zeros)
_INTERPRETED_FP8 = interpreted("cross-entropy in FP8", r"""
import torch, torch.nn.functional as F
from gpuaccel.models import cross_entropy_kernel as ck
generator = torch.Generator().manual_seed(0)
# (the row kernel's blocks of 1,024 columns: one, part-filled, then two; the transpose's 64 x 128 tiles: one, then 9)
for rows, width, padded, vocab in [(48, 32, 64, 50), (16, 16, 1152, 1100)]:
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = torch.randn(padded, width, generator=generator, requires_grad=True)
    targets = torch.randint(vocab, (rows,), generator=generator)
    targets[1], targets[0] = -100, vocab - 1
    loss = ck.fused_linear_cross_entropy(hidden, weight, targets, vocab, fp8=True)
    grads = torch.autograd.grad(loss * 0.5, (hidden, weight))
    op = torch.ops.gpuaccel.linear_cross_entropy_fp8
    _, grad8, grad8_t, count, hidden8, hidden_scale, weight8, weight_scale = op(hidden, weight, targets, vocab)
    h, w = hidden8.float() * hidden_scale, weight8.float() * weight_scale
    torch.testing.assert_close(loss, F.cross_entropy((h @ w.T)[:, :vocab], targets))
    assert count == rows - 1 and torch.equal(grad8.view(torch.uint8), grad8_t.T.view(torch.uint8))
    g = grad8.float() / (ck.GRAD_SCALE * count)
    torch.testing.assert_close(grads[0], 0.5 * g @ w)
    torch.testing.assert_close(grads[1], 0.5 * g.T @ h)
    assert g[1].abs().max() == 0 and g[:, vocab:].abs().max() == 0  # an ignored target, the padding
    kept = targets != -100  # (negative exactly at the targets: softmax - one-hot)
    assert torch.equal(g[kept, :vocab] < 0, F.one_hot(targets[kept], vocab).bool())
    assert (hidden8.float().abs().max(), weight8.float().abs().max()) == (448, 448)
assert not ck.fp8_usable(torch.zeros(8, 16), torch.zeros(32, 16))  # FP8 products need multiples of 16
# GPT's head_fp8 trains with the FP8 operator and evaluates with the other
from gpuaccel.models import create_model
fused, seen = ck.fused_linear_cross_entropy, []
ck.fused_linear_cross_entropy = lambda *args: seen.append(args[4]) or fused(*args)
model = create_model("gpt", vocab_size=1100, context_length=16, layers=1, heads=2, width=16, pad_vocab=64,
                     head_fp8=True)
ids = torch.randint(1100, (2, 8), generator=generator)
model(ids, labels=ids)["loss"].backward()
with torch.no_grad():
    model(ids, labels=ids)
assert seen == [True, False] and model.embedding.weight.grad.abs().sum() > 0, seen
ck.fused_linear_cross_entropy = fused
torch.library.opcheck(torch.ops.gpuaccel.linear_cross_entropy_fp8,
                      (torch.randn(16, 16, requires_grad=True), torch.randn(32, 16, requires_grad=True),
                       torch.randint(20, (16,)), 20),
                      test_utils="test_faketensor")  # (the other checks sum FP8 outputs: not on CPUs)
print("fp8 ok")
""")


def test_the_interpreted_kernel_gives_cross_entropys_loss_and_gradients(interpreted_runs):
    assert_ran_interpreted(interpreted_runs, _INTERPRETED_LOSS, "loss ok")


def test_the_interpreted_fp8_operator_assembles_its_loss_and_gradients_from_its_fp8_operands(interpreted_runs):
    assert_ran_interpreted(interpreted_runs, _INTERPRETED_FP8, "fp8 ok")


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


def gpu_case() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden states, an output layer's weight padded from 20,319 to 20,352 rows, targets) on the GPU."""
    torch.manual_seed(0)
    hidden = torch.randn(4096, 256, device="cuda", requires_grad=True)
    weight = (0.1 * torch.randn(20352, 256, device="cuda")).requires_grad_()
    return hidden, weight, torch.randint(20319, (4096,), device="cuda")


@pytest.mark.gpu
def test_compiled_under_bf16_the_operator_matches_the_sliced_logits_loss():
    hidden, weight, targets = gpu_case()

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


@pytest.mark.gpu
def test_compiled_the_fp8_operator_is_within_fp8s_rounding_of_bf16():
    hidden, weight, targets = gpu_case()
    results = []
    for fp8 in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.compile(linear_cross_entropy)(hidden, weight, targets, 20319, fp8)
        results.append((loss, *torch.autograd.grad(loss, (hidden, weight))))
    (loss, *grads), (loss8, *grads8) = results
    torch.testing.assert_close(loss8, loss, atol=0.02, rtol=0.01)
    for g8, g in zip(grads8, grads):
        assert g8.dtype == torch.float32 and ((g8 - g).norm() / g.norm()) < 0.1
    assert grads8[1][20319:].abs().max() == 0


@pytest.mark.gpu
def test_on_a_gpu_the_fp8_cast_kernels_give_pytorchs_values_to_the_bit():
    from gpuaccel.models.cross_entropy_kernel import E4M3, to_e4m3

    torch.manual_seed(0)
    cases = [torch.randn(16384 * 3 + 5, device="cuda", dtype=torch.bfloat16),  # (a last block part-filled)
             (0.02 * torch.randn(5031, 768, device="cuda")).to(torch.bfloat16),
             torch.randn(40, 96, device="cuda") * torch.logspace(-12, 3, 96, device="cuda"),  # (E4M3's subnormals)
             torch.zeros(64, 16, device="cuda", dtype=torch.bfloat16)]
    for t in cases:
        got, scale = to_e4m3(t)
        expected_scale = t.abs().amax().float().clamp(min=1e-12) / torch.finfo(E4M3).max
        expected = (t / expected_scale).to(E4M3)
        assert got.dtype == E4M3 and got.shape == t.shape and scale.dtype == torch.float32
        differ = (got.view(torch.uint8) != expected.view(torch.uint8)).sum().item()
        assert torch.equal(scale, expected_scale) and differ == 0, (scale, expected_scale, differ, t.dtype)
