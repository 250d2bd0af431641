"""pycorpus.py -- the quality studies' corpus: Python sources already on the machine, one UTF-8 text.

    python tools/pycorpus.py corpus.txt --mb 24                   # the standard library's .py files
    python tools/pycorpus.py corpus.txt --mb 400 --site-packages  # and every installed package's

The device machines have no internet, so issue 16's "corpus larger than Tiny Shakespeare" is built
from text they already hold. Files are sorted by path in byte order (as `LC_ALL=C sort`) and
concatenated without separators, then cut at --mb megabytes: for the standard library alone this
is byte for byte what `find | sort | xargs cat | head -c` gave before (tools/optimizer_lab.sh), so
earlier figures stay comparable. A file that is not UTF-8 is skipped: `gpucore prepro` reads UTF-8
only. --site-packages adds the interpreter's purelib/platlib trees (on the device machines: torch,
transformers, sympy, numpy ...), enough for 1,000 steps of B=64 (65.5 M tokens) without repeating.
"""
import argparse
import os
import sys
import sysconfig


def roots(site_packages: bool) -> list[str]:
    paths = sysconfig.get_paths()
    out = [os.path.realpath(paths["stdlib"])]
    for key in ("purelib", "platlib") if site_packages else ():
        path = os.path.realpath(paths[key])
        if path not in out:
            out.append(path)
    return out


def python_files(root: str, skip_site_packages: bool):
    for dirpath, dirnames, filenames in os.walk(root):   # does not follow links, as find does not
        if skip_site_packages:
            dirnames[:] = [d for d in dirnames if d != "site-packages"]
        for name in filenames:
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def build(out_path: str, limit_bytes: int, tree_roots: list[str]) -> dict:
    """Write the first limit_bytes of the .py files under tree_roots; tree_roots[0] is the standard
    library, whose own site-packages folder (if it holds one) counts only as a later root."""
    files = set()
    for i, root in enumerate(tree_roots):
        files.update(python_files(root, skip_site_packages=(i == 0)))
    taken, skipped, size = [], 0, 0
    for path in sorted(files, key=os.fsencode):
        if size >= limit_bytes:
            break
        try:
            with open(path, "rb") as f:
                data = f.read()
            data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            skipped += 1
            continue
        taken.append(data)
        size += len(data)
    # cut at the limit, dropping a character the cut would split (its bytes cannot decode alone)
    text = b"".join(taken)[:limit_bytes].decode("utf-8", errors="ignore")
    with open(out_path, "w", encoding="utf-8", newline="") as f:
        f.write(text)
    return {"files": len(taken), "skipped_not_utf8": skipped, "bytes": len(text.encode("utf-8")),
            "roots": tree_roots}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the text file to write")
    ap.add_argument("--mb", type=float, default=24, help="at most this many megabytes (10^6 bytes)")
    ap.add_argument("--site-packages", action="store_true", help="add the installed packages' sources")
    a = ap.parse_args(argv)
    if a.mb <= 0:
        ap.error(f"--mb: expected > 0, got {a.mb}")
    info = build(a.out, int(a.mb * 1_000_000), roots(a.site_packages))
    print(f"corpus: {info['bytes']} bytes from {info['files']} .py files under {' and '.join(info['roots'])}"
          + (f" ({info['skipped_not_utf8']} not UTF-8, skipped)" if info["skipped_not_utf8"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
