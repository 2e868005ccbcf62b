"""`jaxlm.load` and `jaxlm.load_tokenizer`: one entry point for Keras presets, jaxlm folders,
Hugging Face folders, GGUF files and built-in preset names.

A jaxlm folder (written by `python -m jaxlm.convert` or `save`) is::

    jaxlm.json        {"family": "gemma", "config": {...}, "format": 1}
    params/           an orbax checkpoint of the parameter tree
    tokenizer/        vocabulary.spm (or the family's tokenizer files)

A llama.cpp `.gguf` file (Gemma 1/2/3), or a folder holding exactly one, is dequantised to
float and mapped onto the same tree (jaxlm/convert/gguf.py). A Hugging Face folder (config.json
with a "model_type", safetensors weights) is read tensor by tensor (jaxlm/convert/hf.py).

`placement(path, shape) -> Sharding` puts each tensor straight onto its device(s) as it is read
or created; without it, tensors land on the default device.

Two dtypes: `dtype` is the compute dtype (the model config's), `param_dtype` the one the
parameters are stored in (default: the same). A trainer keeps float32 master weights under
bfloat16 compute by asking for `dtype="bfloat16", param_dtype="float32"` (`jaxlm.precision`);
the models cast each weight to the compute dtype where they use it.

Paths may be local or URLs (`gs://...`, through `jaxlm.storage`); a `.gguf` file on a URL is
copied to a local temporary file first (llama.cpp's reader memory-maps it).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Callable

import jax
import jax.extend.random
import jax.numpy as jnp

from jaxlm import checkpoint, families, precision, storage, tokenizer
from jaxlm.convert import hf, keras_preset
from jaxlm.errors import UserError
from jaxlm.tree import flatten, place_streamed, unflatten

Placement = Callable[[str, tuple], jax.sharding.Sharding]
FOLDER_META = "jaxlm.json"
SAVE_FORMATS = ("jaxlm", "hf", "keras")
_KIND_NAMES = {"preset": "built-in preset", "jaxlm": "jaxlm folder", "gguf": "GGUF file",
               "hf": "Hugging Face folder"}


def default_dtype() -> str:
    """float32 on CPU (exact parity), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve(path: str, dtype: str | None = None):
    """-> (kind, family, config) without reading weights; kind in {"preset", "keras", "jaxlm", "gguf", "hf"}."""
    path = os.fspath(path)
    dtype = precision.check_dtype(dtype, "dtype") or default_dtype()
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from jaxlm.convert import gguf
        family = families.by_name("gemma")
        with storage.local(gguf_file) as local_path:
            kwargs = gguf.config_kwargs(gguf.open_reader(local_path))
        return "gguf", family, family.config_cls(**kwargs, dtype=dtype)
    if storage.isdir(path):
        if storage.exists(storage.join(path, FOLDER_META)):
            family, config = _folder_config(path)
            return "jaxlm", family, config.replace(dtype=dtype)
        if hf.is_hf_folder(path):
            family, config = hf.read_config(path)
            return "hf", family, config.replace(dtype=dtype)
        if storage.exists(storage.join(path, "config.json")):
            family, config = families.read_keras_config(path)
            return "keras", family, config.replace(dtype=dtype)
        if any(f.endswith(".safetensors") for f in storage.listdir(path)):
            raise UserError(f"{path} holds safetensors weights but no config.json; an HF model "
                            "folder needs the config.json saved with the weights")
        raise UserError(f"{path} is neither a Keras preset folder (no config.json) nor a jaxlm "
                        f"folder (no {FOLDER_META})")
    found = families.preset(path)
    if found is not None:
        family, config = found
        return "preset", family, config.replace(dtype=dtype)
    if storage.exists(path):
        raise UserError(f"{path} is a file; pass the preset folder that contains it "
                        "(or weights=FILE for a fine-tuned .weights.h5)")
    raise UserError(f"{path} does not exist and is not a built-in preset; "
                    f"built-in presets: {', '.join(families.all_presets())}")


def find_gguf(path: str) -> str | None:
    """The .gguf file `path` names, or the single one inside folder `path`; else None."""
    if path.endswith(".gguf"):
        if not storage.exists(path):
            raise UserError(f"GGUF file {path} does not exist")
        return path
    if storage.isdir(path) and not storage.exists(storage.join(path, "config.json")):
        found = [f for f in storage.listdir(path) if f.endswith(".gguf")]
        if len(found) > 1:
            raise UserError(f"{path} holds several .gguf files ({', '.join(found)}); pass one of them")
        if found:
            return storage.join(path, found[0])
    return None


def _folder_config(path: str):
    """(family, config) from a jaxlm folder's jaxlm.json, or one line saying what is wrong."""
    meta_path = storage.join(path, FOLDER_META)
    try:
        meta = json.loads(storage.read_text(meta_path))
        family = families.by_name(meta["family"])
        return family, family.config_cls(**meta["config"])
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, UserError):
            raise
        raise UserError(f"{meta_path} is damaged ({type(e).__name__}: {e}); convert the model "
                        "again or restore the file") from None


def load_tokenizer(path: str):
    """A tokenizer from a Keras preset, a jaxlm folder, a Hugging Face folder, a `.spm`/`.model`
    file, a `.gguf` file (its vocabulary rebuilt as a sentencepiece model) or a built-in preset name."""
    path = os.fspath(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        from jaxlm.convert import gguf
        return tokenizer.Tokenizer(gguf.tokenizer_proto(gguf.open_reader(gguf_file)))
    if not storage.exists(path):
        if families.preset(path) is not None:
            fam, cfg = families.preset(path)
            if fam.name != "gemma":
                raise UserError(f"the built-in {path} has no tokenizer; train one with "
                                "`python -m jaxlm.tokenizer train` or pass a preset folder")
            return tokenizer.default_tokenizer(cfg.vocab_size)
        raise UserError(f"tokenizer path {path} does not exist")
    if storage.isdir(path):
        for rel in (tokenizer.SPM_ASSET, "tokenizer/vocabulary.spm"):
            if storage.exists(storage.join(path, rel)):
                return load_tokenizer(storage.join(path, rel))
        from jaxlm.convert import hf_tokenizer
        found = hf_tokenizer.read_tokenizer(path) or _maybe_bpe(path)  # an HF folder's files, or a bare BPE folder
        if found is not None:
            return found
        raise UserError(f"{path} holds no tokenizer (expected {tokenizer.SPM_ASSET}, tokenizer/vocabulary.spm "
                        "or an HF folder's tokenizer.model / vocab.json + merges.txt)")
    return tokenizer.Tokenizer(storage.read_bytes(path))


def _maybe_bpe(path: str):
    """RoBERTa's byte-level BPE (vocabulary.json + merges.txt), when that family is installed."""
    try:
        from jaxlm.bpe import load_bpe
    except ImportError:
        return None
    return load_bpe(path)


def abstract_params(module, config) -> dict:
    """{path: ShapeDtypeStruct} of a model's parameters, computed without allocating them."""
    ids = jnp.zeros((1, 1), jnp.int32)
    shapes = jax.eval_shape(lambda: module.init(jax.random.key(0), ids))["params"]
    return flatten(shapes)


def load(path: str, dtype: str | None = None, abstract: bool = False, *,
         weights: str | None = None, placement: Placement | None = None, seed: int = 0,
         param_dtype: str | None = None):
    """-> (model, params). See the module docstring for what `path` may be.

    dtype: compute dtype, and the parameters' unless `param_dtype` is given (default: float32
      on CPU, bfloat16 on accelerators).
    param_dtype: the dtype parameters are stored in (e.g. float32 master weights for training
      under bfloat16 compute). Parameters the model keeps in float32 anyway (norm scales) stay
      float32.
    abstract: return `jax.ShapeDtypeStruct` leaves; nothing is read or allocated.
    weights: a `.weights.h5` written by Keras `save_weights` (backbone- or task-level) whose
      tensors replace the preset's, e.g. a fine-tuned GemmaCausalLM on top of its preset.
    seed: random init of a built-in preset name.
    """
    path = os.fspath(path)
    kind, family, config = resolve(path, dtype)
    model = family.module_cls(config)
    # Parameters are created/read as a model of the storage dtype would hold them.
    storage_model = model if param_dtype is None else family.module_cls(
        config.replace(dtype=precision.check_dtype(param_dtype, "param_dtype")))
    shapes = abstract_params(storage_model, storage_model.config)
    if abstract:
        if placement is not None:
            shapes = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement(p, s.shape))
                      for p, s in shapes.items()}
        return model, unflatten(shapes)
    if weights is not None and kind != "keras":
        raise UserError("weights= applies to a Keras preset folder; "
                        f"{path} is a {_KIND_NAMES[kind]}")
    if kind == "keras":
        files = keras_preset.weight_files(path, weights)
        task = keras_preset.task_paths(family, config)
        if task and "task" not in files:
            # A backbone-only preset: KerasHub's task from_preset initialises the head; so do we.
            print(f"warning: {path} has no task.weights.h5; {len(task)} task weights "
                  f"({sorted(task)[0]}, …) are randomly initialised", file=sys.stderr)
            fresh = flatten(init_params(storage_model, shapes, placement, seed))
            params = flatten(keras_preset.read_params(
                family, config, files, {p: s for p, s in shapes.items() if p not in task}, placement))
            params = unflatten({**params, **{p: fresh[p] for p in task}})
        else:
            params = keras_preset.read_params(family, config, files, shapes, placement)
    elif kind == "jaxlm":
        params = _restore_folder_params(path, shapes, placement)
    elif kind == "gguf":
        params = _read_gguf_params(find_gguf(path), config, shapes, placement)
    elif kind == "hf":
        params = hf.read_params(path, family, config, shapes, placement)
    else:
        params = init_params(storage_model, shapes, placement, seed)
    return model, params


def init_params(model, shapes: dict, placement: Placement | None, seed: int = 0) -> dict:
    """Random init, created directly in the target dtype and shardings (never whole on one device).

    The key is an `INIT_PRNG` key (XLA's RngBitGenerator): each tensor's random bits are made
    inside the fusion that turns them into its values. With JAX's default threefry, XLA:CPU
    runs the hash as a loop over full-size uint32 counters and scheduled every parameter's
    counters before any loop, so Gemma 2B in bfloat16 (5.0 GB of parameters) asked for 23.7 GB
    of temporaries (0.16 GB with RngBitGenerator) and was killed on a 24 GB machine. The same
    seed gives the same parameters on any mesh.
    """
    return initializer(model, shapes, placement, seed)()["params"]


def initializer(model, shapes: dict, placement: Placement | None = None, seed: int = 0):
    """The jitted random init `init_params` runs: () -> {"params": tree}."""
    ids = jnp.zeros((1, 1), jnp.int32)
    out = None
    if placement is not None:
        out = {"params": unflatten({p: placement(p, s.shape) for p, s in shapes.items()})}
    return jax.jit(lambda: model.init(jax.random.key(seed, impl=INIT_PRNG), ids), out_shardings=out)


def _threefry_bits(key, bit_width: int, shape):
    _, bits = jax.lax.rng_bit_generator(key, shape, jnp.dtype(f"uint{bit_width}"),
                                        algorithm=jax.lax.RandomAlgorithm.RNG_THREE_FRY)
    return bits


# JAX's "rbg" keys, whose bits XLA makes with ThreeFry-2x32 rather than the backend's default
# algorithm. XLA:CPU's default is Philox, whose 64-bit products it does not vectorise: 9.4 ns a
# value against ThreeFry's 1.5 (a [2048, 16384] uniform draw, a 2-core AMD EPYC), and Gemma 2B's
# random init in bfloat16 took 33.9 s against 6.6 s, with the same 0.04 GB of temporaries
# (ad hoc, bench/README.md). Keys are seeded, split and folded as rbg's.
_RBG = jax.extend.random.rbg_prng_impl
INIT_PRNG = jax.extend.random.define_prng_impl(
    key_shape=_RBG.key_shape, seed=_RBG.seed, split=_RBG.split, fold_in=_RBG.fold_in,
    random_bits=_threefry_bits, name="rbg_threefry", tag="rbg3")


def save(out_dir: str, model, params: dict, tokenizer=None, format: str = "jaxlm") -> None:
    """Write a jaxlm folder (see module docstring; `params/` is replaced atomically via orbax).

    format: "jaxlm", "hf" (a Hugging Face folder, jaxlm/convert/hf.py) or "keras" (a Keras preset).
    """
    if format not in SAVE_FORMATS:
        raise UserError(f"format={format!r}: choose one of {', '.join(SAVE_FORMATS)}")
    if format == "hf":
        hf.write_folder(out_dir, model.config, params, tokenizer)
        return
    if format == "keras":
        keras_preset.write_preset(families.by_config(model.config), model.config, params, out_dir, tokenizer)
        return
    import orbax.checkpoint as ocp
    family = families.by_config(model.config)
    storage.makedirs(out_dir)
    ckpt = storage.absolute(storage.join(out_dir, "params"))
    with checkpoint.checkpointer() as ckptr:  # collective: every host writes its shards
        ckptr.save(ckpt, args=ocp.args.StandardSave(params), force=True)
    if jax.process_index() != 0:  # the plain files once, from one host
        return
    config = model.config.to_dict()
    storage.write_text(storage.join(out_dir, FOLDER_META),
                       json.dumps({"family": family.name, "config": config, "format": 1}, indent=2))
    if tokenizer is not None:
        tokenizer.save(storage.join(out_dir, "tokenizer"))


def _read_gguf_params(path: str, config, shapes: dict, placement: Placement | None) -> dict:
    from jaxlm.convert import gguf
    with storage.local(path) as local_path:
        readers = gguf.tensor_readers(gguf.open_reader(local_path), config.num_heads,
                                      config.num_kv_heads, config.head_dim)
        if set(readers) != set(shapes):
            missing, extra = sorted(set(shapes) - set(readers)), sorted(set(readers) - set(shapes))
            raise UserError(f"{path} does not match its own metadata (missing {missing[:3]}, "
                            f"unexpected {extra[:3]}); the file is damaged or not a Gemma model")
        return place_streamed(  # each tensor is dequantised, placed and freed before the next
            shapes, lambda p: readers.pop(p)(), placement,
            lambda p, got, want: f"GGUF tensor for {p} has shape {got}, expected {want}")


def _restore_folder_params(path: str, shapes: dict, placement: Placement | None) -> dict:
    import orbax.checkpoint as ocp
    ckpt = storage.absolute(storage.join(path, "params"))
    if not storage.isdir(ckpt):
        raise UserError(f"{path} has no params/ checkpoint; convert the model again")
    if placement is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        placement = lambda p, shape: device  # noqa: E731
    target = unflatten({p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placement(p, s.shape))
                        for p, s in shapes.items()})
    try:
        with checkpoint.checkpointer() as ckptr:
            return ckptr.restore(ckpt, args=ocp.args.StandardRestore(target))
    except (ValueError, FileNotFoundError, OSError) as e:
        raise UserError(f"cannot restore {ckpt}: {str(e).splitlines()[0]}; "
                        "the folder is incomplete or from another config — convert again") from None
