"""The before/after evaluator: on simulated CPU devices it evaluates on one device, and what it
reports is what the training mesh would have generated."""
import jax
import jax.numpy as jnp
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
    given = params
    got, params = ours("after", model, params, adapters)
    # moved to one device and back, not copied: the tree given is gone, its values are not
    assert all(x.is_deleted() for x in jax.tree.leaves(given))
    assert jax.tree.map(lambda x: x.sharding, params) == jax.tree.map(lambda x: x.sharding, given)
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
    result, params = own("after", model, params, adapters)
    assert list(result["samples"].values()) == generate(
        model, params, tok, alone, max_length=n + 5, strip_prompt=True, adapters=adapters, mesh=mesh)
    # the parameters are back where they were, adapters untouched
    leaf = jax.tree.leaves(params)[0]
    assert len(leaf.sharding.device_set) == 8
    assert np.isfinite(np.asarray(leaf)).all()
    assert not any(x.is_deleted() for x in jax.tree.leaves(adapters))


def test_moved_holds_the_tree_once_plus_one_array():
    """`moved` deletes each array once its replacement exists: the live bytes never exceed the
    tree plus its largest array (a copy of the tree would hold it twice)."""
    from jaxlm.train.evaluate import moved
    mesh = sharding.make_mesh("1x8")
    put = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
    sizes = [64, 32, 16, 16]
    tree = {f"w{i}": jax.device_put(np.full((n, 1024), i, np.float32), put) for i, n in enumerate(sizes)}

    def mine():  # bytes of the distinct buffers behind these arrays (shard views share them)
        return sum({s.data.unsafe_buffer_pointer(): s.data.nbytes for x in jax.live_arrays()
                    if x.shape[1:] == (1024,) and not x.is_deleted()
                    for s in x.addressable_shards}.values())
    start, seen = mine(), []

    def one_device(x, _):
        y = jax.device_put(x, jax.devices()[0])
        seen.append(mine())
        return y
    out = moved(tree, one_device)
    assert max(seen) <= start + 64 * 1024 * 4 < 2 * start
    assert all(x.is_deleted() for x in tree.values())
    back = moved(out, lambda x, s: jax.device_put(x, s), jax.tree.map(lambda x: put, out))
    assert [float(back[k][0, 0]) for k in sorted(back)] == [0, 1, 2, 3]
    assert all(v.sharding == put for v in back.values()) and mine() == start
    # replicated: device_put keeps the one-device buffer as a shard, so it must not be deleted
    everywhere = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    spread = moved({"s": jnp.arange(3.0, device=jax.devices()[0])}, lambda x, s: jax.device_put(x, s),
                   {"s": everywhere})
    assert np.asarray(spread["s"]).tolist() == [0, 1, 2] and spread["s"].sharding == everywhere


def test_back_reuses_the_buffer_and_place_copies_each_shard():
    """Onto a sharding split on the first axis: a host block goes back as views of its own
    buffer (`_back`: the weights are not copied), and a host array is placed as copies of its
    slices (`jaxlm.tree.place`), not as views that keep a temporary host array alive."""
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxlm.train.evaluate import _back
    from jaxlm.tree import aligned_empty, place
    rows = NamedSharding(sharding.make_mesh("1x8"), P("model", None))
    host = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    placed = place(host, rows)
    start, end = host.ctypes.data, host.ctypes.data + host.nbytes
    assert not any(start <= s.data.unsafe_buffer_pointer() < end for s in placed.addressable_shards)
    block = aligned_empty(host.shape, host.dtype)
    block[...] = host
    base = block.ctypes.data
    back = _back(block, rows)
    del block  # the shards keep its buffer alive
    assert back.sharding == rows and [s.data.shape for s in back.addressable_shards] == [(8, 16)] * 8
    assert [s.data.unsafe_buffer_pointer() - base for s in back.addressable_shards] == [
        i * 8 * 16 * 4 for i in range(8)]
    np.testing.assert_array_equal(np.asarray(back), host)
    columns = NamedSharding(rows.mesh, P(None, "model"))  # not contiguous: copied
    np.testing.assert_array_equal(np.asarray(_back(host.copy(), columns)), host)


def test_one_device_per_process_stands_for_each_process_block():
    """The evaluation mesh takes one device per process where each process's devices form one
    block of the grid, and none where they interleave."""
    from types import SimpleNamespace
    from unittest import mock
    from jaxlm.train.evaluate import one_per_process

    def grid(owners):  # fake devices with these process indices, a mesh of their shape
        devs = np.array([[SimpleNamespace(id=10 * r + c, process_index=p, platform="cpu")
                          for c, p in enumerate(row)] for r, row in enumerate(owners)], dtype=object)
        return SimpleNamespace(devices=devs, axis_names=("batch", "model"))
    with mock.patch.object(jax, "process_count", return_value=2), \
            mock.patch("jaxlm.train.evaluate.Mesh", lambda d, names: d):
        one_by_eight = one_per_process(grid([[0, 0, 0, 0, 1, 1, 1, 1]]))
        assert [[d.id for d in row] for row in one_by_eight] == [[0, 4]]
        two_by_four = one_per_process(grid([[0, 0, 0, 0], [1, 1, 1, 1]]))
        assert [[d.id for d in row] for row in two_by_four] == [[0], [10]]
        assert one_per_process(grid([[0, 1, 0, 1, 0, 1, 0, 1]])) is None
    assert one_per_process(sharding.make_mesh("1x8")).devices.shape == (1, 1)


def test_to_host_writes_each_block_once_into_a_buffer_the_cpu_adopts():
    """A replicated array is written from one replica, not once per device, and the host
    buffer is aligned so that `jax.device_put` on CPU uses it in place."""
    from unittest import mock
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxlm.tree import place, to_host
    mesh = sharding.make_mesh("2x4")
    host = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    for spec, blocks in ((P(), 1), (P("model", None), 4), (P("batch", "model"), 8)):
        x = place(host, NamedSharding(mesh, spec))
        with mock.patch("numpy.asarray", wraps=np.asarray) as read:
            got = to_host(x)
        np.testing.assert_array_equal(got, host)
        assert read.call_count == blocks, (spec, read.call_count)
        assert jax.device_put(got, jax.devices()[0]).unsafe_buffer_pointer() == got.ctypes.data


def test_a_second_evaluation_finds_the_weights_where_the_first_left_them(monkeypatch):
    """A weight split on its first axis goes back as views of its one-device buffer, and the
    next evaluation uses that buffer as it is: the demo's 0.67 GB embedding is copied once, not
    at every evaluation. A weight replaced in between is copied, and the old one is not kept."""
    import gc
    from jax.sharding import NamedSharding, PartitionSpec as P
    from jaxlm.tree import place
    mesh = sharding.make_mesh("1x8")
    rows, columns = NamedSharding(mesh, P("model", None)), NamedSharding(mesh, P(None, "model"))
    want = {"r": np.arange(64 * 16, dtype=np.float32).reshape(64, 16), "c": np.ones((16, 64), np.float32)}
    params = {"r": place(want["r"], rows), "c": place(want["c"], columns)}
    ours = Evaluator(None, data.TEMPLATE, None, [], eval_examples=0, max_new_tokens=1, mesh=mesh)
    seen = []

    def evaluate(when, model, p, adapters):
        seen.append({k: v.unsafe_buffer_pointer() for k, v in p.items()})
        for k, v in p.items():
            np.testing.assert_array_equal(np.asarray(v), want[k])
        return {}
    monkeypatch.setattr(ours, "_evaluate", evaluate)
    _, params = ours("before", None, params)
    assert params["r"].addressable_shards[0].data.unsafe_buffer_pointer() == seen[0]["r"]
    _, params = ours("after", None, params)
    assert seen[1]["r"] == seen[0]["r"]  # found where it was left: not moved
    assert params["r"].sharding == rows and params["c"].sharding == columns
    (home,) = [ref for ref, *_ in ours._homes.values()]
    want["r"] = want["r"] + 1
    params["r"] = place(want["r"], rows)  # the training replaced it
    gc.collect()
    assert home() is None  # the evaluator kept nothing of the old weight
    _, params = ours("again", None, params)
    np.testing.assert_array_equal(np.asarray(params["r"]), want["r"])
