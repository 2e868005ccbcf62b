"""Does a finished run's PEFT export answer like the run itself? transformers + peft vs jaxlm.

    python bench/peft_check.py runs/default            # after `python train.py ...`

Loads `RUN/base_hf` (or the HF preset the run started from) with transformers, attaches
`RUN/adapters_peft` with peft, and greedy-decodes the run's held-out instructions (the
built-in dataset's, as `train.py` evaluates them) next to `jaxlm.generate` with the run's own
`RUN/adapters` (rank, alpha and targets read from the folder). It compares the completions
token by token and the exact-match count against RUN/eval_after.json. Ends with
    BENCH peft_check same=<n>/<total> exact_match_hf=<x> exact_match_jaxlm=<x> eval_after=<x>
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jaxlm  # noqa: E402
from jaxlm import data  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="the --out folder of a finished train.py run (built-in data)")
    p.add_argument("--max_new_tokens", type=int, default=12)
    p.add_argument("--examples", type=int, default=40)
    a = p.parse_args(argv)
    import torch
    import transformers
    import peft

    config = json.load(open(os.path.join(a.run, "adapters_peft", "adapter_config.json")))
    base = config["base_model_name_or_path"]
    adapters = jaxlm.lora.load(os.path.join(a.run, "adapters"))
    model, params = jaxlm.load(base, "float32")
    tok = jaxlm.load_tokenizer(base)
    _, held = data.builtin_dataset()
    prompts = [data.prompt(data.TEMPLATE, i) for i in held.instructions[:a.examples]]
    answers = held.outputs[:a.examples]

    longest = max(len(tok.encode(x)) for x in prompts)
    ours = jaxlm.generate(model, params, tok, prompts, max_length=longest + a.max_new_tokens,
                          strip_prompt=True, adapters=adapters)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    hf = peft.PeftModel.from_pretrained(hf, os.path.join(a.run, "adapters_peft")).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(base)
    theirs = []
    for prompt in prompts:
        ids = hf_tok(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=a.max_new_tokens, do_sample=False,
                              eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        theirs.append(hf_tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    same = sum(x == y for x, y in zip(ours, theirs))
    for prompt, x, y in zip(prompts, ours, theirs):
        if x != y:
            print(f"differ: {prompt!r}\n  jaxlm: {x!r}\n  hf:    {y!r}")
    em = lambda outs: sum(data.exact_match(o, t) for o, t in zip(outs, answers)) / len(answers)  # noqa: E731
    after = json.load(open(os.path.join(a.run, "eval_after.json"))).get("exact_match")
    print(f"{same}/{len(prompts)} completions identical; exact match jaxlm {em(ours):.3f}, "
          f"transformers+peft {em(theirs):.3f}, the run's eval_after.json {after}")
    print(f"BENCH peft_check same={same}/{len(prompts)} exact_match_hf={em(theirs):.3f} "
          f"exact_match_jaxlm={em(ours):.3f} eval_after={after}")
    return 0 if same == len(prompts) else 1


if __name__ == "__main__":
    sys.exit(main())
