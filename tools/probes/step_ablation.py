"""Probe: what would a whole training step take if one op family cost nothing?

At the H200's 700 W cap a step takes about its energy / 700 W (tools/notes/profile.md, tenth
session), so an op's time in the profile is not what making it faster can save: the clock its
joules buy goes to the other ops. This probe measures the real ceiling of each lever in the step
itself. It records one eager step (gpucore.profiler, the profile's row names), then runs whole
steps with every call of one family SKIPPED -- the call returns what it returned in the recorded
step, so the step goes on with stale but finite data -- under NVML's energy counter:

  family skipped | its ms in the profile | step ms and J without it | ms and J saved | SM clock

Each ablated run sits between two baseline runs (base, a1, base, a2, ..., base), and its savings
are against the mean of its two neighbours, so a drifting clock or temperature cancels out. "saved
ms / profile ms" is the share of an op's profiled time a perfect kernel would give back: near 1
for an op whose joules are small for its time, well under 1 for one that pays for its own clock.
Groups (`groups=LABEL=NAME|NAME|...,LABEL=...`) skip several families at once, e.g. every
memory-bound pass; names the step does not call are left out with a line saying so.
freeze=1 skips the optimizer in every run, baselines included: the weights stay as recorded, so
every step computes on the same data (without it an ablation's stale gradients move the weights,
and later baselines drift: FP8's adaptive scales more than bf16).
Caveat: skipping an op that writes the gradient stream (layernorm backward accumulates dresidual)
leaves the GEMMs after it multiplying zeros, which draw less power: such a row is not a ceiling.

Run (GPU):  PYTHONPATH=. python3 tools/probes/step_ablation.py [model=d12] [B=64] [dtype=bf16]
            [seconds=1.0] [top=12] ["groups=LABEL=NAME|NAME,..."] [freeze=0] [device=cuda]
"""
import sys

from gpucore import power, profiler
from gpucore.profile import _lm_head_labeler, synthetic_training

opts = dict(model="d12", B="64", dtype="bf16", seconds="1.0", top="12", groups="", device="cuda", freeze="0")
opts.update(kv.split("=", 1) for kv in sys.argv[1:])


class Skipper(profiler.Recorder):
    """Calls every profiled op as usual, except those whose row name is in `skip`: they return the
    result of the same call (by row name and call index) in the recorded step, launching nothing."""

    def __init__(self, labeler, results, skip):
        super().__init__(labeler)
        self.results, self.skip, self.seen = results, skip, {}

    def _record(self, name, fn, args, kwargs, flops, nbytes):
        name = self.labeler(name, args, kwargs)
        i = self.seen.get(name, 0)
        self.seen[name] = i + 1
        if name in self.skip:
            calls = self.results[name]
            return calls[i % len(calls)]
        self.busy = True                # ops inside this one are part of it
        try:
            return fn(*args, **kwargs)
        finally:
            self.busy = False


class Keeper(profiler.Recorder):
    """A recorder that also keeps each call's result, by row name, in call order."""

    def __init__(self, labeler):
        super().__init__(labeler)
        self.results = {}

    def _record(self, name, fn, args, kwargs, flops, nbytes):
        label = self.labeler(name, args, kwargs)
        out = super()._record(name, fn, args, kwargs, flops, nbytes)
        self.results.setdefault(label, []).append(out)
        return out


def main():
    meter = power.require_meter()
    if opts["device"] == "cuda":
        import cupy
        sync = cupy.cuda.Device().synchronize
    else:
        sync = lambda: None      # noqa: E731 - device=cpu: a smoke test of the probe itself
    seconds = float(opts["seconds"])
    run = synthetic_training(opts["model"], int(opts["B"]), None, opts["device"], opts["dtype"])
    labeler = _lm_head_labeler(run.config.padded_vocab_size)
    for _ in range(3):
        float(run.step()[0])
    keeper = Keeper(labeler)
    with profiler.recording(recorder=keeper):
        run.step()
    totals = keeper.totals()
    step_ms = sum(t.ms for t in totals.values())
    frozen = {n for n in ("adamw", "sfadamw") if n in totals} if opts["freeze"] == "1" else set()
    families = [n for n in sorted(totals, key=lambda n: -totals[n].ms) if n not in frozen][:int(opts["top"])]
    variants = [(f, {f}) for f in families]
    for g in filter(None, opts["groups"].split(",")):
        label, _, members = g.rpartition("=")
        names = set(members.split("|")) & set(totals)
        missing = set(members.split("|")) - names
        if missing:
            print(f"group {label or g}: not in this step, left out: {sorted(missing)}")
        if names:
            variants.append((label or "|".join(sorted(names)), names))

    def measured(skip):
        skip = set(skip or ()) | frozen
        rec = Skipper(labeler, keeper.results, skip) if skip else None

        def step():
            if rec is None:
                return run.step()
            with profiler.recording(recorder=rec):
                return run.step()
        power.measure(step, meter, min_seconds=seconds / 4, sync=sync)       # settle the clock
        r = power.measure(step, meter, min_seconds=seconds, sync=sync)
        return 1e3 * r.seconds / r.calls, r.joules_per_call, r.sm_mhz

    tag = f"{opts['model']} B={opts['B']} {opts['dtype']}"
    print(f"{tag}: recorded eager step, ops summed {step_ms:.1f} ms; {len(variants)} ablations, "
          f"{seconds:.1f} s each, between baselines" + (f"; always skipped: {sorted(frozen)}" if frozen else ""))
    print(f"{'skipped':44s} {'prof ms':>8s} {'step ms':>8s} {'step J':>7s} {'saved ms':>8s} {'saved J':>7s} "
          f"{'ms/prof':>7s} {'MHz':>5s}")
    base = measured(None)
    bases = [base]
    for label, skip in variants:
        ms, j, mhz = measured(skip)
        after = measured(None)
        bases.append(after)
        b_ms, b_j = (base[0] + after[0]) / 2, (base[1] + after[1]) / 2
        prof = sum(totals[n].ms for n in skip)
        print(f"{label[:44]:44s} {prof:8.2f} {ms:8.2f} {j:7.2f} {b_ms - ms:8.2f} {b_j - j:7.2f} "
              f"{(b_ms - ms) / prof:7.2f} {mhz:5.0f}")
        base = after
    ms_all = [b[0] for b in bases]
    j_all = [b[1] for b in bases]
    print(f"baseline over the run: {min(ms_all):.2f}-{max(ms_all):.2f} ms, {min(j_all):.2f}-{max(j_all):.2f} J, "
          f"SM {bases[-1][2]:.0f} MHz")


if __name__ == "__main__":
    main()
