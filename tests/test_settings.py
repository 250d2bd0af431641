"""gpucore.settings: the one configuration surface, and the structure rules it makes checkable.

- Settings are frozen; `using` overrides them for a block (nested, per thread, restored on errors).
- The environment is read once for the defaults (GPUCORE_CUBLASLT, GPUCORE_LT_AUTOTUNE,
  GPUCORE_SETTINGS), never at import.
- Training never imports the ladders; no package module imports another module's _private names.
"""
import ast
import dataclasses
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gpucore import settings

PACKAGE = Path(__file__).resolve().parent.parent / "gpucore"


def test_settings_are_frozen():
    s = settings.current()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.cublaslt = False


def test_using_overrides_nests_and_restores():
    before = settings.current()
    with settings.using(cublaslt=False) as s1:
        assert settings.current() is s1 and not s1.cublaslt
        with settings.using(lt_autotune=False):
            assert not settings.current().cublaslt and not settings.current().lt_autotune
        assert settings.current() is s1
    assert settings.current() == before


def test_using_restores_after_an_error():
    before = settings.current()
    with pytest.raises(RuntimeError):
        with settings.using(attention_v3_forward=False):
            raise RuntimeError("boom")
    assert settings.current() == before


def test_using_rejects_unknown_names():
    with pytest.raises(TypeError, match="unknown setting.*cublas_lt"):
        with settings.using(cublas_lt=False):
            pass


def test_using_is_per_thread():
    seen = {}
    with settings.using(fused_bias_grads=False):
        t = threading.Thread(target=lambda: seen.update(other=settings.current().fused_bias_grads))
        t.start()
        t.join()
        seen["here"] = settings.current().fused_bias_grads
    assert seen == {"other": True, "here": False}


def test_from_env_reads_the_documented_variables():
    assert settings.from_env({}) == settings.Settings()
    s = settings.from_env({"GPUCORE_CUBLASLT": "0", "GPUCORE_LT_AUTOTUNE": "0"})
    assert not s.cublaslt and not s.lt_autotune
    assert settings.from_env({"GPUCORE_CUBLASLT": "1"}).cublaslt
    s = settings.from_env({"GPUCORE_SETTINGS": "gelu_epilogue=0, lm_head_chunk_bytes=4096,lt_tune_cache=/x.json"})
    assert (s.gelu_epilogue, s.lm_head_chunk_bytes, s.lt_tune_cache) == (False, 4096, "/x.json")
    assert settings.from_env({"GPUCORE_SETTINGS": "fused_bias_grads=false"}).fused_bias_grads is False
    for bad, msg in (("nope=1", "known"), ("gelu_epilogue", "name=value"), ("gelu_epilogue=2", "0, 1"),
                     ("lm_head_chunk_bytes=big", "int")):
        with pytest.raises(ValueError, match=msg):
            settings.from_env({"GPUCORE_SETTINGS": bad})


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=PACKAGE.parent).stdout


def test_training_never_imports_the_ladders():
    out = _run("import sys, gpucore, gpucore.model, gpucore.train, gpucore.optim, gpucore.sample\n"
               "print(sorted(m for m in sys.modules if m.startswith('gpucore.ladder')))")
    assert out.strip() == "[]", out
    out = _run("import sys, gpucore; gpucore.gemm; print('gpucore.ladder.gemm' in sys.modules)")
    assert out.strip() == "True"                 # gpucore.gemm loads the ladder on first use


def test_settings_read_the_environment_lazily():
    out = _run("import os, gpucore\nfrom gpucore import settings\n"
               "os.environ['GPUCORE_CUBLASLT'] = '0'\nprint(settings.current().cublaslt)")
    assert out.strip() == "False", "the defaults must be built on first use, not at import"


def _private_imports(path: Path):
    """(line, text) of every `from gpucore... import _name` and `<gpucore module alias>._name` in a file."""
    tree = ast.parse(path.read_text())
    aliases, bad = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("gpucore")):
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__"):
                    bad.append((node.lineno, f"from {'.' * node.level}{node.module or ''} import {a.name}"))
                else:
                    aliases.add(a.asname or a.name)
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("gpucore"):
                    aliases.add(a.asname or a.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append((node.lineno, f"{node.value.id}.{node.attr}"))
    return bad


def test_no_module_uses_another_modules_private_names():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        bad = _private_imports(path)
        if bad:
            found[str(path.relative_to(PACKAGE.parent))] = bad
    assert not found, found
