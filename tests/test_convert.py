"""Keras preset import: config variants, exact parameter counts, streaming, and bad input."""
import json
import os
import shutil
import subprocess
import sys
import tracemalloc

import jax
import numpy as np
import pytest

import jaxlm
from jaxlm import families
from jaxlm.convert import keras_preset
from jaxlm.convert.__main__ import main as convert_main
from jaxlm.errors import UserError


@pytest.mark.parametrize("name,expected", [("gemma_2b_en", 2_506_172_416),
                                           ("gemma_instruct_2b_en", 2_506_172_416),
                                           ("gemma_7b_en", 8_537_680_896),
                                           ("gemma_instruct_7b_en", 8_537_680_896)])
def test_parameter_counts_equal_kerashub_without_allocating(name, expected):
    model, params = jaxlm.load(name, abstract=True)
    import jax
    leaves = jax.tree.leaves(params)
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(int(np.prod(x.shape)) for x in leaves) == expected == model.config.num_params


@pytest.fixture
def preset(keras_gemma_preset, tmp_path):
    """A fresh, writable copy of a small KerasHub preset per test."""
    src, backbone = keras_gemma_preset("gemma_convert", num_key_value_heads=1)
    dst = tmp_path / "preset"
    shutil.copytree(src, dst)
    return str(dst), backbone


def edit_config(path, fn):
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    fn(cfg)
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def test_old_keras_nlp_config_without_dtype_and_with_unknown_keys(preset):
    """keras-nlp 0.8 era presets: keras_nlp> names, no dtype, no Gemma-2 keys, extra top-level keys."""
    path, backbone = preset

    def to_old(cfg):
        cfg["registered_name"] = "keras_nlp>GemmaBackbone"
        cfg["module"] = "keras_nlp.src.models.gemma.gemma_backbone"
        cfg["weights"], cfg["assets"] = "model.weights.h5", []
        for key in ("dtype", "use_post_ffw_norm", "use_post_attention_norm", "final_logit_soft_cap",
                    "attention_logit_soft_cap", "sliding_window_size", "use_sliding_window_attention",
                    "layer_norm_epsilon", "query_head_dim_normalize"):
            cfg["config"].pop(key)
        cfg["config"]["some_future_key"] = 1
    edit_config(path, to_old)
    model, params = jaxlm.load(path)
    assert model.config.num_kv_heads == 1 and model.config.norm_eps == 1e-6
    assert model.config.ffw_dim == backbone.intermediate_dim // 2


def test_weights_are_streamed_one_tensor_at_a_time(keras_gemma_preset):
    """Host memory while reading stays near one tensor, not a second copy of the model."""
    path, backbone = keras_gemma_preset("gemma_stream", num_layers=12, hidden_dim=64,
                                        intermediate_dim=512, num_key_value_heads=2)
    model, shapes = jaxlm.load(path, abstract=True)
    flat = {p: s for p, s in keras_preset.flatten(shapes).items()}
    sizes = [int(np.prod(s.shape)) * 4 for s in flat.values()]
    tracemalloc.start()
    params = keras_preset.read_params(*families.read_keras_config(path), keras_preset.weight_files(path), flat)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert sum(sizes) > 8 * max(sizes)  # the check below means something only for many tensors
    assert peak < 3 * max(sizes) + 2**20, (peak, max(sizes), sum(sizes))
    assert len(keras_preset.flatten(params)) == len(flat)


def test_the_embedding_is_read_by_the_rows_each_device_holds(keras_gemma_preset, monkeypatch):
    """Split over the vocabulary, the table is read in one block per device, never whole: in a
    multi-process run a process reads only its own devices' rows."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    path, _ = keras_gemma_preset("gemma_rows", num_layers=1, hidden_dim=16, intermediate_dim=32)
    blocks, get = [], keras_preset.H5Store.get
    monkeypatch.setattr(keras_preset.H5Store, "get", lambda self, key, *rows: (
        blocks.append(rows) if "embedding" in key else None) or get(self, key, *rows))
    mesh = Mesh(np.array(jax.devices()[:8]), ("model",))
    split = NamedSharding(mesh, P("model", None))
    _, params = jaxlm.load(path, placement=lambda p, shape: split if p == "token_embedding/embeddings"
                           else NamedSharding(mesh, P()))
    table = params["token_embedding"]["embeddings"]
    vocab = table.shape[0]
    assert sorted(blocks) == [(i * vocab // 8, (i + 1) * vocab // 8) for i in range(8)]
    _, whole = jaxlm.load(path)
    np.testing.assert_array_equal(np.asarray(table), np.asarray(whole["token_embedding"]["embeddings"]))


# --- bad input: one clear line, exit code 2 ----------------------------------------------------

def run_cli(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        convert_main(args)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    return err


def test_folder_that_is_not_a_preset(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    err = run_cli([str(tmp_path / "empty"), str(tmp_path / "out")], capsys)
    assert "config.json" in err
    assert "does not exist" in run_cli([str(tmp_path / "nope"), str(tmp_path / "out")], capsys)


def test_unsupported_keras_class(preset, tmp_path, capsys):
    path, _ = preset
    edit_config(path, lambda c: c.update(registered_name="keras_hub>BertBackbone", class_name="BertBackbone"))
    err = run_cli([path, str(tmp_path / "out")], capsys)
    assert "BertBackbone" in err and "GemmaBackbone" in err


def test_weights_whose_shapes_disagree_with_config(preset, tmp_path, capsys):
    path, _ = preset
    edit_config(path, lambda c: c["config"].update(hidden_dim=48))
    err = run_cli([path, str(tmp_path / "out")], capsys)
    assert "shape" in err and "config" in err


def test_truncated_h5_file(preset, tmp_path, capsys):
    path, _ = preset
    weights = os.path.join(path, "model.weights.h5")
    with open(weights, "r+b") as f:
        f.truncate(os.path.getsize(weights) // 2)
    err = run_cli([path, str(tmp_path / "out")], capsys)
    assert "truncated" in err


def test_existing_output_is_never_clobbered(preset, tmp_path, capsys):
    path, _ = preset
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    assert "not empty" in run_cli([path, str(out)], capsys)
    assert (out / "precious.txt").read_text() == "keep me"


def test_unsupported_gemma3_options_are_refused_clearly(preset):
    path, _ = preset

    def to_vision(c):
        c["registered_name"] = "keras_hub>Gemma3Backbone"
        c["config"].update(use_query_key_norm=True, vision_encoder={"class_name": "Gemma3VisionEncoder"})
    edit_config(path, to_vision)
    with pytest.raises(UserError, match="vision_encoder"):
        jaxlm.load(path)


def test_real_cli_exit_code(tmp_path):
    """The module entry point itself (not just main()) exits 2 with one line, no traceback."""
    r = subprocess.run([sys.executable, "-m", "jaxlm.convert", str(tmp_path / "missing"), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Traceback" not in r.stderr
