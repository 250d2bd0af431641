"""The GPU's power and clock while work runs: is a training step held by the board's power cap?

An H200 trains GPT-2 at its 700 W limit (tools/notes/profile.md): the SM clock falls to ~1,575
MHz (bf16) of 1,980, and every kernel that is not memory-bound runs at that clock. A profile of
milliseconds alone hides this, so `gpucore profile` also reports, over a second of steps run
before its timed ones, the energy per step, the mean power against the limit and the SM clock
against its maximum.

NVML (libnvidia-ml, installed with the driver) is read through ctypes: no dependency. Where it
cannot be loaded (a CPU machine, a container without it) `open_meter()` returns None and the
profile leaves the power rows out.

    meter = open_meter()                       # None: no NVML
    reading = measure(run_one_step, meter, min_seconds=1.0, sync=...)
    reading.joules_per_call, reading.watts, reading.sm_mhz, reading.limit_w
"""
from __future__ import annotations

import ctypes
import statistics
import time
from dataclasses import dataclass

NVML_CLOCK_SM = 1


class NvmlMeter:
    """One GPU's energy counter, SM clock and power limit through NVML."""

    def __init__(self, lib, handle):
        self.lib, self.handle = lib, handle

    def _get(self, fn, ctype, *args):
        value = ctype()
        rc = fn(self.handle, *args, ctypes.byref(value))
        if rc != 0:
            raise RuntimeError(f"NVML {fn.__name__} failed with code {rc}")
        return value.value

    def energy_j(self) -> float:
        """The board's energy counter since the driver loaded, in joules."""
        return self._get(self.lib.nvmlDeviceGetTotalEnergyConsumption, ctypes.c_ulonglong) / 1e3

    def sm_mhz(self) -> int:
        return self._get(self.lib.nvmlDeviceGetClockInfo, ctypes.c_uint, NVML_CLOCK_SM)

    def max_sm_mhz(self) -> int:
        return self._get(self.lib.nvmlDeviceGetMaxClockInfo, ctypes.c_uint, NVML_CLOCK_SM)

    def limit_w(self) -> float:
        return self._get(self.lib.nvmlDeviceGetEnforcedPowerLimit, ctypes.c_uint) / 1e3


def open_meter(pci_bus_id: str | None = None):
    """An NvmlMeter for the GPU at pci_bus_id (default: CuPy's current device), or None where
    NVML or the device is not there."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        if pci_bus_id is None:
            from . import runtime
            pci_bus_id = runtime.cupy.cuda.Device().pci_bus_id
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(pci_bus_id.encode()), ctypes.byref(handle)) != 0:
            return None
        meter = NvmlMeter(lib, handle)
        meter.energy_j()                       # the counter exists on Volta and later
        return meter
    except (OSError, AttributeError, RuntimeError):
        return None


def require_meter(who: str = "the probe"):
    """open_meter() for tools that cannot run without it: SystemExit with one line where it is missing."""
    meter = open_meter()
    if meter is None:
        raise SystemExit(f"{who} needs NVML's energy counter (libnvidia-ml), which did not load")
    return meter


@dataclass
class PowerReading:
    calls: int
    seconds: float
    joules_per_call: float
    watts: float                 # mean power over the calls
    sm_mhz: float                # median of the clock sampled after each batch of calls
    max_sm_mhz: float
    limit_w: float

    def as_dict(self) -> dict:
        return {"calls": self.calls, "seconds": self.seconds, "joules_per_call": self.joules_per_call,
                "watts": self.watts, "sm_mhz": self.sm_mhz, "max_sm_mhz": self.max_sm_mhz,
                "limit_w": self.limit_w}


def measure(fn, meter, *, min_seconds: float, sync, min_calls: int = 1) -> PowerReading:
    """Call fn until at least min_seconds and min_calls have passed (sync() waits for the device),
    reading the energy counter before and after. The counter updates every few ms, so a second
    or more gives percent-level figures."""
    if min_seconds <= 0 or min_calls < 1:
        raise ValueError(f"min_seconds must be > 0 and min_calls >= 1, got {min_seconds}, {min_calls}")
    sync()
    clocks = []
    e0, t0 = meter.energy_j(), time.perf_counter()
    calls, batch = 0, 1
    while calls < min_calls or time.perf_counter() - t0 < min_seconds:
        # Batches of calls, each waited for: without the wait the host queues up to ~1,000 launches
        # ahead, and the window would overrun by that much device work. A batch doubles while it
        # takes under 10 ms, so the waits cost little.
        tb = time.perf_counter()
        for _ in range(batch):
            fn()
        sync()
        calls += batch
        clocks.append(meter.sm_mhz())
        if time.perf_counter() - tb < 0.01:
            batch *= 2
    seconds, joules = time.perf_counter() - t0, meter.energy_j() - e0
    return PowerReading(calls, seconds, joules / calls, joules / seconds, statistics.median(clocks),
                        meter.max_sm_mhz(), meter.limit_w())


def describe(p: dict) -> str:
    """One line for a PowerReading.as_dict(): where the step stands against the power cap."""
    capped = p["watts"] >= 0.9 * p["limit_w"] and p["sm_mhz"] < 0.95 * p["max_sm_mhz"]
    why = ("at the power cap: GEMMs are held by power (only less energy -- FLOPs, bits, bytes -- makes them "
           "faster), every other kernel that is not memory-bound runs at this clock"
           if capped else "not held by the power cap")
    return (f"power: {p['watts']:.0f} W mean of a {p['limit_w']:.0f} W limit, {p['joules_per_call']:.2f} J per step, "
            f"SM clock {p['sm_mhz']:.0f} of {p['max_sm_mhz']:.0f} MHz -- {why}")
