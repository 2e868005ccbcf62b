"""The before/after evaluator: on simulated CPU devices it evaluates on one device, and what it
reports is what the training mesh would have generated."""
import jax
import numpy as np

import jaxlm
import sharding
from jaxlm import data, lora
from jaxlm.train.evaluate import Evaluator, simulated


def test_a_simulated_mesh_evaluates_on_one_device_with_the_mesh_results():
    mesh = sharding.make_mesh("1x8")
    assert simulated(mesh) and not simulated(sharding.make_mesh("1x1", jax.devices()[:1]))
    assert not simulated(None)
    cfg = jaxlm.load("gemma_tiny", abstract=True)[0].config
    model, params = jaxlm.load("gemma_tiny", placement=sharding.placement(mesh, sharding.rules_for(cfg)))
    adapters = lora.init(params, 2, key=jax.random.key(1))
    adapters = jax.tree.map(lambda x: x + 0.05, adapters)  # B != 0, so the merge matters
    tok = jaxlm.load_tokenizer("gemma_tiny")
    train, held = data.builtin_dataset()
    kwargs = dict(eval_examples=6, max_new_tokens=5)
    ours = Evaluator(tok, data.TEMPLATE, held, held.instructions[:2], mesh=mesh, **kwargs)
    assert ours.one_device and ours.mesh is None
    got = ours("after", model, params, adapters)
    # The reference: generation on the 8-device mesh itself, as on real accelerators. The
    # samples are held-out prompts, so they come from the exact-match batch.
    from jaxlm.generate import generate
    prompts = ours.eval_prompts
    longest = max(len(tok.encode(p)) for p in prompts)
    want = generate(model, params, tok, prompts, max_length=longest + 5, strip_prompt=True,
                    adapters=adapters, mesh=mesh)
    assert list(got["samples"].values()) == want[:2]
    hits = sum(data.exact_match(o, a) for o, a in zip(want, held.outputs[:6]))
    assert got["exact_match"] == hits / 6
    assert generate(model, params, tok, prompts, max_length=longest + 5, strip_prompt=True,
                    mesh=mesh) != want  # the adapters change the generations, so they were merged
    # Samples that are not held-out prompts (--prompt) are generated on their own.
    own = Evaluator(tok, data.TEMPLATE, held, ["What is 2 + 2?"], mesh=mesh, **kwargs)
    alone = [data.prompt(data.TEMPLATE, "What is 2 + 2?")]
    n = len(tok.encode(alone[0]))
    assert list(own("after", model, params, adapters)["samples"].values()) == generate(
        model, params, tok, alone, max_length=n + 5, strip_prompt=True, adapters=adapters, mesh=mesh)
    # the evaluation's one-device copy is gone again: the parameters stay where they were
    leaf = jax.tree.leaves(params)[0]
    assert len(leaf.sharding.device_set) == 8
    assert np.isfinite(np.asarray(leaf)).all()
