"""W&B without surprises: the mode a run logs in (no network, no login prompt), ``wandb.init``
with bounded timeouts, the offline teardown, and adding figures to a finished run's W&B run.

The logger a run writes through is :class:`posbench.train.loggers.WandbLogger`.
"""

from __future__ import annotations

import netrc
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from posbench.core.errors import one_line

# wandb.init waits 90 s by default when the server is unreachable; 30 s is ample for a healthy
# connection and bounds the stall. finish() by default blocks until every byte is uploaded, which
# can be forever on a dead network; the data is safe in the local .wandb file anyway (wandb sync).
# Both honour wandb's own env vars WANDB_INIT_TIMEOUT / WANDB_FINISH_TIMEOUT.
DEFAULT_INIT_TIMEOUT_S = 30.0
DEFAULT_FINISH_TIMEOUT_S = 300.0

# Set once an online init has failed in this process: Hydra's basic launcher runs a sweep's jobs
# one after another in one process, and each would otherwise wait the full init timeout again.
_online_unreachable = False

Log = Callable[[str], None]


def note_unreachable() -> None:
    """Remember that an online init failed: later runs of this process log offline at once."""
    global _online_unreachable
    _online_unreachable = True


def resolve_mode(mode: str, *, log: Log = print) -> str:
    """Turn a ``logger.mode`` into ``online``, ``offline`` or ``disabled`` without any network access.

    ``WANDB_MODE=disabled`` / ``WANDB_DISABLED=true`` always win (the usual CI kill switch); any
    other ``WANDB_MODE`` decides only when the config says ``auto``. Online needs credentials:
    without them wandb would prompt for a key (or fail with no TTY), so we log offline instead.
    """
    env_mode = os.environ.get("WANDB_MODE", "").strip().lower()
    disabled = os.environ.get("WANDB_DISABLED", "").strip().lower() in ("1", "true", "yes")
    if env_mode == "disabled" or disabled:
        return "disabled"
    if mode == "auto" and env_mode:
        mode = {"dryrun": "offline", "run": "online"}.get(env_mode, env_mode)
        mode = mode if mode in ("online", "offline") else "auto"  # e.g. "shared": decide ourselves
    if mode == "auto":
        mode = "online" if has_credentials() else "offline"
    elif mode == "online" and not has_credentials():
        log("warning: logger.mode=online but no W&B credentials "
            "(set WANDB_API_KEY or run `wandb login`); logging offline")
        return "offline"
    if mode == "online" and _online_unreachable:
        log("warning: W&B was unreachable earlier in this process; logging offline")
        return "offline"
    return mode


def has_credentials() -> bool:
    """True when wandb would find an API key without asking: WANDB_API_KEY, an identity token
    file, a netrc entry or an ``api_key`` setting for the configured W&B host. Local files only."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        # wandb's own lookup (same host resolution, Forge/upstream aliases, settings files) with
        # prompting and verification (network) off. Private API, hence the fallback below.
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        settings = wandb_setup.singleton().settings
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        auth = wbauth.authenticate_session(
            host=host, source="posbench", prompt=False, verify=False, update_session=False
        )
        return auth is not None
    except Exception:
        return _netrc_has_host(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))


def _netrc_has_host(url: str) -> bool:
    path = os.environ.get("NETRC") or os.path.expanduser("~/.netrc")
    try:
        entry = netrc.netrc(path).authenticators(urlsplit(url).netloc)
    except Exception:
        return False
    return bool(entry and entry[2])


def settle_offline(mode: str, exit_code: int, log: Log) -> None:
    """After ``run.finish()`` of an offline run: wait for wandb's service to write the last records
    of the .wandb file (the only copy of an offline run's data), which it does after ``finish``
    returns (a busy machine's test lost the figures' record in 8 of 12 tries). wandb's teardown
    does that wait; wandb runs it at exit, but not reliably in worker processes (Hydra's joblib
    launcher). Offline only: there is no network to wait for, and an online run's data is uploaded
    by ``finish`` already. A teardown that fails, or would exit the process, is one warning."""
    if mode != "offline":
        return
    import wandb

    try:
        wandb.teardown(exit_code=exit_code)
    except (Exception, SystemExit) as e:  # wandb's teardown sys.exit()s when its service failed
        log(f"warning: W&B offline teardown failed ({one_line(e)}); check the .wandb file before syncing it")


def wandb_init(*, mode: str, dir: Path, **kwargs: Any) -> Any:
    """``wandb.init`` with posbench's settings (timeouts, silent, no console capture)."""
    import wandb

    dir.mkdir(parents=True, exist_ok=True)  # wandb warns "git root does not exist" otherwise
    settings = wandb.Settings(
        init_timeout=_env_float("WANDB_INIT_TIMEOUT", DEFAULT_INIT_TIMEOUT_S),
        finish_timeout=_env_float("WANDB_FINISH_TIMEOUT", DEFAULT_FINISH_TIMEOUT_S),
        silent=True,  # no banners or sync hints of wandb's own; we print one line ourselves
        console="off",  # leave stdout/stderr alone: Hydra's logging and progress bars own them
        save_code=False,  # the git commit + diff that wandb records and the config identify the code
    )
    # reinit="finish_previous": Hydra's basic launcher runs sweep jobs in one process; a run a
    # crashed job left open is closed instead of being returned again ("return_previous").
    return wandb.init(mode=mode, dir=str(dir), reinit="finish_previous", settings=settings, **kwargs)


def wandb_run_id(run_dir: Path) -> str | None:
    """The id of the newest W&B run recorded under ``<run_dir>/wandb`` (offline or online), if any."""
    found = sorted((Path(run_dir) / "wandb").glob("*run-*-*"), key=lambda p: p.stat().st_mtime)
    found = [p for p in found if p.is_dir()]
    return found[-1].name.rsplit("-", 1)[-1] if found else None


def upload_figures(run_dir: Path, logger_cfg: Mapping[str, Any], paths: Sequence[Path], log: Log,
                   prefix: str = "figures") -> bool:
    """Add figures (their .png files) to a finished run's W&B run as ``<prefix>/<name>``: the run
    is resumed by its id, offline unless credentials exist.

    Only when the run was logged with ``logger=wandb`` (``logger_cfg``: its ``logger`` config
    section) and left a run id in its ``wandb/`` folder. A failure is one warning line: the
    figures on disk are the record.
    """
    run_id = wandb_run_id(run_dir)
    if logger_cfg.get("name") != "wandb" or run_id is None:
        return False
    mode = resolve_mode(str(logger_cfg.get("mode") or "auto"), log=log)
    if mode == "disabled":
        return False
    try:
        import wandb

        run = wandb_init(mode=mode, dir=Path(logger_cfg.get("dir") or run_dir), id=run_id, resume="allow",
                         project=logger_cfg.get("project") or "posbench", entity=logger_cfg.get("entity"))
        run.log({f"{prefix}/{p.stem}": wandb.Image(str(p)) for p in paths if p.suffix == ".png"})
        run.finish()
    except Exception as err:  # W&B must never cost the figures
        log(f"warning: W&B logging of the figures failed ({one_line(err)}); they are in the run directory")
        return False
    settle_offline(mode, 0, log)
    log(f"logged {sum(p.suffix == '.png' for p in paths)} figures to W&B run {run_id} ({mode})")
    return True


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ[name])
    except (KeyError, ValueError):
        return default


def wandb_group(experiment: str) -> str:
    """Runs of one sweep share a W&B group (experiment + sweep folder); single runs group by
    experiment."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        hydra_cfg = HydraConfig.get()
        if hydra_cfg.mode == RunMode.MULTIRUN:
            return f"{experiment}/{Path(hydra_cfg.sweep.dir).name}"
    except ValueError:
        pass
    return experiment
