"""Device meshes and regex -> PartitionSpec layout rules (imports neither jaxlm nor models).

    mesh = sharding.make_mesh("1x8")                       # axes ("batch", "model")
    rules = sharding.rules_for(model.config, layout=None)  # [(regex, PartitionSpec)]
    acts = sharding.activation_rules(model.config)         # {logical name: mesh axes}
    specs = sharding.partition_specs(params, rules, mesh)  # tree of PartitionSpec
    model, params = jaxlm.load(path, placement=sharding.placement(mesh, rules))
    print(sharding.format_sharding(params))

Bad input raises a plain ValueError with one line naming the problem and the fix.
"""
from sharding.mesh import AXES, batch_sharding, make_mesh, parse_mesh
from sharding.rules import ACTIVATIONS, DEFAULT_LAYOUT, TABLES, activation_rules, rules_for
from sharding.specs import (adapter_specs, format_sharding, named_shardings, partition_specs,
                            placement)

__all__ = ["AXES", "make_mesh", "parse_mesh", "batch_sharding", "rules_for", "TABLES",
           "ACTIVATIONS", "activation_rules",
           "DEFAULT_LAYOUT", "partition_specs", "adapter_specs", "named_shardings", "placement",
           "format_sharding"]
