"""python -m jaxlm.convert KERAS_PRESET OUT_DIR           Keras preset -> jaxlm folder (orbax)
   python -m jaxlm.convert --to-keras MODEL OUT_DIR       jaxlm folder / preset -> Keras preset

MODEL may be anything `jaxlm.load` accepts. OUT_DIR must be new or empty (pass --overwrite to
replace a previous conversion): a conversion never clobbers a folder it did not write.
"""
from __future__ import annotations

import argparse
import os
import sys

from jaxlm.errors import UserError, cli


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxlm.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="Keras preset folder, jaxlm folder or built-in preset name")
    p.add_argument("out_dir")
    p.add_argument("--to-keras", action="store_true", help="write a Keras preset instead of a jaxlm folder")
    p.add_argument("--weights", help="a fine-tuned .weights.h5 (Keras save_weights) to apply on the preset")
    p.add_argument("--dtype", default=None, help="parameter dtype to store (default: float32 on CPU)")
    p.add_argument("--overwrite", action="store_true", help="allow a non-empty OUT_DIR")
    return p.parse_args(argv)


@cli
def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if os.path.isdir(args.out_dir) and os.listdir(args.out_dir) and not args.overwrite:
        raise UserError(f"{args.out_dir} is not empty; choose a new folder or pass --overwrite")
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        raise UserError(f"{args.out_dir} is a file; pass a folder")
    import jaxlm
    from jaxlm import families
    from jaxlm.convert import keras_preset

    model, params = jaxlm.load(args.source, dtype=args.dtype, weights=args.weights)
    tokenizer = _tokenizer_or_none(args.source)
    if args.to_keras:
        keras_preset.write_preset(families.by_config(model.config), model.config, params,
                                  args.out_dir, tokenizer)
    else:
        jaxlm.save(args.out_dir, model, params, tokenizer)
    n = sum(x.size for x in __import__("jax").tree.leaves(params))
    kind = "Keras preset" if args.to_keras else "jaxlm folder"
    print(f"wrote {kind} {args.out_dir} ({type(model).__name__}, {n:,} parameters)")


def _tokenizer_or_none(source):
    from jaxlm.tokenizer import load_tokenizer
    try:
        return load_tokenizer(source)
    except UserError as e:
        print(f"warning: no tokenizer written ({e})", file=sys.stderr)
        return None


if __name__ == "__main__":
    main()
