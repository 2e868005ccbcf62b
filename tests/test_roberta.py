"""RoBERTa: parameter counts, live parity against KerasHub RobertaMaskedLM, preset round trip."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxlm
from jaxlm.tree import flatten

VOCAB = 97


@pytest.mark.parametrize("name,backbone,head", [("roberta_base_en", 124_052_736, 642_393),
                                                ("roberta_large_en", 354_307_072, 1_101_913)])
def test_preset_param_counts(name, backbone, head):
    model, params = jaxlm.load(name, abstract=True)
    flat = flatten(params)
    n_head = sum(int(np.prod(v.shape)) for k, v in flat.items() if k.startswith("mlm_head/"))
    n_all = sum(int(np.prod(v.shape)) for v in flat.values())
    assert (n_all - n_head, n_head) == (backbone, head)
    assert model.config.num_params == backbone + head


def _randomise(model, seed):
    """Keras starts LayerNorm at (1, 0) and biases at 0; randomise so parity sees every term."""
    rng = np.random.RandomState(seed)
    for w in model.weights:
        if w.path.endswith(("gamma", "beta", "bias", "output_bias")):
            w.assign((rng.randn(*w.shape) * 0.2 + (1.0 if w.path.endswith("gamma") else 0.0))
                     .astype("float32"))


@pytest.fixture(scope="module")
def keras_mlm(tmp_path_factory):
    """A small random KerasHub RobertaMaskedLM saved as a preset (backbone + task weights)."""
    import keras
    import keras_hub
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.RobertaBackbone(
        vocabulary_size=VOCAB, num_layers=2, num_heads=4, hidden_dim=32, intermediate_dim=48,
        max_sequence_length=16, dropout=0.0)
    lm = keras_hub.models.RobertaMaskedLM(backbone=backbone, preprocessor=None)
    _randomise(lm, 1)
    path = str(tmp_path_factory.mktemp("roberta_preset"))
    lm.save_to_preset(path)
    return path, lm


def _batch(width=12):
    rng = np.random.RandomState(3)
    lengths = [12, 7, 3]
    ids = rng.randint(4, VOCAB, (3, width)).astype("int32")
    mask = np.arange(width)[None, :] < np.asarray(lengths)[:, None]
    ids[:, 0] = 0
    ids[~mask] = 1
    positions = np.stack([rng.choice(n, 3) for n in lengths]).astype("int32")
    return ids, mask, positions


def _keras_logits(lm, ids, mask, positions):
    out = lm({"token_ids": ids, "padding_mask": mask, "mask_positions": positions})
    return np.asarray(out)


def test_logits_match_keras_hub(keras_mlm):
    path, lm = keras_mlm
    model, params = jaxlm.load(path, dtype="float32")
    ids, mask, positions = _batch()
    expected = _keras_logits(lm, ids, mask, positions)
    every = model.apply({"params": params}, ids, mask)  # [B, T, V] at every position
    at_mask = np.take_along_axis(np.asarray(every), positions[..., None], axis=1)
    assert every.shape == (3, 12, VOCAB)
    assert np.max(np.abs(at_mask - expected)) <= 1e-4
    gathered = model.apply({"params": params}, ids, mask, mask_positions=positions)
    assert np.max(np.abs(np.asarray(gathered) - expected)) <= 1e-4
    hidden = model.apply({"params": params}, ids, mask, return_hidden=True)
    keras_hidden = lm.backbone({"token_ids": ids, "padding_mask": mask})
    assert np.max(np.abs(np.asarray(hidden) - np.asarray(keras_hidden))[mask]) <= 1e-4


def test_round_trip_to_keras_preset(keras_mlm, tmp_path):
    import keras_hub
    from jaxlm import families
    from jaxlm.convert import keras_preset
    path, lm = keras_mlm
    model, params = jaxlm.load(path, dtype="float32")
    out = str(tmp_path / "back")
    keras_preset.write_preset(families.by_config(model.config), model.config, params, out)
    assert {"config.json", "model.weights.h5", "task.weights.h5", "task.json"} <= set(os.listdir(out))
    back = keras_hub.models.RobertaMaskedLM.from_preset(out, preprocessor=None)
    ids, mask, positions = _batch()
    np.testing.assert_allclose(_keras_logits(back, ids, mask, positions),
                               _keras_logits(lm, ids, mask, positions), atol=1e-6)
    # ...and jaxlm reads its own export back bit-for-bit.
    _, again = jaxlm.load(out, dtype="float32")
    for k, v in flatten(params).items():
        np.testing.assert_array_equal(np.asarray(flatten(again)[k]), np.asarray(v))


def test_backbone_only_preset(keras_mlm, tmp_path, capsys):
    """No task.weights.h5: the backbone is read, the MLM head randomly initialised with a warning."""
    import shutil
    path, lm = keras_mlm
    bare = str(tmp_path / "bare")
    shutil.copytree(path, bare)
    os.remove(os.path.join(bare, "task.weights.h5"))
    model, params = jaxlm.load(bare, dtype="float32")
    assert "task.weights.h5" in capsys.readouterr().err
    ids, mask, _ = _batch()
    hidden = model.apply({"params": params}, ids, mask, return_hidden=True)
    keras_hidden = lm.backbone({"token_ids": ids, "padding_mask": mask})
    assert np.max(np.abs(np.asarray(hidden) - np.asarray(keras_hidden))[mask]) <= 1e-4
    assert np.all(np.isfinite(np.asarray(model.apply({"params": params}, ids, mask))))


def test_dropout_needs_rng_and_changes_output():
    from models.roberta import PRESETS, Roberta
    cfg = PRESETS["roberta_tiny"].replace(dropout=0.1)
    model = Roberta(cfg)
    ids = jnp.ones((2, 8), jnp.int32)
    params = model.init(jax.random.key(0), ids)["params"]
    a = model.apply({"params": params}, ids)
    b = model.apply({"params": params}, ids, deterministic=False, rngs={"dropout": jax.random.key(1)})
    assert a.shape == b.shape and not np.allclose(a, b)
    np.testing.assert_array_equal(a, model.apply({"params": params}, ids))


def test_too_long_sequence_is_refused():
    model, params = jaxlm.load("roberta_tiny")
    with pytest.raises(ValueError, match="max_sequence_length"):
        model.apply({"params": params}, jnp.zeros((1, 129), jnp.int32))


def test_bfloat16_compute_on_float32_params():
    """--bfloat16 training: the same float32 parameters, bfloat16 activations, close logits."""
    from models.roberta import Roberta
    model, params = jaxlm.load("roberta_tiny", dtype="float32")
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 1024, (2, 16)), jnp.int32)
    ref = model.apply({"params": params}, ids)
    bf16 = Roberta(model.config.replace(dtype="bfloat16")).apply({"params": params}, ids)
    assert bf16.dtype == jnp.bfloat16
    assert np.max(np.abs(np.asarray(bf16, np.float32) - np.asarray(ref))) < 0.1
