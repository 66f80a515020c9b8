"""bench's timer, with CUDA events and streams stubbed (no GPU needed)."""

from __future__ import annotations

import types

from cupyflash import bench


def _fake_cupy(elapsed):
    class Event:
        def record(self):
            pass

        def synchronize(self):
            pass

    class Stream:
        def synchronize(self):
            pass

    times = iter(elapsed)
    cuda = types.SimpleNamespace(Event=Event, get_current_stream=Stream,
                                 get_elapsed_time=lambda start, stop: next(times))
    return types.SimpleNamespace(cuda=cuda)


def test_timer_warms_up_for_the_given_time_then_takes_the_median():
    calls = []
    ms = bench._time_ms(lambda: calls.append(1), 5, _fake_cupy([5.0, 1.0, 3.0, 2.0, 4.0]), warmup_ms=20.0)
    assert ms == 3.0
    assert len(calls) >= 5 + 3  # at least 3 warm-up calls, then one per timed rep
