"""tools/pycorpus.py: the quality studies' corpus from Python sources on the machine (no GPU needed).

A hand-made tree stands in for the standard library and site-packages; the expected text is
written out here from the files' contents in byte order.
"""
import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tools" / "pycorpus.py"
spec = importlib.util.spec_from_file_location("pycorpus", SCRIPT)
pycorpus = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pycorpus)


def _tree(tmp_path):
    std, site = tmp_path / "lib", tmp_path / "lib" / "site-packages"
    for path, data in {
        std / "b.py": b"b = 2\n",
        std / "a.py": b"a = 1\n",
        std / "Z.py": b"Z = 0\n",                       # upper case sorts first in byte order
        std / "pkg" / "m.py": "m = '\u00e9'\n".encode(),  # a two-byte character
        std / "notes.txt": b"not python\n",
        std / "latin1.py": b"x = '\xe9'\n",               # not UTF-8: skipped
        site / "torch" / "t.py": b"t = 3\n",
    }.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return str(std), str(site)


def test_standard_library_alone_in_byte_order_skipping_site_packages_and_bad_files(tmp_path):
    std, _ = _tree(tmp_path)
    out = tmp_path / "corpus.txt"
    info = pycorpus.build(str(out), 1000, [std])
    assert out.read_bytes() == b"Z = 0\na = 1\nb = 2\n" + "m = '\u00e9'\n".encode()
    assert info["files"] == 4 and info["skipped_not_utf8"] == 1


def test_site_packages_join_when_asked_and_a_cut_never_splits_a_character(tmp_path):
    std, site = _tree(tmp_path)
    out = tmp_path / "corpus.txt"
    pycorpus.build(str(out), 1000, [std, site])
    assert out.read_bytes().endswith(b"t = 3\n")       # lib/pkg/m.py < lib/site-packages/torch/t.py
    # cut inside the two-byte character of pkg/m.py: the half character is dropped, not kept
    cut = len(b"Z = 0\na = 1\nb = 2\nm = '") + 1
    info = pycorpus.build(str(out), cut, [std, site])
    assert out.read_bytes() == b"Z = 0\na = 1\nb = 2\nm = '" and info["bytes"] == cut - 1
    out.read_text(encoding="utf-8")                     # what `gpucore prepro` will read


def test_command_line_refuses_a_size_that_is_not_positive(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "c.txt"), "--mb", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--mb: expected > 0, got 0.0" in r.stderr
