"""One install story: the README, docs/install.md and scripts/test.sh name the same install
commands, none of them needs a host besides the package index, and the test script says which
torch it installed and reuses an environment when told to (the script is run with a stand-in
python that records what it is asked to do)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "test.sh"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def script_commands() -> list[str]:
    """The two installs scripts/test.sh runs by default, as a user types them."""
    text = SCRIPT.read_text()
    spec = re.search(r"TORCH_SPEC=\$\{POSBENCH_TORCH_SPEC:-([^}]+)\}", text).group(1)
    assert re.search(r'pip install -q "\$TORCH_SPEC"\n', text), "the plain torch install is gone"
    assert 'pip install -q -e ".[dev]"' in text
    return [f"pip install {spec}", 'pip install -e ".[dev]"']


@pytest.mark.parametrize("page", ["README.md", "docs/install.md", "docs/testing.md"])
def test_the_docs_name_the_test_scripts_install_commands(page):
    text = (ROOT / page).read_text(encoding="utf-8")
    for command in script_commands():
        assert command in text, f"{page} does not name `{command}`"
    for setting in ("POSBENCH_VENV", "--reuse"):
        assert setting in text, f"{page} does not document {setting}"


@pytest.mark.parametrize("page", ["README.md", "docs/install.md"])
def test_the_set_up_needs_no_second_host(page):
    """The CPU index is named as an option, never in the set-up commands themselves."""
    text = (ROOT / page).read_text(encoding="utf-8")
    setup = text[text.index("```bash"):text.index("```", text.index("```bash") + 3)]
    assert "pip install torch==2.13.0" in setup and "--index-url" not in setup
    assert f"--index-url {CPU_INDEX}" in text  # the optional CPU-only wheel, said where it comes from
    assert "CUDA build" in text and "runs on a CPU" in text  # what plain PyPI gives, said honestly


def fake_environment(tmp_path: Path, ready: bool) -> tuple[Path, Path]:
    """A POSBENCH_VENV whose python logs its arguments; ``ready``: it answers the reuse check."""
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
if [ "$1" = "-I" ]; then exit {0 if ready else 1}; fi
if [ "$1" = "-c" ]; then echo "test.sh: torch 2.13.0, a CUDA 12.8 build (stand-in)"; fi
exit 0
""")
    python.chmod(0o755)
    return venv, log


@pytest.mark.parametrize("reuse", [False, True])
def test_the_test_script_installs_the_plain_pin_or_reuses_the_environment(tmp_path, reuse):
    venv, log = fake_environment(tmp_path, ready=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    proc = subprocess.run(["bash", str(SCRIPT), *(["--reuse"] if reuse else []), "--fast", "-k", "x"],
                          env={**env, "POSBENCH_VENV": str(venv)}, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    installs = [c for c in calls if c.startswith("-m pip install")]
    if reuse:
        assert installs == [] and f"reusing {venv}" in proc.stdout
    else:  # what CI runs: the plain pin from the configured index, no second host
        assert "-m pip install -q torch==2.13.0" in installs and '-m pip install -q -e .[dev]' in installs
        assert not any("index-url" in c for c in installs)
    assert "torch.version.cuda" in log.read_text()  # it says what it installed
    assert "test.sh: torch 2.13.0, a CUDA 12.8 build" in proc.stdout
    assert calls[-1] == "-m pytest -q -m not slow -k x"


def test_reuse_installs_when_the_environment_is_not_ready(tmp_path):
    venv, log = fake_environment(tmp_path, ready=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith("POSBENCH_")}
    proc = subprocess.run(["bash", str(SCRIPT), "--reuse", "--fast"],
                          env={**env, "POSBENCH_VENV": str(venv), "POSBENCH_TORCH_INDEX": CPU_INDEX},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"-m pip install -q torch==2.13.0 --index-url {CPU_INDEX}" in log.read_text().splitlines()
