"""Apply a rule table to a parameter tree: specs, shardings, per-tensor placement, a listing.

Parameter trees are nested dicts of arrays or `jax.ShapeDtypeStruct`s keyed by path strings
("decoder_block_0/attention/query/kernel"). The checks here make a wrong table fail at once,
before anything is allocated:
  - a path that no rule matches, a spec whose rank differs from the tensor's, a mesh axis the
    mesh lacks, and a rule (other than a final `P()` catch-all) that matches nothing are errors;
  - a dimension that does not divide its mesh axis (Gemma 2B's single KV head over 8 devices)
    is kept whole instead, reported in one warning line per call (KerasHub fails there).

LoRA adapters live in their own tree (`jaxlm.lora`); `adapter_specs` gives each factor its
kernel's layout: `lora_a` [..., r] keeps kernel_spec[:-1] and replicates r, `lora_b` [r, out]
keeps kernel_spec[-1]. Every tree returned here has the structure of the tree passed in (jax
key paths, not a rebuilt dict), so specs of an adapter tree line up with it in `jit` and
`device_put` whatever dict-like pytree it is.
"""
from __future__ import annotations

import logging
import math
import re

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

log = logging.getLogger("sharding")


def _path(keypath) -> str:
    """A jax key path -> "a/b/kernel" (dict keys joined by "/")."""
    return jax.tree_util.keystr(keypath, simple=True, separator="/")


def _leaves(tree) -> dict:
    """{path: leaf} in the tree's own order (dicts and dict-like pytrees such as LoRA adapters)."""
    return {_path(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _like(tree, by_path: dict):
    """`tree` with each leaf replaced by by_path[its path]: the same pytree structure (node
    types and their static data included), so the result lines up with `tree` in jit/device_put."""
    return jax.tree_util.tree_map_with_path(lambda kp, _: by_path[_path(kp)], tree)


def _compile(rules) -> list:
    compiled = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[1], P)):
            raise ValueError(f"layout rule {rule!r} is not a (regex, PartitionSpec) pair")
        try:
            compiled.append((re.compile(rule[0]), rule[1]))
        except re.error as e:
            raise ValueError(f"layout rule {rule[0]!r} is not a valid regex ({e})") from None
    return compiled


def _match(path: str, compiled: list) -> int:
    for i, (regex, _) in enumerate(compiled):
        if regex.fullmatch(path):
            return i
    raise ValueError(f"no layout rule matches {path!r}; end the table with ('.*', P()) "
                     "to replicate the rest")


def _entries(spec: P, shape: tuple, path: str, pattern: str) -> list:
    """Spec -> one entry per tensor dim; `P()` means replicated at any rank."""
    if len(spec) == 0:
        return [None] * len(shape)
    if len(spec) != len(shape):
        raise ValueError(f"layout rule {pattern!r} gives {spec} (rank {len(spec)}) to {path} of "
                         f"shape {tuple(shape)} (rank {len(shape)}); give one entry per dim")
    return list(spec)


def _fit(entries: list, shape: tuple, mesh, path: str, dropped: list) -> list:
    """Check axis names against the mesh; keep whole (None) each dim its axis does not divide."""
    if mesh is None:
        return entries
    seen = set()
    for i, (axis, n) in enumerate(zip(entries, shape)):
        if axis is None:
            continue
        names = axis if isinstance(axis, tuple) else (axis,)
        for a in names:
            if a not in mesh.shape:
                raise ValueError(f"spec for {path} names mesh axis {a!r} but the mesh has axes "
                                 f"{tuple(mesh.axis_names)}; use those names")
            if a in seen:
                raise ValueError(f"spec for {path} uses mesh axis {a!r} twice; one dim per axis")
            seen.add(a)
        size = math.prod(mesh.shape[a] for a in names)
        if n % size:
            entries[i] = None
            dropped.append((path, i, n, axis, size))
    return entries


def _spec(entries: list) -> P:
    return P() if all(e is None for e in entries) else P(*entries)


def _warn(dropped: list, what: str = "", suffix: str = "") -> None:
    """One line for the whole call; layer indices folded so 18 blocks read as one entry."""
    groups: dict = {}
    for path, i, n, axis, size in dropped:
        key = (re.sub(r"_\d+(?=/)", "_*", path), i, n, axis, size)
        groups[key] = groups.get(key, 0) + 1
    items = [f"{p} dim {i} ({n}) over {a!r} ({s})" + (f" x{c}" if c > 1 else "")
             for (p, i, n, a, s), c in groups.items()]
    more = f"; and {len(items) - 4} more" if len(items) > 4 else ""
    log.warning("sharding: kept whole (replicated) %sdims that do not divide their mesh axis: "
                "%s%s%s", what, "; ".join(items[:4]), more, suffix)


def partition_specs(params: dict, rules, mesh=None) -> dict:
    """-> tree of PartitionSpec mirroring `params` (arrays or ShapeDtypeStructs).

    With `mesh`, axis names are checked and non-dividing dims replicated (one warning line).
    """
    compiled = _compile(rules)
    flat = _leaves(params)
    used = [False] * len(compiled)
    out, dropped = {}, []
    for path, leaf in flat.items():
        shape = tuple(leaf.shape)
        i = _match(path, compiled)
        used[i] = True
        entries = _entries(compiled[i][1], shape, path, compiled[i][0].pattern)
        out[path] = _spec(_fit(entries, shape, mesh, path, dropped))
    for i, (regex, spec) in enumerate(compiled):
        catch_all = i == len(compiled) - 1 and len(spec) == 0
        if not used[i] and not catch_all:
            example = next(iter(flat), "<empty tree>")
            raise ValueError(f"layout rule {regex.pattern!r} matches no parameter (paths look "
                             f"like {example!r}); fix the regex or remove the rule")
    if dropped:
        _warn(dropped)
    return _like(params, out)


def adapter_specs(adapters: dict, param_specs: dict, mesh=None) -> dict:
    """LoRA factors follow their kernel: `P/lora_a` <- spec(P/kernel)[:-1] + (None,),
    `P/lora_b` <- (None, spec(P/kernel)[-1]); with `mesh`, non-dividing dims are replicated.

    param_specs: `partition_specs(params, rules, mesh)` of the model the adapters belong to.
    """
    specs = _leaves(param_specs)
    out, dropped = {}, []
    for path, leaf in _leaves(adapters).items():
        parent, _, name = path.rpartition("/")
        if name not in ("lora_a", "lora_b"):
            raise ValueError(f"{path} is not a LoRA factor (lora_a or lora_b); pass the tree "
                             "from jaxlm.lora.init")
        kernel = specs.get(f"{parent}/kernel")
        if kernel is None:
            raise ValueError(f"no spec for {parent}/kernel, the kernel of adapter {path}; pass "
                             "partition_specs(params, ...) of the model the adapters belong to")
        shape = tuple(leaf.shape)
        last = kernel[-1] if len(kernel) else None
        if name == "lora_a":
            entries = (list(kernel) if len(kernel) else [None] * len(shape))[:-1] + [None]
        else:
            entries = [None, last]
        if len(entries) != len(shape):
            raise ValueError(f"{path} has shape {shape} but its kernel spec is {kernel}; "
                             "the adapters do not belong to these parameters")
        out[path] = _spec(_fit(entries, shape, mesh, path, dropped))
    if dropped:
        _warn(dropped, "adapter ")
    return _like(adapters, out)


def _named(specs: dict, mesh) -> dict:
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def named_shardings(params: dict, rules, mesh) -> dict:
    """-> tree of NamedSharding mirroring `params` (for jit in/out_shardings, device_put)."""
    return _named(partition_specs(params, rules, mesh), mesh)


def placement(mesh, rules, *, quiet: bool = False):
    """-> `place(path, shape) -> NamedSharding`, for `jaxlm.load(..., placement=place)`.

    It sees one tensor at a time, so it cannot tell a rule that matches nothing: run
    `partition_specs` on the abstract params first for that check and the one-line report,
    then place with quiet=True. Otherwise a non-dividing dim is warned about once per rule,
    naming the first tensor it hit.
    """
    compiled = _compile(rules)
    warned: set = set()

    def place(path: str, shape) -> NamedSharding:
        shape = tuple(shape)
        i = _match(path, compiled)
        regex, spec = compiled[i]
        dropped: list = []
        entries = _fit(_entries(spec, shape, path, regex.pattern), shape, mesh, path, dropped)
        if dropped and not quiet and i not in warned:
            warned.add(i)
            _warn(dropped, suffix=f" (and in later tensors matching {regex.pattern!r})")
        return NamedSharding(mesh, _spec(entries))
    return place


def _how(sharding, shape: tuple) -> str:
    if isinstance(sharding, NamedSharding):
        axes = [a for e in sharding.spec if e is not None
                for a in (e if isinstance(e, tuple) else (e,))]
        shards = math.prod(sharding.mesh.shape[a] for a in axes)
        if shards == 1:
            return f"replicated on {sharding.mesh.size} devices"
        return f"{shards} shards of {tuple(sharding.shard_shape(shape))}"
    if sharding is None:
        return "not placed"
    devices = len(sharding.device_set)
    return "1 device" if devices == 1 else f"{type(sharding).__name__} on {devices} devices"


def format_sharding(params: dict, prefix: str = "") -> str:
    """One line per parameter: path, shape, dtype, spec and how it is split (--print_sharding).

    prefix: only paths starting with it (e.g. "decoder_block_1/", as the seed lists).
    """
    flat = {p: v for p, v in _leaves(params).items() if p.startswith(prefix)}
    if not flat:
        return ""
    width = max(len(p) for p in flat)
    lines = []
    for path, leaf in flat.items():
        shape = tuple(leaf.shape)
        sharding = getattr(leaf, "sharding", None)
        spec = sharding.spec if isinstance(sharding, NamedSharding) else "-"
        lines.append(f"{path:<{width}}  {str(shape):<18} {str(leaf.dtype):<9} {str(spec):<36} "
                     f"{_how(sharding, shape)}")
    return "\n".join(lines)
