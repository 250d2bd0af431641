"""loss_spikes.py -- probe: one-step loss jumps (> 0.5) and the largest gradient norm of each run that
tools/ab_train.py logged under OUT/ab_train, one line a run. Used to ask whether a setting (fch as E4M3,
52nd-53rd sessions) makes the no-warmup recipe spike more often than its seeds do without it.
    python3 tools/probes/loss_spikes.py OUT
"""
import json, sys, glob, os
for f in sorted(glob.glob(os.path.join(sys.argv[1], "ab_train", "*.jsonl"))):
    rows = [r for r in map(json.loads, open(f)) if "loss" in r]
    L = {r["step"]: r["loss"] for r in rows}; G = {r["step"]: r.get("grad_norm", 0) for r in rows}
    jumps = [(s, L[s] - L[s-1]) for s in sorted(L) if s-1 in L and s > 2]
    big = [f"{s}:{L[s-1]:.2f}->{L[s]:.2f}" for s, d in jumps if d > 0.5]
    print(f"{os.path.basename(f):22s} loss@{max(L)} {L[max(L)]:.3f} max gn(3+) {max(G[s] for s in G if s>2):6.1f} spikes {big}")
