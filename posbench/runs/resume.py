"""Resuming a run: where it writes, whether it continues, and whether a checkpoint may continue it.

A checkpoint continues only under the settings that made it (method, seed, model, method options,
data by checksum, the result-changing trainer settings); anything else is refused in one line that
lists every difference, before anything is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from posbench.core.errors import PosbenchError
from posbench.core.io import file_sha256
from posbench.data.tokenizer import TOKENIZER_FILE
from posbench.runs.checkpoint import list_checkpoints, load_latest_checkpoint, read_checkpoint
from posbench.runs.spec import MethodSpec, RunSpec
from posbench.runtime.distributed import DistInfo
from posbench.train.settings import RESULT_SETTINGS, TrainerConfig


def run_target(t: TrainerConfig, run_dir: Path) -> Path:
    """The directory the run writes to: ``trainer.resume=<run dir>`` names another one."""
    if str(t.resume).lower() in ("auto", "true", "false", "none", "null"):
        return run_dir
    return Path(str(t.resume)).expanduser()


def resolve_run_dir(t: TrainerConfig, run_dir: Path) -> bool:
    """Whether the run continues from a checkpoint in ``run_dir`` (its :func:`run_target`)."""
    resume = str(t.resume).lower()
    if resume in ("auto", "true"):
        return bool(list_checkpoints(run_dir))
    if resume in ("false", "none", "null"):
        if list_checkpoints(run_dir):
            raise PosbenchError(
                f"{run_dir} already has checkpoints; continue it with trainer.resume=auto "
                "or choose a fresh hydra.run.dir"
            )
        return False
    if not list_checkpoints(run_dir):
        raise PosbenchError(f"trainer.resume={t.resume}: no checkpoints in that directory; pass a run directory")
    return True


def load_resume_state(run_dir: Path, info: DistInfo, log: Callable[[str], None],
                      quarantine: bool = True) -> dict[str, Any] | None:
    """Rank 0 picks the checkpoint (skipping damaged ones, renamed ``*.corrupt`` when
    ``quarantine``); every rank loads that same file.

    Loaded to the CPU: RNG states must be CPU tensors, and load_state_dict moves the rest.
    """
    state = load_latest_checkpoint(run_dir, log=log, map_location="cpu", quarantine=quarantine) if info.is_main else None
    if not info.enabled:
        return state
    box = [state["path"] if state else None]
    dist.broadcast_object_list(box, src=0)
    if info.is_main or box[0] is None:
        return state
    return read_checkpoint(Path(box[0])) | {"path": box[0]}


def data_identity(prepared: Any) -> dict[str, str]:
    """What the tokens are: tokenizer file and token streams by checksum (not by path/mtime)."""
    splits = prepared.meta.get("splits", {})
    return {"tokenizer_sha256": file_sha256(prepared.dir / TOKENIZER_FILE),
            **{f"{split}_sha256": str(info.get("sha256")) for split, info in splits.items()}}


def check_resumable(state: dict[str, Any], spec: RunSpec, total_steps: int, run_dir: Path,
                    identity: dict[str, str], randomize_max: int | None = None) -> None:
    """Refuse to continue a checkpoint under settings that would change what it means: method,
    seed, the whole model, the method options, the data (by checksum) and the result-changing
    trainer settings. One line lists every difference."""
    saved = state.get("config", {})
    theirs: dict[str, Any] = {"method": state.get("method"), "seed": saved.get("seed")}
    ours: dict[str, Any] = {"method": spec.method, "seed": spec.seed}
    for name in RESULT_SETTINGS:
        theirs[f"trainer.{name}"] = saved.get("trainer", {}).get(name)
        ours[f"trainer.{name}"] = getattr(spec.trainer, name)
    model = {k: v for k, v in spec.model.to_dict().items() if k not in ("attention", "flavour")}  # not results
    for name, value in model.items():
        theirs[f"model.{name}"], ours[f"model.{name}"] = state.get("model_config", {}).get(name), value
    saved_options = MethodSpec.from_saved({"name": state.get("method"), **(state.get("method_options") or {})}).options
    for name in sorted(set(saved_options) | set(spec.method_options)):
        theirs[f"method.{name}"] = saved_options.get(name, "<unset>")
        ours[f"method.{name}"] = spec.method_options.get(name, "<unset>")
    # Randomized positions change every training batch: "off" on both sides for runs without them.
    theirs["positions.randomize_max"] = (saved.get("positions") or {}).get("randomize_max") or "off"
    ours["positions.randomize_max"] = randomize_max or "off"
    theirs["trainer.state_passing"] = saved.get("trainer", {}).get("state_passing") or "off"  # off before it existed
    ours["trainer.state_passing"] = spec.trainer.state_passing
    for name, value in identity.items():  # checkpoints from before data_identity have none
        theirs[f"data.{name}"], ours[f"data.{name}"] = state.get("data_identity", {}).get(name), value
    differs = [key for key, value in theirs.items() if value is not None and value != ours[key]]
    if differs:
        raise PosbenchError(
            f"{run_dir} holds a run with {'; '.join(resume_differences(differs, theirs, ours))} "
            f"(method={state.get('method')}); resume it with the same config or choose a fresh hydra.run.dir"
        )
    if state["step"] > total_steps:
        raise PosbenchError(
            f"the checkpoint in {run_dir} is at step {state['step']}, past this run's {total_steps} steps; "
            "raise trainer.max_steps or choose a fresh hydra.run.dir"
        )


def resume_differences(differs: list[str], theirs: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """The settings that keep a checkpoint from resuming, the one that matters first: what the
    user changes (method, seed, data, trainer, model), not what follows from it. Another method
    brings other method options, and other data another vocabulary and other checksums: those are
    left out, and the data is one item, not a list of sha256 sums."""
    data = [key for key in differs if key.startswith("data.")]
    left_out = set(data)
    if "method" in differs:
        left_out |= {key for key in differs if key.startswith("method.")}
    if data:
        left_out.add("model.vocab_size")
    order = ("method", "seed", "data.", "trainer.", "positions.", "model.", "method.")
    items = []
    for prefix in order:
        if prefix == "data." and data:
            which = ", ".join(key.removeprefix("data.").removesuffix("_sha256") for key in data)
            verb = "differs" if len(data) == 1 else "differ"
            items.append(f"other data (its {which} {verb}: another data setting or changed text)")
            continue
        items += [f"{key}={theirs[key]}, not {key}={ours[key]}" for key in differs
                  if (key == prefix or (prefix.endswith(".") and key.startswith(prefix))) and key not in left_out]
    return items


__all__ = ["check_resumable", "data_identity", "load_resume_state", "resolve_run_dir",
           "run_target"]
