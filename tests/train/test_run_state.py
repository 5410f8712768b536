"""RunState: the run's position and progress, moved on by the loop, saved and put back whole."""

from __future__ import annotations

from gpuaccel.train.run_state import RunState


def test_steps_move_the_position_and_end_epochs():
    state = RunState()
    ends = [state.stepped(2, 64, batches_per_epoch=4) for _ in range(3)]  # 2 micro-batches a step
    assert ends == [False, True, False]
    assert state.position() == {"epoch": 1, "batch_in_epoch": 2, "global_step": 3} and state.samples_seen == 192


def test_evaluations_keep_each_metrics_best_and_the_time_to_target():
    state, higher = RunState(train_seconds=5.0), (lambda name: name == "accuracy")
    assert state.evaluated({"accuracy": 0.8, "loss": 0.5}, "accuracy", higher, reached_target=False)
    state.train_seconds = 7.0
    assert not state.evaluated({"accuracy": 0.7, "loss": 0.4}, "accuracy", higher, reached_target=True)
    assert state.best_metrics == {"accuracy": 0.8, "loss": 0.4} and state.last_eval["accuracy"] == 0.7
    assert state.time_to_target == 7.0
    state.train_seconds = 9.0
    state.evaluated({"accuracy": 0.9, "loss": 0.3}, "accuracy", higher, reached_target=True)
    assert state.time_to_target == 7.0  # the first time it was reached


def test_a_saved_state_is_put_back_whole_and_older_checkpoints_still_load():
    state = RunState()
    state.stepped(1, 32, batches_per_epoch=1)
    state.evaluated({"accuracy": 0.5}, "accuracy", lambda name: True, reached_target=False)
    state.best_step = 1
    again = RunState()
    again.load(state.position(), state.progress())
    assert again == state
    older = {k: v for k, v in state.progress().items() if k not in ("evaluated_at", "best_step")}
    again = RunState()
    again.load(state.position(), older)
    assert again.evaluated_at == state.global_step and again.best_step is None
