"""Records name places without the writing machine's absolute paths (posbench.core.paths), and
read them back."""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from posbench.core.paths import recorded_location, recorded_path, repository_root


@pytest.fixture
def repo(tmp_path, monkeypatch) -> Path:
    """A repository (a folder with .git) as the working directory, with a home folder elsewhere."""
    root = tmp_path / "checkout"
    (root / ".git").mkdir(parents=True)
    monkeypatch.chdir(root)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return root


def test_a_path_in_the_repository_is_recorded_relative_to_it_and_read_back(repo, tmp_path) -> None:
    cache = repo / ".gpucache" / "data" / "sample-bpe"
    cache.mkdir(parents=True)
    assert repository_root() == repo.resolve() and repository_root(cache) == repo.resolve()
    assert recorded_path(cache) == ".gpucache/data/sample-bpe"
    assert recorded_location(".gpucache/data/sample-bpe") == repo.resolve() / ".gpucache/data/sample-bpe"


def test_a_path_in_the_home_folder_is_recorded_from_tilde(repo, tmp_path) -> None:
    cache = tmp_path / "home" / ".cache" / "posbench" / "data" / "x"
    assert recorded_path(cache) == "~/.cache/posbench/data/x"
    assert recorded_location("~/.cache/posbench/data/x") == cache


def test_any_other_path_and_an_old_absolute_record_stay_as_they_are(repo, tmp_path) -> None:
    elsewhere = tmp_path / "scratch" / "cache"
    assert recorded_path(elsewhere) == str(elsewhere)
    assert recorded_location(str(elsewhere)) == elsewhere


def test_a_text_run_records_its_token_cache_without_the_machine_path(repo) -> None:
    from posbench.train.workload import TextWorkload

    prepared = types.SimpleNamespace(dir=repo / ".cache" / "data" / "sample", meta={"vocab_size": 3})
    assert TextWorkload(prepared).record() == {"dir": ".cache/data/sample", "meta": {"vocab_size": 3}}


def test_a_sweep_summary_names_its_folder_relative_to_the_repository(repo) -> None:
    from posbench.commands.sweep import sweep_summary

    assert sweep_summary(repo / "outputs" / "sweep", [], []).startswith("# Sweep summary: outputs/sweep\n")
