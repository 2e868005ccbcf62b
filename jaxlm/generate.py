"""Text generation with KerasHub `GemmaCausalLM.generate()` semantics.

    texts = jaxlm.generate(model, params, tokenizer, ["What is JAX?", "Hi"], max_length=30)

- `max_length` counts BOS and the prompt (BOS + 4 prompt tokens with max_length=10 gives 5 new
  tokens); a prompt longer than that is an error (KerasHub silently truncates it).
- `stop_token_ids="auto"` stops a row at its first generated EOS; None never stops early; or a
  sequence of ids. Rows stop independently.
- The result is the prompt plus the completion (the completion alone with `strip_prompt=True`),
  detokenized from the ids with pad/BOS/EOS dropped, as KerasHub's `generate_postprocess`;
  a `str` prompt gives a `str`, a list gives a list.
- `seed`: keys the random samplers. One int keys the whole batch (as KerasHub: repeated prompts
  give different samples, and a row's draw depends on its place in the batch); a list with one
  int per prompt keys each row on its own, so a prompt draws what it draws alone with that seed.
- `adapters`: a LoRA adapter tree, merged into `params` once before decoding.
- `mesh`: a ("batch", "model") mesh; parameters not already on it are placed by the family's
  layout rules, prompts split on `batch` and the KV cache sharded to match.
- `stream(position, tokens)`: called after every step with each row's new token (-1 where a row
  emits nothing); see `jaxlm.decode` for its cost.

The token-level API underneath is `jaxlm.decode.generate_ids`.

Command line::

    python -m jaxlm.generate --model=PATH --prompt="..." [--prompt=...] [--prompts_file=F]
        [--max_length=64] [--sampler=greedy|random|temperature|top_k|top_p] [--seed=0 | --seed=S1,S2,...]
        [--strip_prompt]
"""
from __future__ import annotations

import sys

import jax
import numpy as np

from jaxlm import decode
from jaxlm.errors import ArgumentParser, UserError, cli


def generate(model, params, tokenizer, prompts, max_length: int = 64, sampler="greedy",
             seed: int | list[int] = 0, stop_token_ids="auto", strip_prompt: bool = False, *,
             adapters=None, mesh=None, stream=None):
    """prompts: str | list[str] -> str | list[str] (see the module docstring)."""
    single = isinstance(prompts, str)
    prompts = [prompts] if single else list(prompts)
    if not prompts:
        raise UserError("no prompts given; pass a string or a non-empty list of strings")
    bad = [i for i, p in enumerate(prompts) if not isinstance(p, str)]
    if bad:
        raise UserError(f"prompt {bad[0]} is a {type(prompts[bad[0]]).__name__}, not a string")
    if getattr(model.config, "family", None) != "gemma":
        raise UserError(f"generate needs a causal LM (Gemma); this model is "
                        f"{getattr(model.config, 'family', type(model).__name__)}")
    if int(max_length) < 1:
        raise UserError(f"max_length must be >= 1, got {max_length}")
    stop = _stop_ids(tokenizer, stop_token_ids)

    encoded = [tokenizer.encode(p) for p in prompts]  # BOS by the tokenizer's policy
    for i, ids in enumerate(encoded):
        if not ids:
            raise UserError(f"prompt {i} encodes to no tokens and the tokenizer adds no BOS")
        if len(ids) > max_length:
            raise UserError(f"prompt {i} is {len(ids)} tokens (BOS included) but max_length="
                            f"{max_length}; raise --max_length or shorten the prompt")
    lengths = np.array([len(ids) for ids in encoded], np.int32)
    token_ids = np.zeros((len(encoded), int(lengths.max())), np.int32)
    for row, ids in zip(token_ids, encoded):
        row[:len(ids)] = ids

    if adapters is not None:
        from jaxlm import lora
        params = lora.merge(params, adapters)  # once, outside the decode loop
    if mesh is not None:
        params = place(model, params, mesh)

    ids, mask = decode.generate_ids(model, params, token_ids, lengths, int(max_length), sampler,
                                    seed, stop, mesh=mesh, stream=stream)
    texts = []
    for row, row_mask, n in zip(ids, mask, lengths):
        kept = row[row_mask]
        texts.append(tokenizer.decode(kept[n:] if strip_prompt else kept))
    return texts[0] if single else texts


def _stop_ids(tokenizer, stop_token_ids) -> tuple[int, ...]:
    if stop_token_ids is None:
        return ()
    if isinstance(stop_token_ids, str):
        if stop_token_ids != "auto":
            raise UserError(f"stop_token_ids must be 'auto', None or a sequence of ids; "
                            f"got {stop_token_ids!r}")
        return (tokenizer.eos_id,)
    try:
        return tuple(int(i) for i in stop_token_ids)
    except (TypeError, ValueError):
        raise UserError(f"stop_token_ids must be 'auto', None or a sequence of ids; "
                        f"got {stop_token_ids!r}") from None


def place(model, params, mesh):
    """Parameters onto `mesh` by the family's default layout rules. Leaves already on `mesh`
    are kept under whatever table placed them (the decoder takes any): re-placing weights
    trained under `--layout=seed` copied each one for every evaluation."""
    import sharding
    from jaxlm.tree import flatten, unflatten
    targets = flatten(sharding.named_shardings(params, sharding.rules_for(model.config), mesh))
    out = {}
    for path, x in flatten(params).items():
        there = isinstance(x, jax.Array) and getattr(x.sharding, "mesh", None) == mesh
        out[path] = x if there else jax.device_put(x, targets[path])
    return unflatten(out)


def _seed_arg(text: str):
    """--seed=7 -> 7; --seed=7,3,11 -> [7, 3, 11] (one per prompt)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise UserError(f"--seed must be an int or comma-separated ints (one per prompt); "
                        f"got {text!r}") from None
    return values if "," in text else values[0]


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as e:
            raise UserError(f"cannot read --prompts_file {args.prompts_file}: {e.strerror}") from None
    if not prompts:
        raise UserError("no prompts given; pass --prompt=TEXT (repeatable) or --prompts_file=FILE")
    return prompts


@cli
def main(argv=None) -> None:
    parser = ArgumentParser(prog="python -m jaxlm.generate",
                            description="Generate text with a Gemma model.")
    parser.add_argument("--model", required=True,
                        help="Keras preset folder, jaxlm folder or built-in preset name")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    parser.add_argument("--prompts_file", help="a text file with one prompt per line")
    parser.add_argument("--max_length", type=int, default=64,
                        help="total length, BOS and prompt included (KerasHub semantics)")
    parser.add_argument("--sampler", default="greedy",
                        help="greedy | random | temperature | top_k | top_p")
    parser.add_argument("--seed", default="0",
                        help="an int for the batch, or one per prompt (comma-separated)")
    parser.add_argument("--strip_prompt", action="store_true", help="print the completion only")
    parser.add_argument("--no_stop", action="store_true", help="do not stop at EOS")
    parser.add_argument("--compile_cache", help="folder where XLA's compiled programs are kept "
                        "for the next run (default $JAXLM_COMPILE_CACHE, else ~/.cache/jaxlm/xla; "
                        "empty: off)")
    args = parser.parse_args(argv)

    from jaxlm.loading import load, load_tokenizer
    from jaxlm import compile_cache, machine, sampling
    machine.quiet_without_tpu()
    compile_cache.enable(args.compile_cache)
    prompts = _read_prompts(args)
    sampler = sampling.resolve(args.sampler)  # fail before loading a big model
    seed = _seed_arg(args.seed)
    model, params = load(args.model)
    tokenizer = load_tokenizer(args.model)
    texts = generate(model, params, tokenizer, prompts, args.max_length, sampler, seed,
                     None if args.no_stop else "auto", args.strip_prompt)
    for text in texts:
        print(text)
        sys.stdout.flush()


if __name__ == "__main__":
    from jaxlm.hugepages import restart_with_huge_pages
    restart_with_huge_pages()  # on Linux, once; the package did already when started with -m
    main()
