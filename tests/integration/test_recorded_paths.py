"""A run trained inside a repository records its token cache relative to the repository, and
``posbench eval`` still finds the cache from that record alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_eval, run_train


@pytest.mark.slow
def test_a_run_records_its_cache_relative_to_the_repository_and_is_read_back_from_it(tmp_path, monkeypatch) -> None:
    from posbench.runs.load import load_run, run_data

    repo = tmp_path / "checkout"
    (repo / ".git").mkdir(parents=True)
    monkeypatch.chdir(repo)
    results = run_train(repo / "outputs" / "run", "method=rope", f"data.cache_dir={repo / '.cache'}")
    recorded = results["data"]["dir"]
    assert recorded.startswith(".cache/") and not Path(recorded).is_absolute()
    run = load_run(repo / "outputs" / "run")
    run.data_dir = None  # the checkpoint's own path aside: results.json's record alone
    assert run_data(run, log=lambda _: None).dir.resolve() == (repo / recorded).resolve()
    assert run_eval(repo / "outputs" / "run", "eval.lengths=[64]")["data"]["dir"] == recorded
