"""Before/after evaluation of a fine-tune: sample generations and held-out exact match.

    evaluator = Evaluator(tokenizer, template, held, sample_instructions, eval_examples=40,
                          max_new_tokens=12, mesh=mesh)
    result, params = evaluator("after", model, params, adapters)  # {"samples": {...}, "exact_match": f}

Generation is `jaxlm.generate` with KerasHub semantics, greedy, on the training mesh. The
adapters (a `jaxlm.lora.Adapters`) are merged with their own alpha, so what is evaluated is
what was trained; exact match compares the completion's first line with the answer.

A mesh of simulated CPU devices (`--mesh=1x8` on a machine without an accelerator) is the
exception: there the evaluation runs on one device per process. Under the seed's layout the
activations are replicated over the model axis, so each simulated device repeats the attention
and every elementwise op, on the same few cores: 40 greedy prompts of the demo's Gemma 3 270M
took 55 s on the 8 simulated devices and 8 s on one (`python bench/real_step_ab.py
--what=generate`), and across processes each device held its own KV cache. The numbers are the
same computation; only the order of the sharded sums differs. Each process's shards of a weight
are moved into one buffer on its device and back (`moved`), not copied: the simulated devices
live in the process's memory, and a copy held the demo's 1.07 GB of weights twice for the
evaluation. A weight split on its first axis goes back as views of that buffer, so the next
evaluation finds it there and moves nothing.
"""
from __future__ import annotations

import weakref

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding

from jaxlm import data, machine
from jaxlm.tree import to_host, within
from jaxlm.generate import generate


def simulated(mesh) -> bool:
    """Whether `mesh` puts several CPU devices in a process (XLA's simulated host devices)."""
    return (mesh is not None and mesh.devices.size > jax.process_count()
            and all(d.platform == "cpu" for d in mesh.devices.flat))


def one_per_process(mesh: Mesh) -> Mesh | None:
    """The mesh of one device per process standing for `mesh`: each process's devices form one
    block of `mesh`'s grid, which becomes its first device, so a weight's block there is the
    union of the process's shards of it. None where the processes' devices form no such blocks."""
    grid = mesh.devices
    owner = np.vectorize(lambda d: d.process_index)(grid)
    rows, cols = grid.shape
    n = grid.size // jax.process_count()
    for sb in (d for d in range(1, rows + 1) if rows % d == 0 and n % d == 0):
        sm = n // sb
        if cols % sm:
            continue
        blocks = owner.reshape(rows // sb, sb, cols // sm, sm)
        if (blocks == blocks[:, :1, :, :1]).all():
            return Mesh(grid[::sb, ::sm], mesh.axis_names)
    return None


def moved(tree, put, to=None):
    """`tree` with each array x replaced by put(x, t) (t: the matching leaf of `to`, else None),
    x deleted as soon as its replacement exists: the tree is held once plus its largest array,
    not twice. (A copy of the demo's Gemma 3 270M for its evaluation raised the peak by the
    whole 1.07 GB.) Pass the only reference to `tree` (an array over a host buffer, as the
    evaluator makes, frees it when its last reference goes, not on `delete`). An x whose
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


def _block(sharding, shape) -> tuple:
    """(device, start, shape) of this process's one block of an array under `sharding`."""
    ((device, index),) = sharding.addressable_devices_indices_map(shape).items()
    bounds = [i.indices(n)[:2] for i, n in zip(index, shape)]
    return device, tuple(a for a, _ in bounds), tuple(b - a for a, b in bounds)


def _back(host, sharding, shape=None, start=None):
    """Host block `host` of an array of `shape` (default: all of it), at `start`, onto this
    process's devices under `sharding`, one shard at a time, each a view of `host` where XLA:CPU
    adopts it as it is (a block of rows: a split on the first axis). So the demo's 0.67 GB
    embedding goes back without a copy, its shards keeping the buffer alive (slicing a
    one-device array raised the peak by a shard at a time, and `jax.device_put` of the whole
    of it by 1.1 GB). Other splits copy their shards."""
    shape, start = shape or host.shape, start or (0,) * host.ndim
    shards = [jax.device_put(host[within(index, start)], device).block_until_ready()
              for device, index in sharding.addressable_devices_indices_map(shape).items()]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _views_of(x, host, start) -> bool:
    """Whether each of this process's shards of `x` is the matching part of `host`'s memory."""
    return x.dtype == host.dtype and all(
        s.data.unsafe_buffer_pointer() == host[within(s.index, start)].ctypes.data
        for s in x.addressable_shards)


class Evaluator:
    """Generations for fixed prompts and exact match on held-out examples."""

    def __init__(self, tokenizer, template: str, held: data.Records | None,
                 sample_instructions, *, eval_examples: int, max_new_tokens: int, mesh=None):
        """held: held-out Records for exact match (None: none). sample_instructions: the
        instructions whose generations are printed before and after."""
        self.tokenizer, self.max_new_tokens = tokenizer, max_new_tokens
        small = one_per_process(mesh) if simulated(mesh) else None  # see the module docstring
        self.one_device = small is not None
        if not self.one_device:
            self.mesh = mesh
        else:  # one process evaluates without a mesh, several on one device each
            self.mesh = small if jax.process_count() > 1 else None
        # The weights that went back as views (`_back`): shard 0's address -> (a weak reference
        # to `to_host`'s aligned bytes, the block's offset, shape and dtype in them). Weak, so
        # that weights the training replaced are not kept alive here.
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

    def _target(self, x):
        """Where `x` is evaluated: this process's first device, or its device of `self.mesh`."""
        if self.mesh is None:
            return SingleDeviceSharding(jax.local_devices()[0])
        return NamedSharding(self.mesh, x.sharding.spec)

    def __call__(self, when: str, model, params, adapters=None) -> tuple[dict, dict]:
        """-> (result, params). On simulated devices `params` are moved to one device per
        process for the evaluation and back to their shardings, each array deleted once its
        copy exists (see `moved`): use the returned tree, the one given is gone. The adapters
        are copied."""
        if not self.one_device:
            return self._evaluate(when, model, params, adapters), params
        where = jax.tree.map(lambda x: x.sharding, params)
        hosts = {}  # id of each evaluated array -> (its host block, the block's start)

        def there(x, consume=True):
            target = self._target(x)
            device, start, shape = _block(target, x.shape)
            host = self._home(x, start, shape)
            if host is None:  # a copy, x freed shard by shard as it is made
                host = to_host(x, start, shape, consume)
            y = jax.make_array_from_single_device_arrays(
                x.shape, target, [jax.device_put(host, device).block_until_ready()])
            hosts[id(y)] = host, start
            return y

        def back(y, sharding):
            host, start = hosts.pop(id(y))
            x = _back(host, sharding, y.shape, start)
            owner = host.base  # `to_host`'s aligned raw bytes
            if _views_of(x, host, start) and owner is not None and owner.dtype == np.uint8:
                self._homes[x.addressable_shards[0].data.unsafe_buffer_pointer()] = (
                    weakref.ref(owner), host.ctypes.data - owner.ctypes.data, host.shape,
                    host.dtype, start)
            return x
        here = [moved(params, lambda x, _: there(x))]  # the one reference (see `moved`)
        del params
        self._homes.clear()  # what was worth finding has been found
        copies = jax.tree.map(lambda a: there(a, consume=False), adapters)
        result = self._evaluate(when, model, here[0], copies)
        del copies
        params = moved(here.pop(), back, where)
        machine.return_freed_memory()
        return result, params

    def _home(self, x, start, shape):
        """The host block whose views `x`'s shards still are, if `_back` made them."""
        home = self._homes.get(x.addressable_shards[0].data.unsafe_buffer_pointer())
        raw = home[0]() if home else None
        if raw is None or home[2] != shape or home[4] != start:
            return None
        _, offset, shape, dtype, _ = home
        host = raw[offset:offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        return host if _views_of(x, host, start) else None

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
