"""posbench.train.loggers and wandb_session: W&B offline without credentials, multirun, no-op loggers, graceful failure.

No network: credentials are hidden (HOME, WANDB_CONFIG_DIR and NETRC point into tmp_path), so
``mode: auto`` resolves to offline and wandb writes ``<run_dir>/wandb/offline-run-*``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

wandb = pytest.importorskip("wandb")

from posbench.config import load_group_option  # noqa: E402
from posbench.core.errors import PosbenchError  # noqa: E402
from posbench.train import wandb_session  # noqa: E402
from posbench.train.loggers import NullLogger, WandbLogger, make_logger  # noqa: E402

CONFIG = {"method": {"name": "rope", "base": 10000.0}, "model": {"d_model": 64}, "seed": 0}


@pytest.fixture(autouse=True)
def no_credentials(monkeypatch, tmp_path):
    """Hide every W&B credential and setting of the real user; reset wandb's process state."""
    home = tmp_path / "home"
    home.mkdir()
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_DISABLED", "WANDB_IDENTITY_TOKEN_FILE",
                "WANDB_BASE_URL", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP",
                "WANDB_TAGS", "WANDB_NAME", "WANDB_INIT_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))  # does not exist
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / ".local" / "wandb"))
    monkeypatch.setattr(wandb_session, "_online_unreachable", False)
    # wandb caches settings (read from the environment) in a process-wide singleton, and keeps a
    # service process alive until teardown: start and end every test from a clean state.
    wandb.teardown()
    yield
    wandb.teardown()


def _make(tmp_path: Path, name: str = "rope-s0", messages: list[str] | None = None, **cfg):
    logger_cfg = {**load_group_option("logger", "wandb"), **cfg}
    return make_logger(
        logger_cfg,
        run_dir=tmp_path / name,
        run_name=name,
        group="sweep1",
        tags=["smoke"],
        config=CONFIG,
        log=(messages.append if messages is not None else print),
    )


def _entries() -> list[dict]:
    return [
        {"split": "validation", "length": 512, "num_sequences": 2,
         "loss_by_position": [3.0 - 0.001 * p for p in range(512)],
         "bands": {"0-256": 2.9, "256-512": 2.7}},
        {"split": "train", "length": 512, "num_sequences": 2,
         "loss_by_position": [2.0] * 511 + [float("nan")],
         "bands": {"0-256": 2.0, "256-512": 2.1}},
    ]


def _png(path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1, 1), dpi=20)
    ax.plot([0, 1], [1, 0])
    fig.savefig(path)
    plt.close(fig)
    return path


def _offline_dir(run_dir: Path) -> Path:
    found = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(found) == 1, found
    return found[0]


def test_config_files():
    assert load_group_option("logger", "none") == {"name": "none"}
    cfg = load_group_option("logger", "wandb")
    assert cfg == {"name": "wandb", "project": "posbench", "entity": None, "mode": "auto",
                   "group": None, "tags": [], "dir": None}


def test_auto_mode_without_credentials_is_offline():
    assert not wandb_session.has_credentials()
    assert wandb_session.resolve_mode("auto") == "offline"
    messages: list[str] = []
    assert wandb_session.resolve_mode("online", log=messages.append) == "offline"
    assert len(messages) == 1 and "no W&B credentials" in messages[0]


def test_credentials_make_auto_online(monkeypatch, tmp_path):
    (tmp_path / "home" / ".netrc").write_text("machine api.wandb.ai login user password " + "a" * 40 + "\n")
    assert wandb_session.has_credentials()
    assert wandb_session.resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "offline")  # the environment decides an auto mode
    assert wandb_session.resolve_mode("auto") == "offline"
    assert wandb_session.resolve_mode("online") == "online"  # an explicit config mode wins...
    monkeypatch.setenv("WANDB_MODE", "disabled")  # ...except over the CI kill switch
    assert wandb_session.resolve_mode("online") == "disabled"


@pytest.mark.slow
def test_offline_run_logs_everything(tmp_path):
    messages: list[str] = []
    logger = _make(tmp_path, messages=messages)
    assert isinstance(logger, WandbLogger) and logger.active and logger.mode == "offline"
    run = logger._run
    assert wandb.run is run
    assert run.name == "rope-s0"
    assert list(run.tags) == ["rope", "smoke"]
    assert run.group == "sweep1"
    assert run.config["method"]["name"] == "rope"
    run_dir = tmp_path / "rope-s0"
    sync_dir = _offline_dir(run_dir)
    assert logger.sync_dir == sync_dir
    assert messages == [f'W&B offline: run "wandb sync {sync_dir}" to upload']

    logger.log_config({**CONFIG, "extra": 1})
    for step in range(1, 4):
        logger.log_metrics({"loss": 5.0 / step, "lr": 1e-3, "tokens": 1024 * step,
                            "tokens_per_second": 1e4}, step=step)
    logger.log_metrics({"val_loss": 4.0}, step=3)
    logger.log_eval(_entries(), train_context=256)
    logger.log_figures([_png(tmp_path / "loss_by_position.png"), tmp_path / "missing.png"])
    logger.summary({"train/final_loss": 1.7})
    assert run.summary["headline/loss_256_512"] == pytest.approx(2.7)
    assert run.summary["headline/loss_0_256"] == pytest.approx(2.9)
    assert run.summary["eval/train/512/band_256-512"] == pytest.approx(2.1)
    assert "eval/validation/512/loss" not in run.summary.keys()  # a curve, not a per-run number
    assert run.config["extra"] == 1
    logger.finish()
    logger.finish()  # idempotent
    assert wandb.run is None and not logger.active
    assert len(messages) == 1, messages  # no warnings

    # On disk once finish() returns: wandb-core wrote the last records after run.finish() (without
    # the logger's teardown the figures' record was missing in 8 of 12 tries on a busy machine).
    files = list(sync_dir.glob("run-*.wandb"))
    assert len(files) == 1
    data = files[0].read_bytes()  # protobuf records: strings are stored verbatim
    for needle in (b"rope-s0", b"sweep1", b"train/loss", b"val/loss", b"eval/validation/512/loss",
                   b"headline/loss_256_512", b"figures/loss_by_position"):
        assert needle in data, needle
    tables = list((sync_dir / "files" / "media" / "table").rglob("*.table.json"))
    assert len(tables) == 2
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["position", "loss"] and len(table["data"]) == 512
    assert list((sync_dir / "files" / "media" / "images").rglob("*.png"))


@pytest.mark.slow
def test_windowed_and_cost_curves_are_tables_and_history_like_the_plain_curve(tmp_path):
    """The like-for-like (windowed) curve and the cost by position of an entry past C are logged
    as the plain curve is: a table with its line chart, and a history curve against
    eval/position that W&B overlays across runs."""
    entry = {**_entries()[0], "windowed": {"loss_by_position": [2.9] * 512, "bands": {"256-512": 2.9}},
             "cost": {"loss_by_position": [0.0] * 256 + [0.25] * 256, "bands": {"256-512": 0.25}}}
    logger = _make(tmp_path)
    sync_dir = logger.sync_dir
    logger.log_eval([entry], train_context=256)
    assert logger._run.summary["eval/validation/512/cost_256-512"] == pytest.approx(0.25)
    logger.finish()
    data = next(sync_dir.glob("run-*.wandb")).read_bytes()
    for needle in (b"eval/validation/512/windowed_loss", b"eval/validation/512/cost",
                   b"eval/validation/512/windowed_loss_by_position", b"eval/validation/512/cost_by_position"):
        assert needle in data, needle
    tables = {json.dumps(json.loads(p.read_text())["columns"]): json.loads(p.read_text())
              for p in (sync_dir / "files" / "media" / "table").rglob("*.table.json")}
    assert set(tables) == {'["position", "loss"]', '["position", "cost"]'}
    cost = tables['["position", "cost"]']["data"]
    assert cost[300] == [300, 0.25] and len(cost) == 512
    assert len(list((sync_dir / "files" / "media" / "table").rglob("*.table.json"))) == 3


@pytest.mark.slow
def test_two_runs_in_one_process(tmp_path):
    """Hydra's basic launcher runs multirun jobs sequentially in one process."""
    for seed in (0, 1):
        logger = _make(tmp_path, name=f"rope-s{seed}", messages=[])
        assert logger.active and logger._run.name == f"rope-s{seed}"
        logger.log_metrics({"loss": 1.0, "tokens": 10}, step=1)
        logger.finish()
    ids = {_offline_dir(tmp_path / f"rope-s{seed}").name for seed in (0, 1)}
    assert len(ids) == 2


@pytest.mark.slow
def test_unfinished_previous_run_is_closed(tmp_path):
    first = _make(tmp_path, name="rope-s0", messages=[])  # a job that crashed without finish()
    second = _make(tmp_path, name="rope-s1", messages=[])
    assert second.active and wandb.run is second._run and second._run.name == "rope-s1"
    second.finish()
    first.finish()  # the stale handle must not raise


def test_null_loggers(tmp_path):
    kwargs = dict(run_dir=tmp_path, run_name="x", group=None, tags=[], config=CONFIG)
    assert isinstance(make_logger(load_group_option("logger", "none"), **kwargs), NullLogger)
    assert isinstance(make_logger({"name": "wandb", "mode": "disabled"}, **kwargs), NullLogger)
    assert isinstance(make_logger({"name": "wandb"}, rank=1, **kwargs), NullLogger)
    null = NullLogger()
    with null as lg:  # every call is a harmless no-op
        lg.log_config({})
        lg.log_metrics({"loss": 1.0}, step=1)
        lg.log_eval(_entries(), 256)
        lg.log_figures([tmp_path / "a.png"])
        lg.summary({"a": 1})
    assert not (tmp_path / "wandb").exists()


def test_unknown_logger_or_mode(tmp_path):
    kwargs = dict(run_dir=tmp_path, run_name="x", group=None, tags=[], config=CONFIG)
    with pytest.raises(PosbenchError, match="none, wandb"):
        make_logger({"name": "tensorboard"}, **kwargs)
    with pytest.raises(PosbenchError, match="auto, online, offline, disabled"):
        make_logger({"name": "wandb", "mode": "sometimes"}, **kwargs)


def test_init_failure_degrades_to_noop(monkeypatch, tmp_path):
    def broken_init(*args, **kwargs):
        raise RuntimeError("backend exploded\nsecond line")

    monkeypatch.setattr(wandb, "init", broken_init)
    messages: list[str] = []
    logger = _make(tmp_path, messages=messages)
    assert not logger.active
    # training code carries on calling the logger
    logger.log_config(CONFIG)
    logger.log_metrics({"loss": 1.0, "tokens": 10}, step=1)
    logger.log_eval(_entries(), train_context=256)
    logger.log_figures([])
    logger.summary({"a": 1})
    logger.finish(1)
    assert messages == ["warning: W&B init failed (RuntimeError: backend exploded); "
                        "continuing without W&B logging"]


@pytest.mark.slow
def test_online_failure_falls_back_to_offline(monkeypatch, tmp_path):
    real_init = wandb.init

    def init(*args, mode=None, **kwargs):
        if mode == "online":
            raise wandb.errors.CommError("Timed out while retrying")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb_session, "has_credentials", lambda: True)
    messages: list[str] = []
    logger = _make(tmp_path, messages=messages, mode="online")
    assert logger.active and logger.mode == "offline"
    logger.finish()
    assert messages[0].startswith("warning: W&B online init failed (CommError")
    assert messages[1].startswith("W&B offline: run \"wandb sync")
    # the next job of the sweep does not wait for the unreachable server again
    messages.clear()
    logger = _make(tmp_path, name="rope-s1", messages=messages, mode="auto")
    assert logger.mode == "offline" and "unreachable earlier" in messages[0]
    logger.finish()


def test_error_during_logging_disables_with_one_warning(monkeypatch, tmp_path):
    messages: list[str] = []
    logger = _make(tmp_path, messages=messages)

    def broken_log(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(logger._run, "log", broken_log)
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.log_metrics({"loss": 1.0}, step=2)
    logger.log_eval(_entries(), train_context=256)
    assert not logger.active
    assert messages[1:] == ["warning: W&B log_metrics failed (OSError: disk full); "
                            "continuing without W&B logging"]
    logger.finish()


def test_extension_entries_get_their_own_group_and_never_the_headline(tmp_path):
    logger = _make(tmp_path)
    run = logger._run
    extended = {**_entries()[0], "extension": "yarn", "extension_factor": 2.0,
                "bands": {"0-256": 2.8, "256-512": 2.5}}
    logger.log_eval([extended, {**_entries()[0], "extension": "none"}], train_context=256)
    assert run.summary["eval/validation/512/yarn/band_256-512"] == pytest.approx(2.5)
    assert run.summary["eval/validation/512/band_256-512"] == pytest.approx(2.7)
    assert run.summary["headline/loss_256_512"] == pytest.approx(2.7)  # the plain model's
    logger.finish()


def test_a_teardown_that_would_exit_the_process_is_one_warning(tmp_path, monkeypatch):
    """wandb's teardown sys.exit()s when its service process failed: finish() must not end the
    training process (or a one-process Hydra sweep) with it."""
    messages: list[str] = []
    logger = _make(tmp_path, messages=messages)
    real_teardown = wandb.teardown

    def failing(exit_code=None):  # once: the fixture's own teardown afterwards is the real one
        monkeypatch.setattr(wandb, "teardown", real_teardown)
        real_teardown(exit_code)
        raise SystemExit(1)

    monkeypatch.setattr(wandb, "teardown", failing)
    logger.finish()  # no SystemExit
    assert not logger.active and len(messages) == 2 and "W&B offline teardown failed" in messages[1]


def test_only_an_offline_run_waits_for_wandb_teardown(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(wandb, "teardown", lambda exit_code=None: calls.append(exit_code))
    wandb_session.settle_offline("online", 0, print)
    assert calls == []  # online: finish() uploaded it; a teardown could wait on a dead network
    wandb_session.settle_offline("offline", 3, print)
    assert calls == [3]
