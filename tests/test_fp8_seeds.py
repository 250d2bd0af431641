"""tools/fp8_seeds.py: issue 16's quality table from saved metrics (no GPU needed), and the runs
tools/optimizer_lab.sh offers it.

Hand-made metrics files stand in for tools/optimizer_lab.sh's runs; the expected gaps, seed-mean
gaps and their standard errors are computed here by hand.
"""
import json
import os
import re
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
    assert "same-seed gaps after step 0: rms 1.00%" in summary      # step 0 left out: +-1.00% at 100


def test_refusals(tmp_path):
    _write(tmp_path / "a", "adamw", 1, {0: 10.0})
    _write(tmp_path / "b", "adamw", 1, {0: 10.0})
    r = _run(f"{tmp_path / 'a'},{tmp_path / 'b'}", "adamw", "fp8")
    assert r.returncode != 0 and "adamw seed 1 is in more than one of" in r.stderr
    r = _run(str(tmp_path / "a"), "bf16", "fp8")
    assert r.returncode != 0 and "no bf16 runs under" in r.stderr
    r = _run(str(tmp_path / "a"))
    assert r.returncode != 0 and "fp8_seeds.py" in r.stderr


def test_rms_and_count_over_one_percent_leave_out_the_first_evaluation(tmp_path):
    _write(tmp_path, "adamw", 1, {0: 10.0, 100: 4.0, 200: 3.0})
    _write(tmp_path, "fp8", 1, {0: 10.5, 100: 4.1, 200: 3.003})    # +5% (left out), +2.5%, +0.1%
    _write(tmp_path, "adamw", 2, {0: 10.0, 100: 4.0, 200: 3.0})
    _write(tmp_path, "fp8", 2, {0: 10.0, 100: 3.9, 200: 2.964})    # 0%, -2.5%, -1.2%
    r = _run(str(tmp_path), "adamw", "fp8")
    assert r.returncode == 0, r.stderr
    # gaps after step 0: +2.5, +0.1, -2.5, -1.2 (%): rms sqrt((6.25 + 0.01 + 6.25 + 1.44) / 4) = 1.8675
    line = next(l for l in r.stdout.splitlines() if "same-seed gaps after step 0" in l)
    assert line.split(":", 1)[1].strip() == "rms 1.87%, over 1% at 3 of 4"
    assert "worst same-seed gap 5.00%" in r.stdout                   # the worst still reads every step


def test_optimizer_lab_runs_every_mode_its_header_lists():
    """The study's modes come from tools/optimizer_lab.sh: each mode its header documents has a
    branch in its case statement (the settings it runs), and no branch goes undocumented."""
    text = (ROOT / "tools" / "optimizer_lab.sh").read_text()
    header = text.split("set -euo pipefail")[0]
    documented = set(re.findall(r"^#     ([a-z0-9-]+) ", header, re.M))
    branches = set(re.findall(r"^    ([a-z0-9-]+)\) ", text, re.M))
    assert {"adamw", "fp8-sparse", "fp8-sparse-nopred", "adamw-order"} <= documented
    assert documented == branches


def test_optimizer_lab_refuses_an_unknown_run_before_any_work(tmp_path):
    """A misspelt RUNS entry stops the script with one line, before the corpus or any training."""
    env = dict(os.environ, RUNS="adamw fp8-spars", OUT=str(tmp_path), CORPUS="stdlib")
    r = subprocess.run(["bash", str(ROOT / "tools" / "optimizer_lab.sh")], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2
    assert "unknown run 'fp8-spars'" in r.stderr
    assert not (tmp_path / "optimizer_lab").exists()
