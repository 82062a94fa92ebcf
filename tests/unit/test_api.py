"""The Python API: every name ``posbench`` exports resolves, and ``import posbench`` stays light."""

from __future__ import annotations

import subprocess
import sys

import posbench


def test_every_exported_name_resolves():
    for name in posbench.__all__:
        assert getattr(posbench, name) is not None, name
    from posbench.evaluation.loss import per_position_loss
    from posbench.model.transformer import Transformer

    assert posbench.Transformer is Transformer and posbench.per_position_loss is per_position_loss


def test_an_unknown_name_is_an_attribute_error():
    try:
        posbench.no_such_thing  # noqa: B018
    except AttributeError as err:
        assert "no_such_thing" in str(err)
    else:
        raise AssertionError("posbench.no_such_thing resolved")


def test_import_posbench_imports_neither_torch_nor_the_methods():
    code = "import sys, posbench; print('torch' in sys.modules, 'posbench.methods' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]
