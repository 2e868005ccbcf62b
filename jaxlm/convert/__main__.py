"""python -m jaxlm.convert MODEL OUT_DIR              -> jaxlm folder (orbax)
   python -m jaxlm.convert MODEL OUT_DIR --to=hf      -> Hugging Face folder (safetensors)
   python -m jaxlm.convert MODEL OUT_DIR --to=keras   -> Keras preset (also --to-keras)

MODEL may be anything `jaxlm.load` accepts: a Keras preset, a Hugging Face folder, a jaxlm
folder, a .gguf file or a built-in preset name. OUT_DIR must be new or empty (pass --overwrite
to replace a previous conversion): a conversion never clobbers a folder it did not write.
"""
from __future__ import annotations

import argparse
import sys

from jaxlm import machine, precision, storage
from jaxlm.errors import ArgumentParser, UserError, cli


def parse(argv):
    p = ArgumentParser(prog="python -m jaxlm.convert", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="Keras preset, HF folder, jaxlm folder, .gguf or built-in preset name")
    p.add_argument("out_dir")
    p.add_argument("--to", default=None, help="output format: jaxlm (default), hf or keras")
    p.add_argument("--to-keras", action="store_true", help="same as --to=keras")
    p.add_argument("--weights", help="a fine-tuned .weights.h5 (Keras save_weights) to apply on the preset")
    p.add_argument("--dtype", default=None, help="parameter dtype to store (default: float32 on CPU)")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty OUT_DIR")
    return p.parse_args(argv)


@cli
def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    machine.quiet_without_tpu()
    storage.check_output_folder(args.out_dir, "OUT_DIR")
    if storage.listdir(args.out_dir) and not args.overwrite:
        raise UserError(f"{args.out_dir} is not empty; choose a new folder or pass --overwrite")
    if args.to_keras and args.to not in (None, "keras"):
        raise UserError(f"--to-keras contradicts --to={args.to}; pass one of them")
    to = "keras" if args.to_keras else args.to or "jaxlm"
    import jaxlm
    from jaxlm.convert import hf
    from jaxlm.loading import SAVE_FORMATS
    if to not in SAVE_FORMATS:
        raise UserError(f"--to={to}: choose one of {', '.join(SAVE_FORMATS)}")
    dtype = precision.check_dtype(args.dtype, "--dtype")  # before a model loads

    model, params = jaxlm.load(args.source, dtype=dtype, weights=args.weights)
    tokenizer = _tokenizer_or_none(args.source)
    jaxlm.save(args.out_dir, model, params, tokenizer, format=to)
    n = sum(x.size for x in __import__("jax").tree.leaves(params))
    kind = {"keras": "Keras preset", "hf": "Hugging Face folder", "jaxlm": "jaxlm folder"}[to]
    print(f"wrote {kind} {args.out_dir} ({type(model).__name__}, {n:,} parameters)")
    if to == "hf":
        print("load it with:\n    " + "\n    ".join(hf.usage(args.out_dir, model.config)))


def _tokenizer_or_none(source):
    from jaxlm.loading import load_tokenizer
    try:
        return load_tokenizer(source)
    except UserError as e:
        print(f"warning: no tokenizer written ({e})", file=sys.stderr)
        return None


if __name__ == "__main__":
    sys.exit(main())
