"""Data pipeline: sources, tokenizers, the token cache (reuse, atomicity, locking), loaders."""

from __future__ import annotations

import gzip
import json
import multiprocessing as mp
import os
import signal
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

import posbench.data.prepare as prepare_mod
import posbench.data.sources as sources_mod
from posbench.core.errors import PosbenchError
from posbench.data import DataConfig, PreparedData, prepare_data, tokenize_with
from posbench.data.synthetic import generate_stories

CONFIGS = Path(__file__).resolve().parents[3] / "configs" / "data"


def synth_cfg(cache: Path, **overrides) -> DataConfig:
    """Small synthetic setup: prepares in well under a second."""
    values = dict(source="synthetic", synthetic_train_stories=120, synthetic_valid_stories=20,
                  bpe_vocab_size=400, cache_dir=str(cache))
    return DataConfig(**{**values, **overrides})


def local_cfg(cache: Path, path: Path | str, **overrides) -> DataConfig:
    return DataConfig(**{**dict(source="local", path=str(path), bpe_vocab_size=300, cache_dir=str(cache)), **overrides})


def write_stories(path: Path, stories: list[str]) -> Path:
    """Write stories in the format its extension names."""
    name = path.name
    if name.endswith(".parquet"):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": stories, "id": list(range(len(stories)))}), path)
        return path
    if ".jsonl" in name:
        body = "".join(json.dumps({"text": s, "id": i}) + "\n" for i, s in enumerate(stories))
    else:
        body = "\n<|endoftext|>\n".join(stories) + "\n"
    data = body.encode()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


def split_stories(tokens: np.ndarray, eot: int) -> list[np.ndarray]:
    """Cut a stream after every end-of-text token (each piece keeps its trailing EOT)."""
    ends = np.flatnonzero(tokens == eot) + 1
    return np.split(np.asarray(tokens), ends)[:-1]


def one_line_error(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------- config


def test_yaml_configs_hold_every_field():
    from omegaconf import OmegaConf

    names = {f.name for f in fields(DataConfig)}
    for yaml in ("tinystories", "local", "sample", "synthetic"):
        values = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{yaml}.yaml"), resolve=True)
        assert set(values) == names, yaml
        cfg = DataConfig.from_dict({**values, "path": values["path"] or "somewhere"})
        assert cfg.validate().source == {"tinystories": "hub"}.get(yaml, yaml)


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("POSBENCH_CACHE", str(tmp_path / "c"))
    assert DataConfig().cache_root() == tmp_path / "c"


@pytest.mark.parametrize("overrides, needle", [
    (dict(source="ftp"), "data.source"),
    (dict(source="local"), "data.path"),
    (dict(max_train_stories=0), "max_train_stories"),
    (dict(synthetic_valid_stories=-1), "synthetic_valid_stories"),
    (dict(valid_fraction=0.0), "valid_fraction"),
    (dict(bpe_vocab_size=100), "bpe_vocab_size"),
])
def test_config_validation(overrides, needle):
    with pytest.raises(PosbenchError, match=needle) as excinfo:
        DataConfig(**overrides).validate()
    one_line_error(excinfo)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(PosbenchError, match="nope"):
        DataConfig.from_dict({"nope": 1})


# ----------------------------------------------------------------------- synthetic end to end


def test_synthetic_stories_are_deterministic_and_long():
    a, b = generate_stories(50, seed=3), generate_stories(50, seed=3)
    assert a == b and a != generate_stories(50, seed=4)
    assert a[:5] != generate_stories(5, seed=3, split="validation")
    words = [len(s.split()) for s in a]
    assert 90 <= min(words) and max(words) <= 450
    hero = a[0].split(" named ")[1].split(".")[0] if " named " in a[0] else None
    assert hero is None or a[0].count(hero) >= 3  # the hero comes back later in the story


@pytest.mark.slow
def test_synthetic_end_to_end(tmp_path):
    logs: list[str] = []
    cfg = synth_cfg(tmp_path)
    data = prepare_data(cfg, log=logs.append)
    meta = data.meta
    assert data.dir.parent == tmp_path / "data" and any("wrote" in m for m in logs)
    assert meta["dtype"] == "uint16" and data.vocab_size <= 400 and data.eot_id == 0
    for key in ("source", "tokenizer", "vocab_size", "eot_id", "created", "format_version", "settings"):
        assert key in meta
    assert (data.dir / "tokenizer.json").is_file()
    for split, n_stories, gen_split in (("train", 120, "train"), ("validation", 20, "validation")):
        tokens = data.tokens(split)
        assert isinstance(tokens, np.memmap) and not tokens.flags.writeable
        assert len(tokens) == meta["splits"][split]["tokens"]
        assert meta["splits"][split]["stories"] == n_stories
        pieces = split_stories(tokens, data.eot_id)
        assert len(pieces) == n_stories and tokens[-1] == data.eot_id  # EOT after every story
        expected = generate_stories(n_stories, cfg.synthetic_seed, gen_split)
        for i in (0, n_stories // 2, n_stories - 1):
            assert data.decode(pieces[i][:-1]) == expected[i].strip()
        assert data.encode([expected[0]])[0] == pieces[0][:-1].tolist()
    assert np.array_equal(data.tokens("valid"), data.valid_tokens())
    with pytest.raises(PosbenchError, match="unknown split"):
        data.tokens("holdout")
    with pytest.raises(PosbenchError, match="no test split"):  # synthetic text has none
        data.tokens("test")


def test_cache_reuse_skips_tokenizing(tmp_path, monkeypatch):
    cfg = synth_cfg(tmp_path)
    first = prepare_data(cfg, log=lambda m: None)
    mtime = (first.dir / "train.bin").stat().st_mtime_ns

    def must_not_run(*args, **kwargs):
        raise AssertionError("re-tokenized although a cache exists")

    monkeypatch.setattr(prepare_mod, "tokenize_split", must_not_run)
    monkeypatch.setattr(prepare_mod, "train_bpe", must_not_run)
    logs: list[str] = []
    second = prepare_data(cfg, log=logs.append)
    assert second.dir == first.dir and logs == [f"reusing cache {first.dir}"]
    assert (second.dir / "train.bin").stat().st_mtime_ns == mtime
    other = DataConfig(**{**cfg.to_dict(), "max_train_stories": 50})
    monkeypatch.undo()
    assert prepare_data(other, log=lambda m: None).dir != first.dir  # different settings, new key


def test_crash_mid_prepare_leaves_no_cache(tmp_path, monkeypatch):
    real = prepare_mod.tokenize_split

    def crash_on_validation(*args, **kwargs):
        if args[-1] == "validation":
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_mod, "tokenize_split", crash_on_validation)
    cfg = synth_cfg(tmp_path)
    with pytest.raises(RuntimeError, match="simulated crash"):
        prepare_data(cfg, log=lambda m: None)
    assert [p.name for p in (tmp_path / "data").iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.undo()
    data = prepare_data(cfg, log=lambda m: None)
    assert data.num_tokens("validation") > 0


def _prepare_then_die(cache_dir: str) -> None:
    """Child process: SIGKILL itself in the middle of a prepare (after train.bin is written)."""
    import posbench.data.prepare as P

    real = P.tokenize_split

    def die(*args, **kwargs):
        if args[-1] == "validation":
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    P.tokenize_split = die
    P.prepare_data(synth_cfg(Path(cache_dir)), log=lambda m: None)


@pytest.mark.slow
def test_killed_prepare_leaves_nothing_that_looks_valid(tmp_path):
    proc = mp.get_context("spawn").Process(target=_prepare_then_die, args=(str(tmp_path),))
    proc.start()
    proc.join(120)
    assert proc.exitcode == -signal.SIGKILL
    root = tmp_path / "data"
    leftovers = [p for p in root.iterdir() if not p.name.endswith(".lock")]
    assert leftovers and all(p.name.startswith(".tmp-") for p in leftovers)  # hidden, never reused
    data = prepare_data(synth_cfg(tmp_path), log=lambda m: None)  # the dead process's lock is free
    assert [p for p in root.iterdir() if not p.name.endswith(".lock")] == [data.dir]


def test_corrupt_cache_detected(tmp_path):
    cfg = synth_cfg(tmp_path)
    data = prepare_data(cfg, log=lambda m: None)
    train = data.dir / "train.bin"
    size = train.stat().st_size
    with open(train, "r+b") as f:
        f.truncate(size - 2)
    with pytest.raises(PosbenchError, match="data.rebuild=true") as excinfo:
        prepare_data(cfg, log=lambda m: None)
    assert str(data.dir) in one_line_error(excinfo)
    rebuilt = prepare_data(DataConfig(**{**cfg.to_dict(), "rebuild": True}), log=lambda m: None)
    assert rebuilt.dir == data.dir and train.stat().st_size == size

    with open(train, "r+b") as f:  # same size, different bytes: only the sha256 check sees it
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    PreparedData.open(data.dir)
    with pytest.raises(PosbenchError, match="sha256"):
        PreparedData.open(data.dir, verify=True)

    (data.dir / "meta.json").write_text("{not json")
    with pytest.raises(PosbenchError, match="corrupt"):
        PreparedData.open(data.dir)


def _prepare_in_child(cache_dir: str, barrier, queue) -> None:
    logs: list[str] = []
    barrier.wait()
    data = prepare_data(synth_cfg(Path(cache_dir)), log=logs.append)
    queue.put((str(data.dir), logs))


@pytest.mark.slow
def test_concurrent_preparers_build_once(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_prepare_in_child, args=(str(tmp_path), barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    dirs = {d for d, _ in results}
    assert len(dirs) == 1
    builds = sum(any(m.startswith("wrote ") for m in logs) for _, logs in results)
    reuses = sum(any(m.startswith("reusing cache") for m in logs) for _, logs in results)
    assert (builds, reuses) == (1, 1)
    assert [p for p in (tmp_path / "data").iterdir() if not p.name.endswith(".lock")] == [Path(dirs.pop())]


# -------------------------------------------------------------------------------- local files


@pytest.mark.parametrize("ext", ["txt", "txt.gz", "jsonl", "jsonl.gz", "parquet"])
def test_local_formats(tmp_path, tiny_corpus, ext):
    src = tmp_path / "src"
    src.mkdir()
    write_stories(src / f"train.{ext}", tiny_corpus["train"])
    write_stories(src / f"valid.{ext}", tiny_corpus["validation"])
    (src / "SOURCE.md").write_text("ignored: not a text format")
    data = prepare_data(local_cfg(tmp_path / "cache", src), log=lambda m: None)
    assert data.meta["splits"]["train"]["stories"] == len(tiny_corpus["train"])
    assert data.meta["splits"]["validation"]["stories"] == len(tiny_corpus["validation"])
    pieces = split_stories(data.valid_tokens(), data.eot_id)
    assert [data.decode(p[:-1]) for p in pieces] == tiny_corpus["validation"]


def test_local_file_list_and_name_rules(tmp_path, tiny_corpus):
    a = write_stories(tmp_path / "stories-train.txt", tiny_corpus["train"])
    b = write_stories(tmp_path / "stories-val.jsonl", tiny_corpus["validation"])
    c = write_stories(tmp_path / "stories-test.txt", ["a test story", "another test story", "a third"])
    data = prepare_data(local_cfg(tmp_path / "cache", f"{a},{b},{c}"), log=lambda m: None)
    assert data.meta["splits"]["train"]["stories"] == len(tiny_corpus["train"])
    assert data.meta["splits"]["validation"]["stories"] == len(tiny_corpus["validation"])
    assert data.meta["splits"]["test"]["stories"] == 3  # evaluation-only: not in train


@pytest.mark.parametrize("name, split", [
    ("train.txt", "train"), ("TinyStories-train.txt.gz", "train"), ("stories_train_v2.jsonl", "train"),
    ("valid.txt", "validation"), ("validation.txt", "validation"), ("my.val.txt", "validation"),
    ("dev.jsonl", "validation"), ("pretrain_valid.txt", "validation"), ("restrained_valid.txt", "validation"),
    ("test.txt", "test"), ("stories-test.txt.gz", "test"),
    ("held_out.txt", None), ("pretrain.txt", None), ("contest.txt", None), ("interval.txt", None),
    ("devotion.txt", None),
])
def test_files_are_sorted_by_whole_name_parts(name, split):
    anchor = Path("train.txt") if split != "train" else Path("valid.txt")  # so not everything is training text
    splits, ignored = sources_mod.classify([Path(name), anchor])
    found = [s for s, files in splits.items() if Path(name) in files]
    assert found == ([split] if split else [])
    assert len(ignored) == (0 if split else 1)
    if split is None:
        assert name in ignored[0] and "no part train" in ignored[0] and "\n" not in ignored[0]


def test_unnamed_files_are_training_text_when_no_file_names_train_or_validation():
    splits, ignored = sources_mod.classify([Path("stories.txt"), Path("test.txt")])
    assert splits == {"train": [Path("stories.txt")], "validation": [], "test": [Path("test.txt")]}
    assert ignored == []


def test_file_naming_two_splits_is_refused():
    with pytest.raises(PosbenchError, match="several splits") as excinfo:
        sources_mod.classify([Path("train_valid.txt")])
    one_line_error(excinfo)


def test_test_files_are_never_trained_on_and_can_be_evaluated(tmp_path, tiny_corpus):
    src = tmp_path / "src"
    src.mkdir()
    write_stories(src / "train.txt", tiny_corpus["train"])
    write_stories(src / "test.txt", ["A zebra test story about Zed.", "Zed the zebra again."])
    write_stories(src / "held_out.txt", ["ignored text"])
    logs: list[str] = []
    data = prepare_data(local_cfg(tmp_path / "c", src), log=logs.append)
    ignored = [line for line in logs if "held_out.txt" in line]
    assert len(ignored) == 1 and ignored[0].startswith("ignored ") and "rename" in ignored[0]
    test_text = [data.decode(p[:-1]) for p in split_stories(data.tokens("test"), data.eot_id)]
    assert test_text == ["A zebra test story about Zed.", "Zed the zebra again."]
    train_text = data.decode(data.train_tokens()) + data.decode(data.valid_tokens())
    assert "zebra" not in train_text and "ignored text" not in train_text
    # reopened from the cache, the test split is still there; a cache without one says so
    assert PreparedData.open(data.dir).num_tokens("test") == data.num_tokens("test")
    plain = prepare_data(local_cfg(tmp_path / "c", src / "train.txt"), log=lambda m: None)
    assert not plain.has_split("test") and "test" not in plain.meta["splits"]
    with pytest.raises(PosbenchError, match="no test split") as excinfo:
        plain.tokens("test")
    one_line_error(excinfo)


def test_local_holdout_is_deterministic(tmp_path, tiny_corpus):
    path = write_stories(tmp_path / "stories.txt", tiny_corpus["train"])  # no split in the name
    runs = [prepare_data(local_cfg(tmp_path / f"c{i}", path, valid_fraction=0.1), log=lambda m: None) for i in range(2)]
    assert runs[0].meta["splits"]["validation"]["stories"] == 3
    assert runs[0].meta["splits"]["train"]["stories"] == len(tiny_corpus["train"]) - 3
    assert np.array_equal(runs[0].valid_tokens(), runs[1].valid_tokens())


def test_local_caps_take_the_first_stories(tmp_path, tiny_corpus):
    src = tmp_path / "src"
    src.mkdir()
    write_stories(src / "train.txt", tiny_corpus["train"])
    write_stories(src / "valid.txt", tiny_corpus["validation"])
    data = prepare_data(local_cfg(tmp_path / "c", src, max_train_stories=4, max_valid_stories=2), log=lambda m: None)
    pieces = split_stories(data.train_tokens(), data.eot_id)
    assert [data.decode(p[:-1]) for p in pieces] == tiny_corpus["train"][:4]
    assert data.meta["splits"]["validation"]["stories"] == 2


def test_touching_a_local_file_changes_the_key(tmp_path, tiny_corpus):
    path = write_stories(tmp_path / "stories.txt", tiny_corpus["train"])
    first = prepare_data(local_cfg(tmp_path / "c", path), log=lambda m: None)
    os.utime(path, ns=(0, 0))
    assert prepare_data(local_cfg(tmp_path / "c", path), log=lambda m: None).dir != first.dir


@pytest.mark.parametrize("case, needle", [
    ("missing", "does not exist"),
    ("empty", "contains no stories"),
    ("separators_only", "contains no stories"),
    ("unsupported", "unsupported file type"),
    ("jsonl_no_text", "'text' field"),
    ("bad_json", "not valid JSON"),
    ("parquet_no_text", "no 'text' column"),
    ("dir_without_text", "has no"),
    ("only_validation", "no training stories"),
])
def test_local_errors(tmp_path, case, needle):
    path = tmp_path / "in"
    if case == "missing":
        path = tmp_path / "nowhere"
    elif case == "empty":
        path = tmp_path / "train.txt"
        path.write_text("")
    elif case == "separators_only":
        path = tmp_path / "train.txt.gz"
        path.write_bytes(gzip.compress(b"<|endoftext|>\n\n<|endoftext|>\n"))
    elif case == "unsupported":
        path = tmp_path / "train.csv"
        path.write_text("text\nhello\n")
    elif case == "jsonl_no_text":
        path = tmp_path / "train.jsonl"
        path.write_text('{"story": "hello"}\n')
    elif case == "bad_json":
        path = tmp_path / "train.jsonl"
        path.write_text('{"text": "hello"\n')
    elif case == "parquet_no_text":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "train.parquet"
        pq.write_table(pa.table({"story": ["hello"]}), path)
    elif case == "dir_without_text":
        path.mkdir()
        (path / "notes.md").write_text("hi")
    elif case == "only_validation":
        path = write_stories(tmp_path / "valid.txt", ["a story", "another story"])
    with pytest.raises(PosbenchError, match=needle) as excinfo:
        prepare_data(local_cfg(tmp_path / "cache", path), log=lambda m: None)
    one_line_error(excinfo)


# ---------------------------------------------------------------------------------- tokenizers


def test_bpe_trains_on_training_text_only(tmp_path, tiny_corpus, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    write_stories(src / "train.txt", tiny_corpus["train"])
    valid = [f"Zorblaxian Quuxfrob {i}. " * 30 for i in range(5)]
    write_stories(src / "valid.txt", valid)
    seen: list[str] = []
    real = prepare_mod.train_bpe

    def recording(texts, *args, **kwargs):
        batches = list(texts)
        seen.extend(t for batch in batches for t in batch)
        return real(iter(batches), *args, **kwargs)

    monkeypatch.setattr(prepare_mod, "train_bpe", recording)
    data = prepare_data(local_cfg(tmp_path / "cache", src), log=lambda m: None)
    assert sorted(seen) == sorted(tiny_corpus["train"])
    assert len(data.encode([" Zorblaxian"])[0]) > 2  # frequent in validation, unknown to the BPE


def test_unknown_tokenizer_path(tmp_path):
    with pytest.raises(PosbenchError, match="does not exist") as excinfo:
        prepare_data(synth_cfg(tmp_path, tokenizer="./no/such/tokenizer"), log=lambda m: None)
    assert "data.tokenizer" in one_line_error(excinfo)


def test_unknown_tokenizer_name_hub_unreachable(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_mod, "hub_unreachable_reason", lambda timeout=3.0: "cannot connect (test)")
    with pytest.raises(PosbenchError, match="cannot connect") as excinfo:
        prepare_data(synth_cfg(tmp_path, tokenizer="no-such-org/no-such-tokenizer"), log=lambda m: None)
    assert "data.tokenizer" in one_line_error(excinfo)


def test_unknown_tokenizer_name_real_loader_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no network, no retries
    with pytest.raises(PosbenchError, match="could not load tokenizer") as excinfo:
        prepare_data(synth_cfg(tmp_path, tokenizer="posbench-test/does-not-exist"), log=lambda m: None)
    assert "data.tokenizer" in one_line_error(excinfo)


def test_tokenize_with_reuses_the_tokenizer(tmp_path, tiny_corpus):
    base = prepare_data(synth_cfg(tmp_path), log=lambda m: None)
    path = write_stories(tmp_path / "other.txt", tiny_corpus["validation"])
    cfg = local_cfg(tmp_path, path, valid_fraction=1.0, tokenizer="ignored")
    other = tokenize_with(base, cfg, log=lambda m: None)
    assert other.dir != base.dir
    assert (other.vocab_size, other.eot_id) == (base.vocab_size, base.eot_id)
    assert (other.dir / "tokenizer.json").read_bytes() == (base.dir / "tokenizer.json").read_bytes()
    assert other.num_tokens("train") == 0 and len(other.train_tokens()) == 0
    expected = [t for ids in base.encode(tiny_corpus["validation"]) for t in ids + [base.eot_id]]
    assert other.valid_tokens().tolist() == expected
    logs: list[str] = []
    assert tokenize_with(base, cfg, log=logs.append).dir == other.dir and logs[0].startswith("reusing")
    # eval-only text in a file named test: it is the held-out text (and the test split)
    test_file = write_stories(tmp_path / "test.txt", tiny_corpus["validation"])
    only_test = tokenize_with(base, local_cfg(tmp_path, test_file, valid_fraction=1.0), log=lambda m: None)
    assert only_test.valid_tokens().tolist() == expected == only_test.tokens("test").tolist()


# --------------------------------------------------------------------------------------- hub


def test_hub_unreachable_names_the_offline_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(sources_mod, "hub_unreachable_reason", lambda timeout=3.0: "cannot connect to huggingface.co: test")
    with pytest.raises(PosbenchError, match="roneneldan/TinyStories") as excinfo:
        prepare_data(DataConfig(cache_dir=str(tmp_path)), log=lambda m: None)
    message = one_line_error(excinfo)
    assert "data.path" in message and "data=local" in message and "data=sample" in message


def test_hub_load_error_is_converted(tmp_path, monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(sources_mod, "hub_unreachable_reason", lambda timeout=3.0: None)
    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(PosbenchError, match="ConnectionError") as excinfo:
        prepare_data(DataConfig(cache_dir=str(tmp_path)), log=lambda m: None)
    assert "data.path" in one_line_error(excinfo)


def test_hub_real_loader_error_is_converted(tmp_path, monkeypatch):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fails at once, no retries
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(PosbenchError, match="posbench-test/does-not-exist") as excinfo:
        prepare_data(DataConfig(hub_name="posbench-test/does-not-exist", cache_dir=str(tmp_path)), log=lambda m: None)
    assert "data.path" in one_line_error(excinfo)


def test_hub_source_with_fake_loader(tmp_path, monkeypatch, tiny_corpus):
    import datasets

    def fake(name, config=None, **kwargs):
        return datasets.DatasetDict({
            split: datasets.Dataset.from_dict({"text": texts, "n": list(range(len(texts)))})
            for split, texts in tiny_corpus.items()
        })

    monkeypatch.setattr(sources_mod, "hub_unreachable_reason", lambda timeout=3.0: None)
    monkeypatch.setattr(datasets, "load_dataset", fake)
    cfg = DataConfig(cache_dir=str(tmp_path), bpe_vocab_size=300, max_train_stories=10)
    data = prepare_data(cfg, log=lambda m: None)
    assert data.meta["splits"]["train"]["stories"] == 10
    assert data.meta["source"]["name"] == "roneneldan/TinyStories"
    with pytest.raises(PosbenchError, match="no split 'dev'"):
        prepare_data(DataConfig(**{**cfg.to_dict(), "valid_split": "dev"}), log=lambda m: None)


# ------------------------------------------------------------------------------------ loaders
# torch is imported here, not at the top: the spawned children of the tests above import this
# module, and a torch import per child would cost seconds.


@pytest.fixture
def torch():
    import torch

    return torch


@pytest.fixture
def TrainBatches():
    from posbench.data.loader import TrainBatches

    return TrainBatches


@pytest.fixture
def eval_sequences():
    from posbench.data.loader import eval_sequences

    return eval_sequences


def test_train_batches_content_and_determinism(torch, TrainBatches):
    tokens = np.arange(1001, dtype=np.uint16)
    batches = TrainBatches(tokens, context=10, batch_size=8, seed=1)
    assert batches.num_windows == 100 and batches.steps_per_epoch == 12 and batches.epoch(25) == 2.0
    x, y = batches.get(3)
    assert x.shape == y.shape == (8, 10) and x.dtype == y.dtype == torch.int64
    starts = batches.windows(3) * 10
    assert torch.equal(x, torch.from_numpy(starts[:, None] + np.arange(10)))
    assert torch.equal(y, x + 1)
    fresh = TrainBatches(tokens, context=10, batch_size=8, seed=1)
    for step in (40, 0, 3):  # any order: a batch is a pure function of (seed, step)
        assert torch.equal(fresh.get(step)[0], batches.get(step)[0])
    assert not torch.equal(TrainBatches(tokens, 10, 8, seed=2).get(3)[0], x)


def test_train_batches_cover_every_window_once_per_epoch(torch, TrainBatches):
    batches = TrainBatches(np.zeros(1001, dtype=np.uint16), context=10, batch_size=8, seed=0)
    samples = np.concatenate([batches.windows(s) for s in range(25)])  # 200 samples = 2 epochs
    first, second = samples[:100], samples[100:200]
    assert np.array_equal(np.sort(first), np.arange(100))
    assert np.array_equal(np.sort(second), np.arange(100))
    assert not np.array_equal(first, second)


def test_train_batches_ranks_split_the_global_batch(torch, TrainBatches):
    tokens = np.random.default_rng(0).integers(0, 500, 5000).astype(np.uint16)
    single = TrainBatches(tokens, context=16, batch_size=12, seed=7)
    ranks = [TrainBatches(tokens, context=16, batch_size=12, seed=7, rank=r, world_size=4) for r in range(4)]
    for step in (0, 5, 26):
        gx, gy = single.get(step)
        for r, b in enumerate(ranks):
            x, y = b.get(step)
            assert x.shape == (3, 16)
            assert torch.equal(x, gx[r::4]) and torch.equal(y, gy[r::4])


def test_train_batches_errors(torch, TrainBatches):
    with pytest.raises(PosbenchError, match="divisible"):
        TrainBatches(np.zeros(100, dtype=np.uint16), context=8, batch_size=6, seed=0, world_size=4)
    with pytest.raises(PosbenchError, match="50 tokens"):
        TrainBatches(np.zeros(50, dtype=np.uint16), context=64, batch_size=2, seed=0)


def test_eval_sequences(torch, eval_sequences):
    tokens = np.arange(100, dtype=np.uint16)
    seqs = eval_sequences(tokens, length=9, num_sequences=3)
    assert seqs.dtype == torch.int64 and seqs.shape == (3, 10)
    assert torch.equal(seqs, torch.arange(30).reshape(3, 10))
    assert eval_sequences(tokens, length=9, num_sequences=50).shape == (10, 10)  # as many as fit
    with pytest.raises(PosbenchError, match="has 100 tokens") as excinfo:
        eval_sequences(tokens, length=100, num_sequences=1)
    assert "lower" in one_line_error(excinfo)


# ------------------------------------------------------------- the packaged TinyStories sample


def test_packaged_sample_is_the_documented_text(sample_data):
    train, valid = sources_mod.read_stories(sample_data / "train.txt.gz"), sources_mod.read_stories(sample_data / "valid.txt.gz")
    assert (len(train), len(valid)) == (15_797, 971)  # as stated in SOURCE.md
    assert valid[0].startswith("Spot. Spot saw the shiny car")
    assert "CDLA-Sharing-1.0" in (sample_data / "SOURCE.md").read_text()
    assert "CDLA-Sharing-1.0" in (sample_data / "NOTICE.md").read_text()
    spec = sources_mod.resolve_source(DataConfig(source="sample"))
    assert [p.name for p in spec.train_files + spec.valid_files] == ["train.txt.gz", "valid.txt.gz"]
    assert spec.identity["kind"] == "sample" and not spec.ignored


def test_vocab_merges_dir_tokenizer_on_sample(tmp_path, sample_data):
    """A GPT-2 style tokenizer dir (vocab.json + merges.txt), built here from a BPE trained on
    the sample, so the test needs no download; it must encode exactly like the BPE it came from."""
    from posbench.data.tokenizer import train_bpe

    stories = sources_mod.read_stories(sample_data / "train.txt.gz")[:500]
    bpe = train_bpe(iter([stories]), 600, length=len(stories))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    bpe.model.save(str(tok_dir))  # writes vocab.json + merges.txt
    assert sorted(p.name for p in tok_dir.iterdir()) == ["merges.txt", "vocab.json"]
    cfg = DataConfig(source="sample", tokenizer=str(tok_dir), max_train_stories=200, max_valid_stories=50,
                     cache_dir=str(tmp_path / "cache"))
    data = prepare_data(cfg, log=lambda m: None)
    assert data.meta["tokenizer"]["kind"] == "pretrained" and data.vocab_size == 600
    text = " Once upon a time, there was a little girl named Lily."
    assert data.encode([text])[0] == bpe.encode(text, add_special_tokens=False).ids
    first = split_stories(data.valid_tokens(), data.eot_id)[0]
    assert data.decode(first[:-1]).startswith("Spot. Spot saw the shiny car")


@pytest.mark.slow
def test_packaged_sample_default_bpe(tmp_path, sample_data):
    cfg = DataConfig(source="sample", max_train_stories=2000, cache_dir=str(tmp_path))
    data = prepare_data(cfg, log=lambda m: None)
    assert data.meta["tokenizer"]["kind"] == "bpe" and data.eot_id == 0
    assert 4000 < data.vocab_size <= 8192 and data.meta["dtype"] == "uint16"
    assert data.meta["splits"]["train"]["stories"] == 2000
    assert data.meta["splits"]["validation"]["stories"] == 971
    # TinyStories words are mostly single tokens of the 8192 BPE
    assert len(data.encode([" Once upon a time, there was a little girl named Lily."])[0]) <= 14
    logs: list[str] = []
    assert prepare_data(cfg, log=logs.append).dir == data.dir and logs[0].startswith("reusing")


def test_the_packaged_sample_is_cached_by_content_not_by_location(tmp_path, monkeypatch):
    """Every checkout and install shares one sample cache: a copy elsewhere with other mtimes
    resolves to the same cache directory; a changed byte does not."""
    import shutil

    from posbench.data import cache_dir_of, sources

    cfg = DataConfig(source="sample", cache_dir=str(tmp_path / "cache"))
    original = cache_dir_of(cfg)
    copy = tmp_path / "elsewhere" / "sample"
    shutil.copytree(sources.SAMPLE_DIR, copy)
    for f in copy.iterdir():
        os.utime(f, (1_000_000_000, 1_000_000_000))
    monkeypatch.setattr(sources, "SAMPLE_DIR", copy)
    assert cache_dir_of(cfg) == original
    with open(copy / "valid.txt.gz", "ab") as f:
        f.write(b"\0")
    assert cache_dir_of(cfg) != original
