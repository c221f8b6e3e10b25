"""The console's ETA is paced by the steps this process trained: after a resume at step 20 of 40, one
step of 60 s leaves 19 x 60 s, not 60 s / 21 steps x 19 (the global step counted steps done elsewhere)."""

from __future__ import annotations

import pytest

import posttrain.tracking as tracking
from posttrain.tracking import Tracking


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("first_step, expected_eta", [
    (21, "0:19:00"),  # resumed at step 20: 1 step here in 60 s, 19 left
    (1, "0:39:00"),   # control: a fresh run, 1 step in 60 s, 39 left (the same pace either way)
])
def test_eta_uses_the_steps_of_this_process(tmp_path, capsys, monkeypatch, first_step, expected_eta):
    clock = Clock()
    monkeypatch.setattr(tracking.time, "monotonic", clock)
    console = Tracking(["console"], tmp_path, "proj", "exp", total_steps=40)
    console.log({"val-core/acc@1": 0.5}, 0)  # a validation logged before the first step is not a step
    clock.now += 60.0
    console.log({"train/loss": 1.0}, first_step)
    clock.now += 60.0
    console.log({"train/loss": 1.0}, first_step + 1)
    lines = capsys.readouterr().out.splitlines()
    assert f"0:01:00 elapsed, ETA {expected_eta}" in lines[1]
    left = 40 - (first_step + 1)  # two steps in 120 s: still 60 s a step
    assert f"0:02:00 elapsed, ETA 0:{left:02d}:00" in lines[2]
