"""``posbench export``: a finished rope or nope run -> a transformers model folder that
AutoModelForCausalLM loads with the run's logits (and AutoTokenizer with the run's tokenizer);
other methods and unfinished runs are refused in one line, with nothing written."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import compose_config, interrupted, posbench_cli
from transformers import AutoModelForCausalLM, AutoTokenizer

from posbench.commands.export import export_run
from posbench.core.errors import PosbenchError
from posbench.runs.load import load_run


def export(run_dir, out):
    return export_run(compose_config("export", [f"run={run_dir}", f"out={out}"]), log=lambda _: None)


@pytest.mark.slow
@pytest.mark.parametrize(("method", "cls"), [("rope", "LlamaForCausalLM"), ("nope", "SmolLM3ForCausalLM")])
def test_export_of_a_trained_run_gives_its_logits(trained_run, tmp_path, method, cls):
    run_dir = trained_run(f"method={method}")
    record = export(run_dir, tmp_path / "hf")
    assert record["class"] == cls and record["step"] == 6
    assert json.loads((tmp_path / "hf" / "posbench_export.json").read_text())["class"] == cls
    model = load_run(run_dir, log=lambda _: None).model
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    idx = torch.randint(0, model.cfg.vocab_size, (2, 96), generator=torch.Generator().manual_seed(3))  # 3 x C
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=idx).logits, model(idx), atol=2e-5, rtol=1e-4)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert tokenizer.eos_token == "<|endoftext|>" and loaded.config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.decode(tokenizer("Once upon a time").input_ids) == "Once upon a time"


@pytest.mark.slow
def test_export_refuses_other_methods_and_unfinished_runs_in_one_line(trained_run, tmp_path):
    proc = posbench_cli("export", f"run={trained_run('method=alibi')}", f"out={tmp_path / 'hf'}", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "posbench export: error: method=alibi has no transformers class that computes it; "
        "export takes rope and nope runs (docs/commands.md, posbench export)"]
    assert not (tmp_path / "hf").exists()

    stopped = tmp_path / "stopped"
    interrupted(stopped, at=2)  # a checkpoint at step 2, no results.json
    with pytest.raises(PosbenchError, match="has not finished"):
        export(stopped, tmp_path / "hf")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(PosbenchError, match="is not empty"):
        export(trained_run(), tmp_path / "full")
    assert not (tmp_path / "hf").exists() and not list(tmp_path.glob(".*export*"))
