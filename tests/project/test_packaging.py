"""pyproject.toml ships every package: a non-editable install (a wheel, as on a GPU machine) once
left out posbench.tasks, so ``task=...`` failed there while every editable-install test passed."""

from __future__ import annotations

from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]


def test_every_python_package_is_listed_in_pyproject():
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setup["packages"])
    on_disk = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("posbench", "hydra_plugins")
        for init in (ROOT / top).rglob("__init__.py")
        if "__pycache__" not in init.parts
    }
    assert on_disk - listed == set(), f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"
    assert setup["package-dir"]["posbench.configs"] == "configs" and "posbench.configs" in listed
