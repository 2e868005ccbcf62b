"""Before/after evaluation of a fine-tune: sample generations and held-out exact match.

    evaluator = Evaluator(tokenizer, template, held, sample_instructions, eval_examples=40,
                          max_new_tokens=12, mesh=mesh)
    result, params = evaluator("after", model, params, adapters)  # {"samples": {...}, "exact_match": f}

Generation is `jaxlm.generate` with KerasHub semantics, greedy, on the training mesh. The
adapters (a `jaxlm.lora.Adapters`) are merged with their own alpha, so what is evaluated is
what was trained; exact match compares the completion's first line with the answer.

A mesh of simulated CPU devices (`--mesh=1x8` on a machine without an accelerator) is the
exception: there the evaluation runs on one device. Under the seed's layout the activations are
replicated over the model axis, so each simulated device repeats the attention and every
elementwise op, on the same few cores: 40 greedy prompts of the demo's Gemma 3 270M took 55 s
on the 8 simulated devices and 8 s on one (`python bench/real_step_ab.py --what=generate`).
The numbers are the same computation; only the order of the sharded sums differs. The weights
are moved there and back (`moved`), not copied: all 8 simulated devices live in this process's
memory, and a copy held the demo's 1.07 GB of weights twice for the evaluation. A weight split
on its first axis goes back as views of its one-device buffer, so the next evaluation finds it
there whole and moves nothing.
"""
from __future__ import annotations

import weakref

import jax
import numpy as np

from jaxlm import data, machine
from jaxlm.tree import to_host
from jaxlm.generate import generate


def simulated(mesh) -> bool:
    """Whether `mesh` is several CPU devices of this one process (XLA's simulated host devices)."""
    return (mesh is not None and mesh.devices.size > 1 and jax.process_count() == 1
            and all(d.platform == "cpu" for d in mesh.devices.flat))


def _on_one_device(x):
    """A copy of sharded array `x` on this process's first device, one array at a time:
    `jax.device_put` of the whole tree went through each array's cached host value, which then
    stayed (2.0 GB more for Gemma 3 270M's 1.07 GB)."""
    return jax.device_put(to_host(x), jax.local_devices()[0]).block_until_ready()


def moved(tree, put, to=None):
    """`tree` with each array x replaced by put(x, t) (t: the matching leaf of `to`, else None),
    x deleted as soon as its replacement exists: the tree is held once plus its largest array,
    not twice. (A copy of the demo's Gemma 3 270M for its evaluation raised the peak by the
    whole 1.07 GB.) Pass the only reference to `tree` (an array over a host buffer, as
    `_on_one_device` makes, frees it when its last reference goes, not on `delete`). An x whose
    buffer the replacement kept is left to it: `jax.device_put` of a one-device array to a
    replicated sharding keeps it as the shard on that device."""
    targets = jax.tree.leaves(to) if to is not None else None
    leaves, treedef = jax.tree.flatten(tree)
    del tree
    out = []
    for i in range(len(leaves)):
        x, leaves[i] = leaves[i], None
        y = put(x, targets[i] if targets is not None else None)
        if not x.is_deleted() and not _shares_a_buffer(x, y):
            x.delete()
        del x
        out.append(y)
    return jax.tree.unflatten(treedef, out)


def _shares_a_buffer(x, y) -> bool:
    theirs = {s.data.unsafe_buffer_pointer() for s in y.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in theirs for s in x.addressable_shards)


def _back(host, sharding):
    """Host array `host` (the buffer of a one-device array) onto `sharding`, one shard at a
    time, each a view of `host` where XLA:CPU adopts it as it is (a block of rows: a split on
    the first axis), so the demo's 0.67 GB embedding goes back without a copy, its shards
    keeping the buffer alive (slicing the one-device array raised the peak by a shard at a
    time, and `jax.device_put` of the whole of it by 1.1 GB). Other splits copy their shards."""
    shards = [jax.device_put(host[index], device).block_until_ready()
              for device, index in sharding.addressable_devices_indices_map(host.shape).items()]
    return jax.make_array_from_single_device_arrays(host.shape, sharding, shards)


def _views_of(x, host) -> bool:
    """Whether every shard of `x` is the matching block of `host`'s own memory."""
    return x.shape == host.shape and x.dtype == host.dtype and all(
        s.data.unsafe_buffer_pointer() == host[s.index].ctypes.data for s in x.addressable_shards)


class Evaluator:
    """Generations for fixed prompts and exact match on held-out examples."""

    def __init__(self, tokenizer, template: str, held: data.Records | None,
                 sample_instructions, *, eval_examples: int, max_new_tokens: int, mesh=None):
        """held: held-out Records for exact match (None: none). sample_instructions: the
        instructions whose generations are printed before and after."""
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        self.one_device = simulated(mesh)  # see the module docstring
        self.mesh = None if self.one_device else mesh
        # The weights that went back as views (`_back`): shard 0's address -> (a weak reference
        # to `to_host`'s bytes, the weight's offset, shape and dtype in them). Weak, so that
        # weights the training replaced are not kept alive here.
        self._homes: dict[int, tuple] = {}
        n = min(eval_examples, len(held)) if held is not None else 0
        self.eval_prompts = [data.prompt(template, i) for i in held.instructions[:n]] if n else []
        self.answers = held.outputs[:n] if n else []
        self.sample_prompts = [data.prompt(template, i) for i in sample_instructions]

    def _run(self, model, params, adapters, prompts):
        longest = max(len(self.tokenizer.encode(p)) for p in prompts)
        return generate(model, params, self.tokenizer, prompts,
                        max_length=longest + self.max_new_tokens, strip_prompt=True,
                        adapters=adapters, mesh=self.mesh)

    def __call__(self, when: str, model, params, adapters=None) -> tuple[dict, dict]:
        """-> (result, params). On a simulated mesh `params` are moved to one device for the
        evaluation and back to their shardings, each array deleted once its copy exists (see
        `moved`): use the returned tree, the one given is gone. The adapters are copied."""
        if not self.one_device:
            return self._evaluate(when, model, params, adapters), params
        where = jax.tree.map(lambda x: x.sharding, params)
        hosts = {}  # id of each one-device array -> its host buffer

        def there(x, _):
            host = self._home(x)
            if host is None:  # a copy, x freed shard by shard as it is made
                host = to_host(x, consume=True)
            y = jax.device_put(host, jax.local_devices()[0]).block_until_ready()
            hosts[id(y)] = host
            return y

        def back(y, sharding):
            host = hosts.pop(id(y))
            x = _back(host, sharding)
            owner = host.base  # `to_host`'s raw bytes
            if _views_of(x, host) and owner is not None and owner.dtype == np.uint8:
                self._homes[x.addressable_shards[0].data.unsafe_buffer_pointer()] = (
                    weakref.ref(owner), host.ctypes.data - owner.ctypes.data, host.shape, host.dtype)
            return x
        here = [moved(params, there)]  # the one reference (see `moved`)
        del params
        self._homes.clear()  # what was worth finding has been found
        result = self._evaluate(when, model, here[0], jax.tree.map(_on_one_device, adapters))
        params = moved(here.pop(), back, where)
        machine.return_freed_memory()
        return result, params

    def _home(self, x):
        """The host buffer whose views `x`'s shards still are, if `_back` made them."""
        home = self._homes.get(x.addressable_shards[0].data.unsafe_buffer_pointer())
        raw = home[0]() if home else None
        if raw is None:
            return None
        _, start, shape, dtype = home
        host = raw[start:start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        return host if _views_of(x, host) else None

    def _evaluate(self, when: str, model, params, adapters) -> dict:
        result = {}
        # The default samples are the first held-out prompts: their completions come from the
        # exact-match batch (same batch, same max_length), one generate call instead of two.
        shared = bool(self.eval_prompts) and set(self.sample_prompts) <= set(self.eval_prompts)
        outs = self._run(model, params, adapters, self.eval_prompts) if self.eval_prompts else []
        if self.sample_prompts:
            samples = (dict(zip(self.eval_prompts, outs)) if shared else
                       dict(zip(self.sample_prompts,
                                self._run(model, params, adapters, self.sample_prompts))))
            for p in self.sample_prompts:
                print(f"[{when}] {p!r} -> {samples[p]!r}")
            result["samples"] = {p: samples[p] for p in self.sample_prompts}
        if self.eval_prompts:
            hits = sum(data.exact_match(o, ans) for o, ans in zip(outs, self.answers))
            result["exact_match"] = hits / len(self.answers)
            print(f"[{when}] exact match on {len(self.answers)} held-out examples: "
                  f"{hits}/{len(self.answers)} ({result['exact_match']:.1%})")
        return result


def sample_instructions(prompts, held, train_instructions, num_samples: int) -> list[str]:
    """--prompt values if given; else the first held-out instructions (with a user's file,
    its first training instructions)."""
    if prompts:
        return list(prompts)
    return list((held.instructions if held is not None else train_instructions)[:num_samples])
