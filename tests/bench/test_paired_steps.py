"""benchmarks/porting's paired timing (steptimer.py's paired mode, run_ports.py's neighbour
ratios): the porting results in docs/results.md that compare a script with its port step by step
rest on the two processes taking strict turns and on each step being set against its neighbours."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PORTING = Path(__file__).resolve().parents[2] / "benchmarks" / "porting"

# a stand-in for a training script: each step "works" (sleeps) for its variant's time and logs
# when, then ticks as the instrumented scripts do
SCRIPT = """
import json, os, sys, time
import steptimer
work, log = float(sys.argv[1]), open(sys.argv[2], "w")
for step in range(10_000):
    start = time.perf_counter()
    time.sleep(work)
    log.write(json.dumps([start, time.perf_counter()]) + "\\n"); log.flush()
    steptimer.tick(None, 1)
"""


@pytest.fixture(scope="module")
def run_ports():
    sys.path.insert(0, str(PORTING))  # run_ports imports ratio_stats from its own folder
    try:
        spec = importlib.util.spec_from_file_location("run_ports", PORTING / "run_ports.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(PORTING))


def test_each_step_is_set_against_the_other_variants_steps_on_either_side(run_ports):
    records = [{"variant": "b", "pair": "second", "step_seconds": [2.0, 4.0, 2.0]},
               {"variant": "a", "pair": "first", "step_seconds": [1.0, 1.0, 3.0]}]
    # turns: a1 b2 a1 b4 a3 b2
    assert run_ports.neighbour_ratios(records, "b") == [2.0 / ((1.0 + 1.0) / 2), 4.0 / ((1.0 + 3.0) / 2)]
    assert run_ports.neighbour_ratios(records, "a") == [1.0 / 3.0, 3.0 / ((4.0 + 2.0) / 2)]


def test_two_processes_take_strict_turns_and_each_times_only_its_own_steps(tmp_path):
    (tmp_path / "script.py").write_text(SCRIPT)
    for name in ("first_to_second", "second_to_first"):
        os.mkfifo(tmp_path / name)
    processes = {}
    for role, work in (("first", 0.02), ("second", 0.03)):
        env = {**os.environ, "PYTHONPATH": str(PORTING), "STEPTIMER_PAIR": role, "STEPTIMER_PAIR_DIR": str(tmp_path),
               "STEPTIMER_WARMUP": "3", "STEPTIMER_STEPS": "12", "STEPTIMER_OUT": str(tmp_path / f"{role}.jsonl")}
        processes[role] = subprocess.Popen([sys.executable, str(tmp_path / "script.py"), str(work),
                                            str(tmp_path / f"{role}.log")], env=env)
    for process in processes.values():
        assert process.wait(timeout=120) == 0
    results = {role: json.loads((tmp_path / f"{role}.jsonl").read_text()) for role in processes}
    assert [len(results[role]["step_seconds"]) for role in ("first", "second")] == [12, 12]
    # after the warm-up (whose steps run freely, each process at its own pace) the work alternates,
    # first, second, first, ..., and never overlaps
    timed = {role: [json.loads(line) for line in (tmp_path / f"{role}.log").read_text().splitlines()][3:15]
             for role in processes}
    # each step's time is its own work, not the other's turn (20 or 30 ms) as well
    for role, spans in timed.items():
        for (start, end), seconds in zip(spans, results[role]["step_seconds"]):
            assert end - start <= seconds < end - start + 0.015
    turns = sorted((start, end, role) for role, spans in timed.items() for start, end in spans)
    assert [role for _, _, role in turns] == ["first", "second"] * 12
    assert all(end <= next_start for (_, end, _), (next_start, _, _) in zip(turns, turns[1:]))
