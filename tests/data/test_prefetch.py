"""Batches made ahead on background threads (data/prefetch.py), off the GPU."""

import random
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from gpuaccel.data.prefetch import in_threads


def slow_square(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(random.random() * 0.01)  # threads finish out of order
    return torch.tensor([step * step]), torch.tensor([step])


def prefetch_threads_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("gpuaccel-prefetch")]


@pytest.mark.parametrize("threads", [1, 3])
def test_batches_come_in_the_order_of_their_steps(threads):
    made = list(in_threads(range(40), slow_square, [None] * threads, depth=4))
    assert [int(y) for _, y in made] == list(range(40))
    assert [int(x) for x, _ in made] == [k * k for k in range(40)]
    assert not prefetch_threads_alive()


def test_a_failing_step_is_raised_in_its_place_after_the_steps_before_it():
    def make(step):
        if step == 5:
            raise ValueError("step 5 cannot be made")
        return slow_square(step)

    seen = []
    with pytest.raises(ValueError, match="step 5"):
        for _, y in in_threads(range(20), make, [None] * 3):
            seen.append(int(y))
    assert seen == [0, 1, 2, 3, 4]
    assert not prefetch_threads_alive()


def test_a_failing_read_is_raised_after_the_steps_read_before_it():
    def steps():
        yield from range(3)
        raise OSError("the disk went away")

    seen = []
    with pytest.raises(OSError, match="disk went away"):
        for _, y in in_threads(steps(), slow_square, [None] * 2):
            seen.append(int(y))
    assert seen == [0, 1, 2]


def test_stopping_early_joins_the_threads_and_closes_the_steps():
    closed = threading.Event()
    reads = []

    def steps():
        try:
            for k in range(1000):
                reads.append(k)
                yield k
        finally:
            closed.set()

    batches = in_threads(steps(), slow_square, [None] * 2, depth=3)
    assert [int(y) for _, y in (next(batches), next(batches))] == [0, 1]
    batches.close()
    assert closed.is_set() and not prefetch_threads_alive()
    assert len(reads) <= 2 + 3 + 2  # consumed, made ahead, and at most one more being read per thread


def test_it_needs_a_thread():
    with pytest.raises(ValueError, match="at least one"):
        list(in_threads(range(3), slow_square, []))


def test_the_threads_make_batches_before_the_first_is_asked_for():
    made = threading.Event()

    def make(step):
        made.set()
        return slow_square(step)

    batches = in_threads(range(5), make, [None])
    assert made.wait(5), "nothing was made before the first next()"
    assert [int(y) for _, y in batches] == list(range(5))
    assert not prefetch_threads_alive()


def test_an_iterator_dropped_unread_stops_its_threads():
    started, closed = threading.Event(), threading.Event()

    def steps():
        started.set()
        try:
            yield from range(1000)
        finally:
            closed.set()

    batches = in_threads(steps(), slow_square, [None] * 2, depth=2)
    # (a generator closed before a thread first read it never ran its body: nothing to clean up,
    # and on a busy machine the threads may not have read yet)
    assert started.wait(5)
    del batches  # the threads hold the shared state, not the iterator: it is collected, and stops them
    assert closed.wait(5) and not prefetch_threads_alive()


def test_a_script_that_fails_while_its_threads_make_batches_exits_with_its_own_error(tmp_path):
    """#82 item 13: an error out of ``fit()``, uncaught, left its loaders' threads inside PyTorch
    operators when Python finalised, and the process aborted ("terminate called without an
    active exception", exit 134) in place of exiting 1 with the script's error. The threads are
    stopped at exit (gpuaccel/background.py); before that, this script aborted 6 runs of 6."""
    script = tmp_path / "fails.py"
    script.write_text(textwrap.dedent("""
        import torch
        from gpuaccel.data.prefetch import in_threads

        torch.set_num_threads(1)
        a = torch.randn(1000, 1000)

        def make(step):
            for _ in range(3):
                a @ a  # (a PyTorch operator, the GIL let go)
            return a[:2], a[:2]

        batches = in_threads(range(1000), make, [None, None], depth=50)
        next(batches)
        raise ValueError("a check failed")
    """))
    for _ in range(2):
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 1 and "terminate called" not in done.stderr, done.stderr[-800:]
        assert done.stderr.rstrip().endswith("ValueError: a check failed")


def test_at_exit_a_thread_blocked_in_a_read_does_not_hold_the_process(tmp_path):
    """The threads are stopped at exit, but one blocked in its read (a reader process gone) is
    waited for a few seconds only: the script still ends with its own error."""
    script = tmp_path / "blocked.py"
    script.write_text(textwrap.dedent("""
        import time
        from gpuaccel.data import prefetch
        from gpuaccel.data.prefetch import in_threads

        prefetch._EXIT_WAIT = 0.5  # (5 s as shipped)

        def steps():
            yield 0
            time.sleep(600)  # (a read that never returns)
            yield 1

        batches = in_threads(steps(), lambda step: (step, step), [None])
        next(batches)
        raise ValueError("a check failed")
    """))
    start = time.perf_counter()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and done.stderr.rstrip().endswith("ValueError: a check failed"), done.stderr[-800:]
    assert time.perf_counter() - start < 30
