"""Files a user or a packager looks for at the top of the repository."""

from __future__ import annotations

import re

from conftest import REPO_DIR


def test_license_is_the_mit_text_pyproject_names():
    text = (REPO_DIR / "LICENSE").read_text(encoding="utf-8")
    assert text.startswith("MIT License\n")
    assert re.search(r"Copyright \(c\) \d{4} powerinfer-cpp contributors", text)
    assert "WITHOUT WARRANTY OF ANY KIND" in text
    pyproject = (REPO_DIR / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'^license = \{ text = "MIT" \}', pyproject, flags=re.M)


def test_test_modules_have_unique_names():
    """pytest imports each test file and helper by its bare name (no packages, the default
    import mode; conftest.py puts every test folder on sys.path): two files of one name in
    two folders would clash, and a second conftest.py would shadow `from conftest import`."""
    from conftest import TESTS_DIR

    names = sorted(p.name for p in TESTS_DIR.rglob("*.py") if "__pycache__" not in p.parts)
    assert names.count("conftest.py") == 1
    dup = sorted({n for n in names if names.count(n) > 1})
    assert not dup, f"test modules of the same name in two folders: {dup}"
    assert not list(TESTS_DIR.rglob("__init__.py"))  # folders, not packages
