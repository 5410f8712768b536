"""``acc.captured(items)``: a loop's body recorded as CUDA graphs where it is written (a flat
script's micro-step loop, as nanoGPT's), trained like the loop as it is; the bodies it cannot
capture run as they are, after one warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import gpuaccel
from gpuaccel import GpuaccelError

VOCAB, CONTEXT, BATCH = 50, 8, 16


def _train(device: str, captured: bool, accumulate: int = 1, fetch_first: bool = False, steps: int = 8,
           body_reads_loss: bool = False, fetch_outside: bool = False, strict: bool = False):
    """nanoGPT's loop in small: a batch function drawing random windows of a token sequence, the
    micro-steps' forward pass, the next batch fetched (after the forward pass, or first), the
    backward pass; clipping, AdamW's step and zeroing after the loop. Returns the losses, the
    final weights, the loop and the accelerator."""
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4096,))
    draws = torch.Generator().manual_seed(1)
    model = nn.Sequential(nn.Embedding(VOCAB, 32), nn.GELU(), nn.Linear(32, VOCAB))
    acc = gpuaccel.Accelerator(device=device, precision="fp32", monitor=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)

    def get_batch(split):
        starts = torch.randint(len(tokens) - CONTEXT - 1, (BATCH,), generator=draws)
        x = torch.stack([tokens[i:i + CONTEXT] for i in starts])
        y = torch.stack([tokens[i + 1:i + 1 + CONTEXT] for i in starts])
        if device == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    get_batch = acc.timed(get_batch)
    X, Y = get_batch("train")
    losses, loop = [], None
    for _ in range(steps):
        if fetch_outside:
            X, Y = get_batch("train")
        loop = acc.captured(range(accumulate), strict=strict) if captured else range(accumulate)
        for _micro_step in loop:
            if fetch_first and not fetch_outside:
                X, Y = get_batch("train")
            logits = model(X)
            loss = F.cross_entropy(logits.flatten(0, 1), Y.flatten()) / accumulate
            if body_reads_loss and loss.item() > 1e9:
                break
            if not fetch_first and not fetch_outside:
                X, Y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().clone())
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    return [x.item() for x in losses], params, loop, (X, Y), acc.stats()


def _assert_same_training(a, b, tolerance: float) -> None:
    assert max(abs(x - y) for x, y in zip(a[0], b[0])) <= tolerance
    for key, value in a[1].items():
        torch.testing.assert_close(b[1][key], value, atol=tolerance, rtol=tolerance)


def test_on_the_cpu_a_captured_loop_runs_as_it_is_after_one_notice():
    plain = _train("cpu", captured=False, accumulate=2)
    with pytest.warns(UserWarning, match="CUDA graphs need a GPU: the loop runs uncaptured") as caught:
        captured = _train("cpu", captured=True, accumulate=2)
    assert len(caught) == 1  # (one loop, written once: one notice, not one per pass)
    _assert_same_training(plain, captured, 0.0)
    assert not captured[2].captured
    with pytest.raises(GpuaccelError, match="captured\\(\\): CUDA graphs need a GPU"):
        _train("cpu", captured=True, strict=True)


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate,fetch_first", [(1, False), (3, False), (2, True)])
def test_a_captured_loop_trains_like_the_loop_as_it_is(accumulate, fetch_first):
    plain = _train("cuda", captured=False, accumulate=accumulate, fetch_first=fetch_first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured = _train("cuda", captured=True, accumulate=accumulate, fetch_first=fetch_first)
    assert not [str(w.message) for w in caught]  # (no empty-graph notice, no stream mismatch, no prototype notice)
    loop = captured[2]
    # 3 warm-up passes, a recorded one, 4 replays; a graph per fetch, and one after the last
    assert loop.captured and len(loop.graphs) == accumulate + 1
    _assert_same_training(plain, captured, 1e-5)
    # what the script holds after the loop is the batch fetched last, as in the loop as it is
    for held, plain_held in zip(captured[3], plain[3]):
        assert torch.equal(held.cpu(), plain_held.cpu())
    # a loop that fetches through acc.timed and prepares no loader (nanoGPT's) has its seconds and
    # data wait counted by stats(), the fetches a replay makes as the body's own
    for stats in (plain[4], captured[4]):
        assert stats["seconds"] > 0 and 0 < stats["data_wait_share"] < 1, stats


@pytest.mark.gpu
def test_a_body_that_waits_for_the_gpu_or_fetches_nothing_runs_as_it_is_after_one_warning():
    plain = _train("cuda", captured=False)
    with pytest.warns(UserWarning, match="something in it waits for the GPU.*runs uncaptured") as caught:
        waits = _train("cuda", captured=True, body_reads_loss=True)
    assert len(caught) == 1 and not waits[2].captured  # (the passes after it: no stream-mismatch notice)
    _assert_same_training(plain, waits, 1e-5)

    plain = _train("cuda", captured=False, fetch_outside=True)
    with pytest.warns(UserWarning, match="fetches no batch through a function wrapped by acc.timed"):
        outside = _train("cuda", captured=True, fetch_outside=True)
    assert not outside[2].captured  # (a replay would have read the recording's batch every time)
    _assert_same_training(plain, outside, 1e-5)
    with pytest.raises(GpuaccelError, match="fetches no batch"):
        _train("cuda", captured=True, fetch_outside=True, strict=True)
    # the warm-up left the device's random number generator and the sync debug mode as they were
    assert torch.cuda.get_sync_debug_mode() == 0
    torch.rand(4, device="cuda")


def test_a_loop_written_once_is_one_loop_per_model_it_trains():
    """A helper holding the loop, called for two models, must not replay the first model's graphs for
    the second: the models and optimizers around a loop are part of which loop it is."""
    acc = gpuaccel.Accelerator(device="cpu", precision="fp32", monitor=False)

    def steps(model, optimizer):
        return acc.captured(range(2))

    one, two = nn.Linear(2, 2), nn.Linear(2, 2)
    sgd_one, sgd_two = torch.optim.SGD(one.parameters(), lr=0.1), torch.optim.SGD(two.parameters(), lr=0.1)
    with pytest.warns(UserWarning, match="CUDA graphs need a GPU"):
        first = steps(one, sgd_one)
        assert steps(one, sgd_one) is first  # (the same loop, called again: warmed up and recorded once)
        assert steps(two, sgd_two) is not first
