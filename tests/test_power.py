"""gpucore.power: the energy counter around a block of work, and the line the profile prints.

- measure() turns two counter readings into J per call and mean W, calls until both the time and
  the call count are reached, and syncs before it reads the counter each time;
- describe() calls a step "at the power cap" only when the power is near the limit and the clock
  below its maximum;
- open_meter() gives None, not an exception, where NVML cannot be loaded or initialised.
"""
import ctypes

import pytest

from gpucore import power


class FakeMeter:
    """Energy grows 0.5 J per call of the work; the clock reads 1500, 1600, 1700, ..."""

    def __init__(self):
        self.joules, self.clock = 100.0, 1400

    def energy_j(self):
        return self.joules

    def sm_mhz(self):
        self.clock += 100
        return self.clock

    def max_sm_mhz(self):
        return 1980

    def limit_w(self):
        return 700.0


def test_measure_joules_per_call_and_watts():
    meter, events = FakeMeter(), []

    def work():
        meter.joules += 0.5
        events.append("call")

    r = power.measure(work, meter, min_seconds=1e-6, min_calls=4, sync=lambda: events.append("sync"))
    # batches of calls, each waited for (a batch doubles while it takes under 10 ms: 1, 2, 4 here
    # unless this machine is slow), a wait before the window; it ends with a wait, never a call
    batches = "".join("c" if e == "call" else "|" for e in events).split("|")
    assert events[0] == "sync" and events[-1] == "sync" and batches[0] == "" and batches[-1] == ""
    sizes = [len(b) for b in batches[1:-1]]
    assert sum(sizes) == r.calls >= 4 and sizes[0] == 1
    assert all(b in (a, 2 * a) for a, b in zip(sizes, sizes[1:]))
    assert r.joules_per_call == pytest.approx(0.5)
    assert r.watts == pytest.approx(0.5 * r.calls / r.seconds)
    assert r.sm_mhz == 1400 + 100 * (len(sizes) + 1) / 2 and r.max_sm_mhz == 1980 and r.limit_w == 700.0
    assert set(r.as_dict()) == {"calls", "seconds", "joules_per_call", "watts", "sm_mhz", "max_sm_mhz", "limit_w"}


def test_measure_runs_until_the_time_has_passed():
    meter = FakeMeter()
    r = power.measure(lambda: None, meter, min_seconds=0.02, sync=lambda: None)
    assert r.seconds >= 0.02 and r.calls >= 1


@pytest.mark.parametrize("kw", [dict(min_seconds=0), dict(min_seconds=1, min_calls=0)])
def test_measure_refuses_an_empty_window(kw):
    with pytest.raises(ValueError, match="min_seconds must be > 0"):
        power.measure(lambda: None, FakeMeter(), sync=lambda: None, **kw)


def _reading(watts, mhz):
    return dict(calls=10, seconds=1.0, joules_per_call=watts / 10, watts=watts, sm_mhz=mhz,
                max_sm_mhz=1980, limit_w=700.0)


def test_describe_says_when_the_step_is_power_capped():
    capped = power.describe(_reading(669, 1575))
    assert capped.startswith("power: 669 W mean of a 700 W limit, 66.90 J per step, SM clock 1575 of 1980 MHz")
    assert "at the power cap" in capped
    assert "not held by the power cap" in power.describe(_reading(400, 1980))   # memory-bound: full clock
    assert "not held by the power cap" in power.describe(_reading(300, 1200))   # low power, low clock: not the cap


def test_open_meter_is_none_without_nvml(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert power.open_meter("00000000:01:00.0") is None

    class FailingInit:
        def nvmlInit_v2(self):
            return 9                      # NVML_ERROR_DRIVER_NOT_LOADED
    monkeypatch.setattr(ctypes, "CDLL", lambda name: FailingInit())
    assert power.open_meter("00000000:01:00.0") is None


def test_require_meter_exits_with_one_line_without_nvml(monkeypatch):
    def no_library(name):
        raise OSError(f"{name}: cannot open shared object file")
    monkeypatch.setattr(ctypes, "CDLL", no_library)
    with pytest.raises(SystemExit, match="the probe needs NVML's energy counter"):
        power.require_meter()
