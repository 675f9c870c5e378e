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
