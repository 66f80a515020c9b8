"""bench's timer, with CUDA events and streams stubbed (no GPU needed)."""

from __future__ import annotations

import time
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

    def fn():  # 1 ms a call: 30 ms of warm-up is about 30 calls, far more than the minimum 3
        calls.append(1)
        time.sleep(0.001)

    ms = bench._time_ms(fn, 5, _fake_cupy([5.0, 1.0, 3.0, 2.0, 4.0]), warmup_ms=30.0)
    assert ms == 3.0
    assert 5 + 10 <= len(calls) <= 5 + 31  # warm-up stops once 30 ms have passed


def _fake_torch(elapsed):
    made = []

    class Event:
        def __init__(self, enable_timing=False):
            made.append(enable_timing)

        def record(self):
            pass

        def synchronize(self):
            pass

        def elapsed_time(self, stop):
            return next(times)

    times = iter(elapsed)
    syncs = []
    cuda = types.SimpleNamespace(Event=Event, synchronize=lambda: syncs.append(1))
    return types.SimpleNamespace(cuda=cuda), made, syncs


def test_torch_timer_has_the_same_warm_up_and_median():
    """torch work is timed with torch.cuda.Event (timing enabled) after the same time-based warm-up."""
    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.001)

    torch, made, syncs = _fake_torch([4.0, 1.0, 2.0])
    assert bench._torch_time_ms(fn, 3, torch, warmup_ms=30.0) == 2.0
    warmup = len(calls) - 3
    assert 10 <= warmup <= 31 and len(syncs) == warmup  # synchronised after each warm-up call
    assert made == [True] * 6  # a start and a stop event per repetition
