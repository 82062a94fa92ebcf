"""posbench: length-extrapolation benchmarks for transformer position embeddings.

Python API (see README):

    posbench.list_methods()                      -> ["nope", "learned", ...]
    posbench.create_model("rope", flavour="tiny")  -> nn.Module, ids (B, T) -> logits (B, T, V)
    posbench.load_run("outputs/.../run")         -> Run(model, config, results)

and, imported on first use, the pieces a notebook needs to measure a run itself:
``Transformer``, ``ModelConfig``, ``Run``, ``PreparedData``, ``eval_sequences``,
``per_position_loss``, ``band_means`` (docs/api.md).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.7.0"


def list_methods(layout: str | None = "sequence") -> list[str]:
    """Names of the registered position methods for ``layout``: ``sequence`` (the language
    model's, the default), ``grid`` (the grid encoder's, docs/grid.md), or None for all."""
    from posbench.methods import list_methods as _list

    return _list(layout)


def create_model(
    method: str,
    flavour: str = "small",
    method_options: dict[str, Any] | None = None,
    **model_overrides: Any,
):
    """Build a freshly initialised model.

    Args:
        method: position method name, one of :func:`list_methods`.
        flavour: model preset from ``configs/model/`` (``tiny``, ``mini``, ``small``, ``medium``).
        method_options: overrides of the method's options (defaults from ``configs/method/``),
            e.g. ``{"base": 500000.0}`` for rope.
        **model_overrides: any :class:`posbench.model.transformer.ModelConfig` field, e.g. ``vocab_size=50257``.

    Returns:
        A :class:`posbench.model.transformer.Transformer`: token ids ``(B, T)`` -> logits ``(B, T, vocab)``
        for any ``T`` the method supports (every method but ``learned`` supports any length).
    """
    from posbench.config import load_group_option
    from posbench.model.transformer import ModelConfig, build_model
    from posbench.runs.spec import MethodSpec

    spec = MethodSpec.defaults(method, method_options)  # unknown names fail here with the valid ones
    model_cfg = ModelConfig.from_dict({**load_group_option("model", flavour), **model_overrides})
    return build_model(model_cfg, spec.name, spec.options)


def load_run(run_dir: str, device: str = "cpu"):
    """Load a finished run: returns ``Run(model, config, results)`` (see posbench.runs.load)."""
    from posbench.runs.load import load_run as _load

    return _load(run_dir, device=device)


# name -> the module that defines it; imported on first access so `import posbench` stays light.
_LAZY = {
    "Transformer": "posbench.model.transformer",
    "ModelConfig": "posbench.model.transformer",
    "Run": "posbench.runs.load",
    "PreparedData": "posbench.data",
    "eval_sequences": "posbench.data.loader",
    "per_position_loss": "posbench.evaluation.loss",
    "band_means": "posbench.evaluation.curves",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'posbench' has no attribute {name!r}")


__all__ = ["__version__", "create_model", "list_methods", "load_run", *_LAZY]
