# A package so that pytest's default ("prepend") import mode can hold tests/ladder/test_<family>.py
# beside tests/test_<family>.py (two rootless test modules of one basename collide at collection).
# tests/conftest.py still applies here, and tests/ stays on sys.path (conftest, gradcheck, *_checks).
