"""loss_spikes.py -- probe: one-step loss jumps (> 0.5) and the largest gradient norm of each run that
tools/ab_train.py logged under OUT/ab_train, one line a run. Used to ask whether a setting (fch as E4M3,
52nd-53rd sessions) makes the no-warmup recipe spike more often, or higher, than its seeds do without
it, and whether bf16 spikes there too (71st session: bf16 3 of 12 seeds). Runs named MODE-sSEED (as
tools/probes/spike_seeds.sh names them) are also summed up per mode: the seeds that spiked, and how high.
    python3 tools/probes/loss_spikes.py OUT
"""
import json, sys, glob, os, re
by_mode = {}
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ab_train", "*.jsonl"))):
    rows = [r for r in map(json.loads, open(f)) if "loss" in r and "event" not in r]
    L = {r["step"]: r["loss"] for r in rows}; G = {r["step"]: r.get("grad_norm", 0) for r in rows}
    jumps = [(s, L[s] - L[s-1]) for s in sorted(L) if s-1 in L and s > 2]
    big = [(s, L[s-1], L[s]) for s, d in jumps if d > 0.5]
    print(f"{os.path.basename(f):22s} loss@{max(L)} {L[max(L)]:.3f} max gn(3+) {max(G[s] for s in G if s>2):6.1f} "
          f"spikes {[f'{s}:{a:.2f}->{b:.2f}' for s, a, b in big]}")
    name = os.path.basename(f).split(".")[0]
    if m := re.fullmatch(r"(.+)-s(\d+)", name):
        by_mode.setdefault(m[1], []).append((int(m[2]), [(s, b - a) for s, a, b in big]))
for mode, runs in by_mode.items():
    hit = sorted((seed, big) for seed, big in runs if big)
    sizes = ", ".join(f"seed {seed} step {s} +{d:.2f}" for seed, big in hit for s, d in big)
    print(f"{mode}: spikes in {len(hit)} of {len(runs)} seeds" + (f" ({sizes})" if hit else ""))
