"""The run spec: the composed config of ``posbench train`` validated into typed parts.

Every user error of a run's config surfaces in :func:`build_spec`, before any data is read or any
file written. :class:`MethodSpec` is the one parser of a ``method`` config section (``name`` plus
the method's options), used by train, eval, viz, bench and the Python API.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from posbench.config import check_top_level_keys, config_names, load_group_option
from posbench.config.settings import from_section
from posbench.core.errors import PosbenchError
from posbench.data import DataConfig
from posbench.evaluation.settings import EvalConfig, eval_settings
from posbench.methods import ModelDims, PositionMethod, build_method, method_class, method_options, saved_options
from posbench.model.extension import check_names, resolve_extensions
from posbench.model.positions import randomize_max_from_config
from posbench.model.transformer import ModelConfig, check_mixer_method
from posbench.runs.kinds import TASK, TEXT, config_kind
from posbench.tasks import Task, make_task
from posbench.tasks.base import task_class
from posbench.train.settings import TrainerConfig

logger = logging.getLogger("posbench")


@dataclass(frozen=True)
class MethodSpec:
    """A position method and its options, as a ``method`` config section names them."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_config(cls, section: Any) -> MethodSpec:
        """``method`` config section (``{name: ..., <options>}``, or a bare name) -> spec."""
        if isinstance(section, str):  # method=name given as a plain key, without its group file
            return cls(section, {})
        values = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
        name = values.pop("name", None)
        if not isinstance(name, str):
            raise PosbenchError("method.name is missing; pick a method with method=<name>")
        return cls(name, values)

    @classmethod
    def from_saved(cls, section: Any) -> MethodSpec:
        """A saved run's ``method`` section (its config.yaml, or a checkpoint's ``{name, **options}``):
        an option the run does not record takes the value it had before the option existed (the
        method's ``options_before``), not today's default, so the run is rebuilt as it trained."""
        spec = cls.from_config(section)
        return cls(spec.name, saved_options(spec.name, spec.options))

    def recorded(self) -> MethodSpec:
        """A new run's spec with every option of ``options_before`` written out (at today's
        default where not given), so its records never leave the question to :meth:`from_saved`."""
        today = method_options(self.name)
        return MethodSpec(self.name, {**{k: today[k] for k in method_class(self.name).options_before}, **self.options})

    def in_context(self, context: int) -> MethodSpec:
        """This spec with the method's ``context_option`` set to ``context`` where it is null."""
        option = method_class(self.name).context_option
        if option is None or self.options.get(option) is not None:
            return self
        return MethodSpec(self.name, {**self.options, option: context})

    def section(self) -> dict[str, Any]:
        """The ``method`` config section of this spec."""
        return {"name": self.name, **self.options}

    @classmethod
    def defaults(cls, name: str, overrides: dict[str, Any] | None = None) -> MethodSpec:
        """Method ``name`` with the options of ``configs/method/<name>.yaml`` (its constructor's
        defaults when it has no config file), updated by ``overrides``."""
        method_class(name)  # unknown names fail here with the list of valid ones
        options = load_group_option("method", name) if name in config_names("method") else {}
        options.pop("name", None)
        return cls(name, {**options, **(overrides or {})})

    def build(self, dims: ModelDims) -> PositionMethod:
        """The method for a model of shape ``dims``; a shape it cannot run on is one line."""
        try:
            return build_method(self.name, dims, **self.options)
        except ValueError as err:
            raise PosbenchError(f"method={self.name} cannot run on this model: {err}") from None

    def probe(self, dims: ModelDims) -> PositionMethod:
        """:meth:`build` on the meta device: checks shapes and options, allocates nothing."""
        with torch.device("meta"):
            return self.build(dims)


@dataclass(frozen=True)
class RunSpec:
    """Everything a run needs, validated before any work starts."""

    trainer: TrainerConfig
    eval: EvalConfig
    model: ModelConfig
    method_spec: MethodSpec
    data: DataConfig
    seed: int
    run_name: str
    task: Task | None = None
    """The synthetic task of a ``task=<name>`` run (docs/tasks.md); None for text runs."""
    task_options: dict[str, Any] = field(default_factory=dict)
    kind: str = TEXT
    """The run's kind (:mod:`posbench.runs.kinds`): ``text``, ``task`` or a plug-in's."""

    @property
    def method(self) -> str:
        return self.method_spec.name

    @property
    def method_options(self) -> dict[str, Any]:
        return self.method_spec.options


def data_config(section: Any) -> DataConfig:
    """``data`` config section -> validated :class:`DataConfig`."""
    return from_section(DataConfig, "data", OmegaConf.to_container(section, resolve=True))


def model_config(section: Any) -> ModelConfig:
    """``model`` config section -> validated :class:`ModelConfig`."""
    return from_section(ModelConfig, "model", OmegaConf.to_container(section, resolve=True))


def build_spec(cfg: DictConfig, saved: bool = False) -> RunSpec:
    """Validate the whole composed config; every user error surfaces here, before any work.
    ``saved``: ``cfg`` is an existing run's recorded config (``posbench eval`` finishing it), whose
    data was chosen when it started: ``data.path`` is checked only for new runs."""
    check_top_level_keys(cfg, "train")
    trainer = from_section(TrainerConfig, "trainer", OmegaConf.to_container(cfg.trainer, resolve=True))
    evaluation = eval_settings(OmegaConf.to_container(cfg.eval, resolve=True))
    check_names(evaluation.extension)
    model = model_config(cfg.model)
    method = MethodSpec.from_config(cfg.method)
    method_class(method.name)
    method = method.recorded().in_context(trainer.context)
    # Build the method once on the meta device: shape problems (odd rope head dim, bad options)
    # are reported now rather than after the data is tokenized.
    probe = method.probe(model.dims)
    check_mixer_method(model, method.name)  # before the data is prepared
    randomize_max_from_config(cfg, probe, trainer.context, probe.max_positions)  # randomized positions
    seed = cfg.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise PosbenchError(f"seed must be an integer, got {seed!r}")
    # eval.probes: the trainer checks them; a grid task checks its own (square grids, twice the side)
    grid = is_grid_task(cfg.get("task"))
    # The task first: a context it cannot use (task=fashion's 7 x 7 grid) is the fix that matters,
    # and the lengths' hint would be given for the wrong context.
    task, task_options = make_task_of(cfg.get("task"), trainer)
    evaluation.check_lengths(trainer.context, need_headline=not grid, grid=grid)
    longest = max(max(evaluation.lengths), trainer.context)
    if probe.max_positions is not None and longest > probe.max_positions:
        raise PosbenchError(
            f"method={method.name} supports positions up to {probe.max_positions} but eval/training "
            f"needs {longest}; {probe.length_fix(longest)}"
        )
    data = data_config(cfg.data)
    if not saved:
        data.check_path_is_read()
    if task is not None:
        check_task_run(task, trainer, evaluation)
    model = replace(model, layout=check_layout(probe, task))
    if task is not None:  # an image task's patch embedding and pooled head (docs/images.md)
        model = replace(model, patch_dim=task.patch_dim, head=task.head)
    # Refused (or skipped with a line) now, not after training; on the grid only the per-axis rules.
    evaluation = replace(evaluation, extension=resolve_extensions(evaluation.extension, probe, log=logger.info,
                                                                  layout=model.layout, scope=evaluation.extension_scope,
                                                                  attention=model.has_attention))
    if task is not None and data.retrieval.active:
        raise PosbenchError(f"data.retrieval writes into text windows, and task={task.name} runs have none; "
                            "drop data.retrieval.rate")
    if task is not None and trainer.state_passing == "carry":
        raise PosbenchError(f"trainer.state_passing=carry continues streams of text, and task={task.name} sequences "
                            "are independent; use trainer.state_passing=noise or off")
    if trainer.state_passing != "off" and not model.recurrent:
        raise PosbenchError(f"trainer.state_passing={trainer.state_passing} passes the state of recurrent layers, and "
                            "this model has none; set model.mixer (docs/mixers.md) or trainer.state_passing=off")
    if task is not None and seed < 0:  # the run seed is a word of the task's numpy seed
        raise PosbenchError(f"seed={seed}: a task run's seed must be >= 0 (it seeds the training sequences)")
    kind = config_kind(cfg)
    if kind in (TEXT, TASK) and (kind == TASK) != (task is not None):
        raise PosbenchError(f"kind={kind} {'needs' if kind == TASK else 'cannot have'} a task; "
                            "leave kind=null (task=<name> makes a task run)")
    return RunSpec(trainer, evaluation, model, method, data, seed,
                   str(cfg.get("run_name", f"{method.name}-s{seed}")), task, task_options, kind)


def is_grid_task(section: Any) -> bool:
    """Whether a ``task`` config section names a grid task (None: a text run)."""
    if section is None:
        return False
    cls = task_class(str(section.get("name", "")))
    return cls is not None and cls.layout == "grid"


def check_layout(method: Any, task: Task | None) -> str:
    """The model's layout (a grid task's: the grid encoder), refused in one line when the method
    is not made for it."""
    layout = "sequence" if task is None else task.layout
    if layout in method.layouts:
        return layout
    from posbench.methods import list_methods

    if layout == "grid":
        raise PosbenchError(f"method={method.name} is a sequence method and task={task.name} runs on the grid encoder; "
                            f"choose a grid method: {', '.join(list_methods('grid'))}")
    where = "a text run" if task is None else f"task={task.name}"
    raise PosbenchError(f"method={method.name} is a grid method and {where} runs on the sequence model; "
                        "use a grid task (docs/grid.md) or a sequence method")


def make_task_of(section: Any, trainer: TrainerConfig) -> tuple[Task | None, dict[str, Any]]:
    """The task of a ``task=<name>`` run's ``task`` section and its options (None, {} without one),
    checked against ``trainer.context``."""
    if section is None:
        return None, {}
    options = OmegaConf.to_container(section, resolve=True) if isinstance(section, DictConfig) else dict(section)
    return make_task(options, trainer.context), options


def check_task_run(task: Task, trainer: TrainerConfig, evaluation: EvalConfig) -> None:
    """Refuse the settings a task run reads differently from a text run."""
    task.check_lengths(evaluation.lengths)
    task.check_sizes({"eval.num_sequences": evaluation.num_sequences, "trainer.val_sequences": trainer.val_sequences,
                      "trainer.val_extrapolation_sequences": trainer.val_extrapolation_sequences})
    if evaluation.probes:
        raise PosbenchError(f"eval.probes={list(evaluation.probes)} read text, and task={task.name} runs have none; "
                            "drop eval.probes (the task's own accuracy is the measurement)")
    if trainer.max_steps is None and trainer.max_tokens is None:
        raise PosbenchError(f"task={task.name} generates fresh data every step, so trainer.epochs means nothing; "
                            "set trainer.max_steps (e.g. trainer.max_steps=600)")


def check_memory_fits(spec: RunSpec, micro_batch: int, device: torch.device) -> None:
    """Refuse a model or batch that cannot fit the device, before anything is allocated.

    A lower bound, so only the impossible is refused: fp32 weights, gradients and the two AdamW
    moments (16 bytes per parameter), plus per micro-batch token the residual-stream and MLP
    activations kept for the backward pass and the fp32 logits, at training or evaluation size.
    """
    m, t, e = spec.model, spec.trainer, spec.eval
    d, ffn, vocab = m.d_model, m.hidden_size, m.vocab_size
    parameters = m.n_layers * (4 * d * d + 3 * d * ffn) + vocab * d * (1 if m.tie_embeddings else 2)
    training_tokens = micro_batch * t.context
    activations = 4 * (training_tokens * m.n_layers * (6 * d + 3 * ffn) + 2 * training_tokens * vocab)
    evaluation = 4 * e.batch_size * max(e.lengths) * (2 * d + ffn)  # no grad: one layer's worth at a time
    needed = 16 * parameters + max(activations, evaluation)
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[1]
    else:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if needed > available:
        gib = 2 ** 30
        raise PosbenchError(
            f"this run needs at least {needed / gib:,.1f} GiB ({16 * parameters / gib:,.1f} GiB for "
            f"{parameters:,} parameters with AdamW, {activations / gib:,.1f} GiB of activations per micro-batch) "
            f"but the {device.type} has {available / gib:,.1f} GiB; lower model.n_layers / model.d_model, "
            "or trainer.micro_batch_size (gradient accumulation keeps trainer.batch_size)"
        )


__all__ = ["MethodSpec", "RunSpec", "build_spec", "check_memory_fits", "data_config", "model_config"]
