"""Every command ends promptly once its work is done: cold or warm compile caches, success,
a user error, SIGINT and SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import as_from_a_terminal

EXIT_BOUND = 30  # seconds from the summary to the end of the process (a normal exit takes 1-3 s here)


def _fresh_env(tmp_path) -> dict:
    """An environment whose caches are empty: decoded data, Inductor's graphs and kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(GPUACCEL_CACHE_DIR=str(tmp_path / "cache"), TQDM_DISABLE="1")
    return env


def _exits_after(proc: subprocess.Popen, done, bound: float, limit: float = 600) -> float:
    """Waits until ``done()`` (the work is finished), then for the process to end; returns the
    seconds between the two (the test fails if the end takes longer than ``bound``)."""
    deadline = time.time() + limit
    while not done() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    finished = time.time()
    try:
        proc.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the process was still alive {bound} s after its work ended")
    return time.time() - finished


def test_a_cold_compile_exits_promptly(tmp_path, mnist_dir):
    """A first-time torch.compile leaves a thread pool (Inductor's) whose workers wait for work
    until the interpreter's thread hook stops them; the command must not wait for them."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuaccel", "train", "--data", str(mnist_dir), "--model", "mlp", "--compile",
         "--no-compile-eval", "--epochs", "0.1", "--batch-size", "64", "--no-monitor", "--quiet",
         "--run-dir", str(run_dir)],
        env=_fresh_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _exits_after(proc, lambda: (run_dir / "summary.json").exists(), EXIT_BOUND)
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    assert "saved to" in out


_POOL_THEN_COMMAND = textwrap.dedent("""
    import concurrent.futures, sys
    from gpuaccel.cli import run
    pool = concurrent.futures.ThreadPoolExecutor(2)  # as a compiler's pool: idle workers, never shut down
    pool.submit(sum, [1, 2]).result()
    sys.argv = ["gpuaccel", *sys.argv[1:]]
    run()
""")


@pytest.mark.parametrize("argv, code", [(["models"], 0), (["train", "--epochs", "-1"], 2)])
def test_idle_thread_pool_workers_do_not_keep_a_command_alive(argv, code):
    proc = subprocess.Popen([sys.executable, "-c", _POOL_THEN_COMMAND, *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        proc.communicate(timeout=EXIT_BOUND + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail("the command did not end with idle thread-pool workers alive")
    assert proc.returncode == code


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 130)])
def test_a_signal_mid_training_ends_the_command(tmp_path, sig, code):
    pool = textwrap.dedent("""
        import concurrent.futures, sys
        from gpuaccel.cli import run
        concurrent.futures.ThreadPoolExecutor(1).submit(int).result()
        sys.argv = ["gpuaccel", *sys.argv[1:]]
        run()
    """)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", pool, "train", "--data", "digits", "--model", "mlp",
                             "--epochs", "500", "--no-monitor", "--checkpoint-every", "5", "--run-dir", str(run_dir)],
                            env=_fresh_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=as_from_a_terminal)
    deadline = time.time() + 120
    while not (run_dir / "checkpoint.json").exists() and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    try:
        _, err = proc.communicate(timeout=EXIT_BOUND + 30)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the command did not end after {sig!r}: {proc.communicate()[1][-3000:]}")
    assert proc.returncode == code, err
    assert "checkpoint saved" in err


def test_a_closed_pipe_ends_the_command_without_a_traceback():
    """``gpuaccel env --json | head``: the reader is gone before the command writes."""
    code = textwrap.dedent("""
        import os, sys
        from gpuaccel.cli import run
        read, write = os.pipe()
        os.close(read)                        # the reader has gone away
        os.dup2(write, sys.stdout.fileno())
        sys.argv = ["gpuaccel", "env", "--json"]
        run()
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, done.stderr
    assert done.returncode == 1


def test_a_signal_during_a_checkpoint_write_is_handled_after_the_write():
    """The test above sends its signal once a checkpoint exists; with one written every 5 steps,
    it can land inside the next torch.save, whose zip writer then failed on closing (exit 1)."""
    from gpuaccel.train.fit_context import signals_held

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append("handler"))
    try:
        with signals_held():
            signal.raise_signal(signal.SIGTERM)
            seen.append("written")
        assert seen == ["written", "handler"]
    finally:
        signal.signal(signal.SIGTERM, previous)
