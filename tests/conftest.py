"""Shared pytest fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posbench.methods import dense_score

# Test models are tiny: one thread avoids oversubscribing a 2-core CI machine, where torch's
# default threading made single steps ~100x slower under load. Subprocesses inherit the env.
torch.set_num_threads(1)
import os as _os  # noqa: E402

_os.environ.setdefault("OMP_NUM_THREADS", "1")


def assert_matches_reference(actual: torch.Tensor, expected: torch.Tensor, *, method: str, reference: str,
                             atol: float | None = None, rtol: float | None = None) -> None:
    """``torch.testing.assert_close`` for a method checked against an independent reference,
    which also records the largest absolute difference when ``POSBENCH_REFERENCE_LOG`` names a
    file: ``scripts/reference_table.py`` runs these tests and tabulates the measured maxima."""
    import json

    log = _os.environ.get("POSBENCH_REFERENCE_LOG")
    if log:
        diff = (actual.detach().double() - expected.detach().double()).abs()
        record = {"method": method, "reference": reference, "dtype": str(actual.dtype).replace("torch.", ""),
                  "max_abs_diff": float(diff.max()) if diff.numel() else 0.0, "elements": diff.numel(),
                  "atol": atol, "rtol": rtol, "test": _os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]}
        with open(log, "a") as f:
            f.write(json.dumps(record) + "\n")
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


@pytest.fixture
def sample_data() -> Path:
    """The TinyStories sample shipped inside the package (real text: train.txt.gz,
    valid.txt.gz); always present, so tests using it never skip."""
    from posbench.data.sources import SAMPLE_DIR

    assert (SAMPLE_DIR / "train.txt.gz").is_file(), f"{SAMPLE_DIR} lacks train.txt.gz: a broken install"
    return SAMPLE_DIR


@pytest.fixture
def tiny_corpus() -> dict[str, list[str]]:
    """A few short stories per split, with the distinct story texts tests can look for."""
    names = ["Lily", "Ben", "Tom", "Mia", "Sam", "Max"]
    train = [
        f"Once upon a time, {n} had a red ball.\n{n} played in the park with a dog. "
        f"The dog was happy and {n} was happy too. Story number {i}."
        for i, n in enumerate(names * 5)
    ]
    valid = [f"One day, {n} saw a big bird near the lake. Validation story {i}." for i, n in enumerate(names)]
    return {"train": train, "validation": valid}


@pytest.fixture(scope="session", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory):
    """Every test shares one token cache in a temp dir, never the user's ~/.cache/posbench."""
    import os

    cache = tmp_path_factory.mktemp("posbench-cache")
    old = os.environ.get("POSBENCH_CACHE")
    os.environ["POSBENCH_CACHE"] = str(cache)
    os.environ.setdefault("MPLBACKEND", "Agg")
    yield cache
    if old is None:
        os.environ.pop("POSBENCH_CACHE", None)
    else:
        os.environ["POSBENCH_CACHE"] = old


# Overrides that make a full train + eval run take seconds on a CPU.
QUICK_TRAIN = [
    "model=tiny",
    "data=synthetic",
    "trainer.precision=fp32",  # the same arithmetic on every CPU (auto is bf16 where it is native)
    "logger=none",
    "trainer.context=32",
    "trainer.batch_size=4",
    "trainer.max_steps=6",
    "trainer.log_every=2",
    "trainer.val_every=0",
    "trainer.val_sequences=4",
    "trainer.checkpoint_every_steps=0",
    "trainer.checkpoint_every_minutes=0",
    "trainer.warmup_steps=2",
    "eval.lengths=[64]",
    "eval.num_sequences=4",
    "eval.batch_size=4",
]


def load_script(name: str):
    """``scripts/<name>.py`` as a module, for testing its functions."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compose_config(name: str, overrides: list[str]):
    """Compose a shipped primary config (train, eval, ...) the way the CLI does."""
    from hydra import compose, initialize_config_dir

    from posbench.config import config_dir

    with initialize_config_dir(config_dir=str(config_dir()), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


# ----------------------------------------------------------------------------- method test helpers


def methods_with(predicate) -> list[str]:
    """Registered methods whose class satisfies ``predicate`` (its declared traits), in registry
    order: test lists follow the registry, so a new method needs no edit here."""
    from posbench.methods import list_methods, method_class

    return [name for name in list_methods() if predicate(method_class(name))]


def qk(B=2, H=4, T=24, D=8, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    k = torch.randn(B, H, T, D, generator=g, dtype=dtype)
    return q, k


def layer_input(q, d_model=32, seed=5):
    """A stand-in attention input x (B, T, d_model) for content-dependent methods (fox)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(q.shape[0], q.shape[2], d_model, generator=g, dtype=q.dtype)


def full_scores(method, q, k, positions, layer=0):
    """q.k / sqrt(D) after rotate_qk, plus the dense score term: (B, H, T, T)."""
    qr, kr = method.rotate_qk(q, k, positions, layer)
    B, H, T, D = q.shape
    s = torch.einsum("bhid,bhjd->bhij", qr.double(), kr.double()) * D**-0.5
    x = layer_input(q, method.dims.d_model)
    fn = method.score_term(qr, positions, layer, k=kr, x=x) if method.has_score_term else None
    if fn is not None:
        s = s + dense_score(fn, B, H, T, q.device).double()
    return s


def causal(T):
    idx = torch.arange(T)
    return idx[:, None] >= idx[None, :]



def make_method(name, d_model=32, n_heads=4, n_layers=2, randomise=True, **options):
    """Method ``name`` in float64, its parameters drawn positive (valid for every method) unless
    ``randomise`` is false."""
    torch.manual_seed(0)
    from posbench.methods import ModelDims, build_method

    m = build_method(name, ModelDims(d_model, n_heads, n_layers), **options)
    if randomise:
        with torch.no_grad():
            for p in m.parameters():
                p.uniform_(0.2, 1.2)  # positive: valid for kerple's r1, r2 and fire's c
    return m.double()


def dense_term(m, q, pos, layer=0, k=None):
    """The score term of ``m`` materialised: (B, H, T, T) float64."""
    B, H, T, _ = q.shape
    fn = m.score_term(q, pos, layer, k=k, x=layer_input(q, m.dims.d_model))
    return dense_score(fn, B, H, T, q.device).double()


def assert_causal_model(model, length: int, changed_at: int, vocab: int = 64) -> torch.Tensor:
    """Changing input token ``changed_at`` of a (1, length) sequence changes no earlier logit and
    does change a later one; the logits (1, length, vocab) are finite. Returns them."""
    idx = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, changed_at] = (idx[0, changed_at] + 1) % vocab
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a[0, :changed_at], b[0, :changed_at], atol=0, rtol=0)
    assert not torch.allclose(a[0, changed_at:], b[0, changed_at:])
    return a
