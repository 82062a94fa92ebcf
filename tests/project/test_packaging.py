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


def test_the_version_is_the_same_in_pyproject_the_package_and_the_changelog():
    """Every run records ``posbench.__version__``; the changelog's newest entry must name it, or a
    recorded number cannot be traced to what changed."""
    import re

    import posbench

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    newest = re.search(r"^## (\S+) — \d{4}-\d{2}-\d{2}$", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert posbench.__version__ == version, "set posbench/__init__.py __version__ to pyproject.toml's version"
    assert newest is not None and newest.group(1) == version, "the newest CHANGELOG.md entry must be this version"


def test_hydra_is_capped_below_its_next_minor_version_where_its_private_api_is_imported():
    """posbench imports ``hydra._internal`` (the command-line parser, the basic sweeper): a minor
    release of Hydra may change it, so the requirement stops before one, and every such import says so."""
    import re

    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    hydra = next(d for d in dependencies if d.startswith("hydra-core"))
    assert re.fullmatch(r"hydra-core>=1\.3\.\d+,<1\.4", hydra), hydra
    for path in [*(ROOT / "posbench").rglob("*.py"), *(ROOT / "hydra_plugins").rglob("*.py")]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hydra._internal" in line and "import" in line:
                assert "Private Hydra API" in "\n".join(lines[max(0, i - 3):i]), f"{path}:{i + 1}: comment the import"
