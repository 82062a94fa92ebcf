"""The evaluator's settings (``eval.*``): typed, documented, validated, with the settings of
the extensions that take some (``eval.rerope``, ``eval.self_extend``) and a section per probe
(``eval.copy``, ``eval.passkey``, ...).

Built from the ``eval`` config section by :func:`eval_settings` (a nested section becomes its own
dataclass); the defaults here are the only ones (``configs/eval/default.yaml`` composes them,
:func:`eval_defaults`), and docs/configuration.md's eval tables are generated from the fields and
their docstrings (``scripts/config_reference.py``). A probe's settings live in its module
(``posbench/evaluation/probes/``): the probe registry adds each to :data:`PROBE_SETTINGS` when the
probe is registered, which makes ``eval.<probe>`` a section of the eval config. Layer 1 like
``posbench.config``: the run spec (``posbench.runs``) and the model's extensions build on it, so it
imports only ``core`` and ``config``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from posbench.config.settings import from_section, require_positive
from posbench.core.errors import PosbenchError

PROBE_SETTINGS: dict[str, type] = {}
"""``eval.<name>`` sections of the registered probes: probe name -> its settings dataclass
(:func:`posbench.evaluation.probes.register_probe` adds them)."""


@dataclass(frozen=True)
class ReRoPEConfig:
    """ReRoPE at evaluation (eval.rerope.*; posbench/model/extension.py, docs/context-extension.md)."""

    window: int | None = None
    """w: relative positions below w stay exact, the others become w. None = C / 8 (the
    reference's 512 at a 4096 context)."""
    leaky: float | None = None
    """Leaky ReRoPE's k > 1: past w the relative position is w + (d - w) / k (the reference's
    leaky patch uses 16). None = ReRoPE (k -> infinity)."""
    log_scaling: bool = True
    """Multiply the queries by max(1, log(n + 1) / log C), as the reference patch does; false =
    the clamped positions alone."""

    def validate(self) -> None:
        require_positive("eval.rerope", window=self.window)
        if self.leaky is not None and not self.leaky > 1:
            raise PosbenchError(f"eval.rerope.leaky must be > 1 (or null for ReRoPE), got {self.leaky}")


@dataclass(frozen=True)
class SelfExtendConfig:
    """Self-Extend at evaluation (eval.self_extend.*; posbench/model/extension.py, docs/context-extension.md)."""

    window: int | None = None
    """Neighbour window W: relative positions below W stay exact. None = C / 4 (LongLM's
    default 1024 at a 4096 context)."""
    group: int = 8
    """Group size G: past W, positions are floor(n / G) (LongLM's default 8)."""

    def validate(self) -> None:
        require_positive("eval.self_extend", window=self.window, group=self.group)


@dataclass(frozen=True)
class StreamingLLMConfig:
    """StreamingLLM at evaluation (eval.streaming_llm.*; posbench/model/extension_rules.py,
    docs/context-extension.md)."""

    sinks: int = 4
    """S: the first S tokens (attention sinks) stay in the cache (the reference's start_size 4)."""
    window: int | None = None
    """R: the recent tokens kept besides the sinks, the query included. None = C - S, so the
    cache holds C tokens (the reference: recent_size 2000 at a 4096 context)."""

    def validate(self) -> None:
        require_positive("eval.streaming_llm", sinks=self.sinks, window=self.window)


@dataclass(frozen=True)
class LMInfiniteConfig:
    """LM-Infinite at evaluation (eval.lm_infinite.*; posbench/model/extension_rules.py,
    docs/context-extension.md)."""

    global_tokens: int = 10
    """n_global: the first tokens every query sees (the reference's global_branch, 10)."""
    window: int | None = None
    """The local branch and the distance limit: keys within it at their own distance, the global
    tokens beyond it at this distance. None = C (the reference: the pretraining length)."""

    def validate(self) -> None:
        require_positive("eval.lm_infinite", global_tokens=self.global_tokens, window=self.window)


@dataclass(frozen=True)
class DualChunkConfig:
    """Dual Chunk Attention at evaluation (eval.dual_chunk.*; posbench/model/extension_rules.py,
    docs/context-extension.md)."""

    chunk_size: int | None = None
    """s: the largest position a query is given (the successive and inter-chunk queries sit at
    most there). None = 3 C / 4 (the reference's pretraining_length * 3 // 4)."""
    local_window: int | None = None
    """w: chunks are s - w tokens long, so a query keeps exact distances to the last w keys of
    the previous chunk. None = C / 16 (the reference's default)."""

    def validate(self) -> None:
        require_positive("eval.dual_chunk", chunk_size=self.chunk_size, local_window=self.local_window)
        if self.chunk_size is not None and self.local_window is not None and self.local_window >= self.chunk_size:
            raise PosbenchError(f"eval.dual_chunk.local_window ({self.local_window}) must be below "
                                f"eval.dual_chunk.chunk_size ({self.chunk_size})")


@dataclass(frozen=True)
class LongRoPEConfig:
    """LongRoPE at evaluation (eval.longrope.*; posbench/model/extension_rules.py,
    docs/context-extension.md)."""

    factors: str | None = None
    """A JSON file of per-frequency rescale factors as Phi-3 ships them: ``short_factor`` and
    ``long_factor`` (R/2 numbers each, R the rotated channels), at the top level or under
    ``rope_scaling`` / ``rope_parameters`` (a model's config.json). Required by
    eval.extension=longrope; its scale s is eval.extension_factor (default L / C)."""


@dataclass(frozen=True)
class EvalConfig:
    """How a trained model is evaluated past its training context."""

    lengths: list[int] = field(default_factory=lambda: [512, 1024, 2048])
    """Evaluation sequence lengths, each >= trainer.context, one >= 2 x trainer.context in
    training (the headline band); each gets a per-position loss curve. 512 holds the headline
    256-512 band; 1024 and 2048 the bands of longer extrapolation."""
    split: str = "validation"
    """validation (held-out, default), test (the text of local files named *test*, never trained
    on) or train (the seed article's measurement, on training text)."""
    num_sequences: int = 256
    """Non-overlapping sequences per length, taken deterministically from the start of the split."""
    batch_size: int = 16
    """Sequences per forward pass during evaluation (the windowed pass puts the same number of
    tokens in each forward)."""
    window_stride: int = 64
    """Stride S of the like-for-like (windowed) pass: targets past the training context C are
    scored again by windows of C tokens, each scoring its last S positions, so every target sees
    C - S + 1 .. C tokens. Smaller S = closer to exactly C tokens of context, but (L - C) / S
    windows per sequence to run. Capped at C (docs/protocol.md)."""
    effective_length_eps: float = 0.05
    """Tolerance in nats of the effective length: the first position past the context where the
    smoothed loss exceeds its 0-C level (or the windowed curve) by more than this."""
    extension: list[str] = field(default_factory=lambda: ["none"])
    """Context extensions evaluated at every length, each its own results.json entry: none (the
    plain model), all (every one that applies to the method) or registered extensions
    (posbench/model/extension.py; docs/context-extension.md)."""
    extension_scope: str = "all"
    """The layers the extensions go on: all, or one layer type of a per-layer method (layers,
    swan, a recipe): global (full attention), local (windowed or chunked) or rope (the rotary
    layers), as Gemma 3 scales its global layers only; docs/context-extension.md."""
    extension_factor: float | None = None
    """Scaling factor of the extensions; None = L / C at each evaluated length L (dynamic_ntk:
    transformers' factor, default 1)."""
    figures: bool = True
    """Draw the run's figures (``<run>/figures/``) once results.json is written; false leaves them
    out, the numbers unchanged (a sweep of many runs: ``posbench plot`` draws the comparison, and
    ``posbench eval run=<dir>`` a run's own figures, later from the saved results)."""
    rerope: ReRoPEConfig = field(default_factory=ReRoPEConfig)
    """Settings of the rerope extension (eval.rerope.*, the table below)."""
    self_extend: SelfExtendConfig = field(default_factory=SelfExtendConfig)
    """Settings of the self_extend extension (eval.self_extend.*, the table below)."""
    streaming_llm: StreamingLLMConfig = field(default_factory=StreamingLLMConfig)
    """Settings of the streaming_llm extension (eval.streaming_llm.*, the table below)."""
    lm_infinite: LMInfiniteConfig = field(default_factory=LMInfiniteConfig)
    """Settings of the lm_infinite extension (eval.lm_infinite.*, the table below)."""
    longrope: LongRoPEConfig = field(default_factory=LongRoPEConfig)
    """Settings of the longrope extension (eval.longrope.*, the table below)."""
    dual_chunk: DualChunkConfig = field(default_factory=DualChunkConfig)
    """Settings of the dual_chunk extension (eval.dual_chunk.*, the table below)."""
    probes: list[str] = field(default_factory=list)
    """Zero-shot probes run after the loss curves, each under every extension, by name: registered
    probes (posbench/evaluation/probes/), each with its settings as the section ``eval.<name>``.
    Empty = none."""
    probe_settings: dict[str, Any] = field(default_factory=dict, metadata={"sections": True})
    """Not a key: each probe's ``eval.<name>`` section, as given (:func:`eval_settings`), built into
    its settings by :func:`posbench.evaluation.probes.probe_settings` (the defaults where absent)."""

    def validate(self) -> None:
        if not self.lengths or any(
            isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in self.lengths
        ):
            raise PosbenchError(f"eval.lengths must be a list of positive integers, got {self.lengths}")
        if self.split not in ("validation", "test", "train"):
            raise PosbenchError(f"eval.split must be validation, test or train, got {self.split!r}")
        require_positive("eval", num_sequences=self.num_sequences, batch_size=self.batch_size,
                         window_stride=self.window_stride, effective_length_eps=self.effective_length_eps)
        if self.extension_factor is not None and not self.extension_factor >= 1:
            raise PosbenchError(f"eval.extension_factor must be >= 1 (or null for L / C), got {self.extension_factor}")
        if self.extension_scope not in ("all", "global", "local", "rope"):
            raise PosbenchError(f"eval.extension_scope={self.extension_scope!r} is not a scope; "
                                "choose one of all, global, local, rope")
        # Extension names are checked by posbench.model.extension.check_names (it owns them), probe
        # names and their settings by the probe registry (posbench.evaluation.probes.configure_probes).

    def section(self, name: str) -> Any:
        """Probe ``name``'s ``eval.<name>`` section as given (a settings object or a mapping), or None."""
        return self.probe_settings.get(name)

    def extension_options(self) -> dict[str, Any]:
        """The settings of the extensions that take some, by extension name (validated)."""
        return {"rerope": self.rerope, "self_extend": self.self_extend, "streaming_llm": self.streaming_llm,
                "lm_infinite": self.lm_infinite, "longrope": self.longrope, "dual_chunk": self.dual_chunk,
                "scope": self.extension_scope}

    def check_lengths(self, train_context: int, need_headline: bool, grid: bool = False) -> None:
        """Refuse lengths below the training context (they have no band at all), and, with
        ``need_headline`` (training), a set of lengths without the headline C-2C band. On a
        ``grid`` the suggested lengths are grids: C and twice its side."""
        if min(self.lengths) < train_context:
            side = math.isqrt(train_context)
            example = f"{train_context},{(2 * side) ** 2}" if grid else f"{2 * train_context}"
            raise PosbenchError(
                f"eval.lengths {self.lengths} has a length below trainer.context={train_context}; "
                f"evaluate at or beyond the training context, e.g. eval.lengths=[{example}]"
            )
        if need_headline and max(self.lengths) < 2 * train_context:
            raise PosbenchError(
                f"eval.lengths {self.lengths} has no length >= 2 x trainer.context = {2 * train_context}, so the "
                f"headline {train_context}-{2 * train_context} band cannot be measured; add it, e.g. "
                f"eval.lengths=[{','.join(map(str, sorted(set(self.lengths) | {2 * train_context})))}]"
            )


def eval_settings(values: dict[str, Any] | None, section: str = "eval") -> EvalConfig:
    """The eval config section -> :class:`EvalConfig`, validated. A key that names a registered
    probe (:data:`PROBE_SETTINGS`) is that probe's section, built and validated with its settings
    dataclass; another mapping is kept as given for the probe registry to build or refuse (its
    probe module may not be imported yet); any other unknown key is refused."""
    values = dict(values or {})
    own = [f.name for f in dataclasses.fields(EvalConfig) if f.name != "probe_settings"]
    sections = {}
    for name in [k for k in values if k not in own and (k in PROBE_SETTINGS or isinstance(values[k], dict))]:
        given = values.pop(name)
        if not isinstance(given, dict):
            raise PosbenchError(f"{section}.{name} must be a mapping of settings, got {given!r}")
        sections[name] = from_section(PROBE_SETTINGS[name], f"{section}.{name}", given) if name in PROBE_SETTINGS \
            else given
    unknown = sorted(set(values) - set(own))
    if unknown:
        raise PosbenchError(f"unknown option(s) {', '.join(f'{section}.{k}' for k in unknown)}; "
                            f"known: {', '.join([*own, *PROBE_SETTINGS])}")
    return dataclasses.replace(from_section(EvalConfig, section, values), probe_settings=sections)


def eval_defaults(value: Any = ...) -> dict[str, Any]:
    """The eval section's keys with their defaults, a probe's section each (Hydra's ConfigStore
    node ``eval_settings``); with ``value``, every leaf is that value instead (``posbench eval``'s
    ``eval_overrides``: null = the run's own)."""
    def leaves(node: dict[str, Any]) -> dict[str, Any]:
        return {k: leaves(v) if isinstance(v, dict) else value for k, v in node.items()}

    node = {k: v for k, v in dataclasses.asdict(EvalConfig()).items() if k != "probe_settings"}
    node.update({name: dataclasses.asdict(cls()) for name, cls in PROBE_SETTINGS.items()})
    return node if value is ... else leaves(node)
