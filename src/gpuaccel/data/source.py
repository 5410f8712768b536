"""The protocol every gpuaccel loader serves: a source of batches on the compute device.

``Trainer`` reads its training and evaluation data through it and nothing else, so a user's
own loader plugs in by serving it (``Trainer(model, train_data=MySource(), eval_data=...)``).
gpuaccel's own are made of two engines (``runtime.loaders``): resident on the device
(``ResidentLoader``: a gather per field in an order's plan, such as a text's random windows,
sentences in length runs or sentence pairs in token buckets, with a kind's transform such as
scenes' augmentation, or tensors drawn again each epoch such as negative samples, or a kind's
gather of several batches at once such as image arrays' with their augmentation), or made on
the host and copied ahead (``PrefetchLoader``: a user's DataLoader, worker processes, or a
streamed JPEG folder's readers, whose transform decodes on the device ahead of the step), each
with a transform run on the device.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable


@runtime_checkable
class BatchSource(Protocol):
    """Batches on the device, a pass (epoch) at a time, the same again for the same epoch.

    - ``len(source)``: the steps of a pass in this process;
    - ``batches(epoch, start)``: the batches of steps ``start``.. of pass ``epoch``, each what
      the task splits into inputs and targets (a tuple whose last element is the target, or a
      dict). A resumed run asks for ``batches(epoch, start)`` mid-pass and must get the batches
      an uninterrupted run would have had: make them a function of (seed, epoch, step).

    Optional: ``batch_size`` and ``num_images`` (samples per batch and per pass, where they are
    fixed), ``stop_workers()`` (stop reader processes at the end of a run) and ``sample(count)``
    (a fixed sample as one batch, for data-dependent initialisation). With several processes
    each process's source serves its own shard of the data.
    """

    def __len__(self) -> int: ...

    def batches(self, epoch: int = 0, start: int = 0) -> Iterator: ...


def is_batch_source(data) -> bool:
    """Whether ``data`` serves :class:`BatchSource` (a torch Dataset or DataLoader does not)."""
    return isinstance(data, BatchSource)
