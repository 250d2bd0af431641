"""tools/fp8_seeds.py: issue 16's quality table from saved metrics (no GPU needed).

Hand-made metrics files stand in for tools/optimizer_lab.sh's runs; the expected gaps, seed-mean
gaps and their standard errors are computed here by hand.
"""
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "fp8_seeds.py"


def _write(folder: Path, mode: str, seed: int, vals: dict):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"event": "start"})] + [json.dumps({"step": s, "val_loss": v}) for s, v in vals.items()]
    (folder / f"{mode}.s{seed}.jsonl").write_text("\n".join(lines) + "\n")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_gaps_means_and_standard_error_pooled_over_two_folders(tmp_path):
    a, b = tmp_path / "call1", tmp_path / "call2"
    _write(a, "adamw", 1, {0: 10.0, 100: 4.0})
    _write(a, "fp8", 1, {0: 10.0, 100: 4.04})      # +1.00% at step 100
    _write(b, "adamw", 2, {0: 10.0, 100: 5.0})
    _write(b, "fp8", 2, {0: 10.0, 100: 4.95})      # -1.00%
    _write(b, "adamw", 3, {0: 10.0, 100: 6.0})     # a bf16 seed fp8 lacks: kept out of the means
    r = _run(f"{a},{b}", "adamw", "fp8")
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.split() and l.split()[0] == "100")
    # means over seeds 1 and 2: (4.04 + 4.95) / 2 = 4.495 against 4.5 -> -0.11%; the gaps +-1% have a
    # standard deviation of 1.414% and a standard error of 1.00% over two seeds
    assert "+1.00% -1.00% (means -0.11% +- 1.00%)" in line
    assert "seeds 1, 2, 3" in r.stdout
    summary = r.stdout.split("summary:")[1]
    assert "worst same-seed gap 1.00%" in summary and "final (step 100) mean gap +0.00%" in summary


def test_refusals(tmp_path):
    _write(tmp_path / "a", "adamw", 1, {0: 10.0})
    _write(tmp_path / "b", "adamw", 1, {0: 10.0})
    r = _run(f"{tmp_path / 'a'},{tmp_path / 'b'}", "adamw", "fp8")
    assert r.returncode != 0 and "adamw seed 1 is in more than one of" in r.stderr
    r = _run(str(tmp_path / "a"), "bf16", "fp8")
    assert r.returncode != 0 and "no bf16 runs under" in r.stderr
    r = _run(str(tmp_path / "a"))
    assert r.returncode != 0 and "fp8_seeds.py" in r.stderr
