"""The TPU compiler (libtpu, no TPU needed) accepts the sharded train and decode steps.

Every change to the model, the step or the sharding rules is compiled with pjit for a v5e-8
(`v5e:2x4`, 8 chips on a (1, 8) mesh), the way a user's run would be. Skipped only when libtpu
is not installed (the `test` extra installs it).
"""
import os

import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # pytest-xdist workers each load it
pytest.importorskip("libtpu")

import jaxlm  # noqa: E402
from jaxlm.errors import UserError  # noqa: E402
from jaxlm.train import aot  # noqa: E402

TOPOLOGY = "v5e:2x4"


@pytest.fixture(scope="module")
def tiny():
    return jaxlm.load("gemma_tiny", "bfloat16", abstract=True)


def test_lora_train_step_compiles_for_v5e(tiny):
    model, params = tiny
    report, compiled = aot.compile_train_step(model, params, topology=TOPOLOGY, mesh_spec="1x8",
                                              lora_rank=4, batch_size=8, sequence_length=32)
    assert compiled is not None and report.fits
    assert report.device_kind.startswith("TPU v5")
    # Weights are split 8 ways on the model axis, so each core holds about 1/8 of them.
    whole = sum(x.size * x.dtype.itemsize for x in jaxlm.tree.flatten(params).values())
    assert whole / 8 <= report.weights < whole / 2
    assert 0 < report.temporaries and report.total <= report.hbm
    assert report.flops and report.flops > 0
    # Sharded contractions need cross-core reductions in the partitioned program.
    assert report.collectives["all-reduce"] > 0
    assert "TPU v5" in report.table() and "fits" in report.table()


def test_decode_step_compiles_for_v5e(tiny):
    model, params = tiny
    compiled = aot.compile_decode(model, params, topology=TOPOLOGY, mesh_spec="2x4",
                                  batch_size=2, prompt_len=16, total_len=32)
    text = compiled.as_text()
    assert "while" in text  # the decode loop stays one compiled while-loop
    assert compiled.memory_analysis().temp_size_in_bytes > 0


def test_unknown_topology_is_one_line_error():
    with pytest.raises(UserError, match="v5e:2x4"):
        aot.topology_devices("v5e-8")


def test_train_py_compile_only_prints_the_table(capsys):
    from jaxlm.train import cli, lm
    rc = lm.run(cli.parse(["--preset=gemma_tiny", "--mesh=1x8", "--compile_only=v5e:2x4",
                           "--sequence_length=32", "--out=/nonexistent/never/written"]))
    out = capsys.readouterr().out
    assert rc == 0
    assert "TPU v5 lite" in out and "fits" in out and "temporaries" in out
