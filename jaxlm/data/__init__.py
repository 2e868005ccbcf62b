"""Training data: instruction files (CSV/JSONL/JSON) and TFDS datasets, the built-in checkable
dataset, loss weights (`encode(..., loss_on=)`), packing (`jaxlm.data.packing`), batching."""
from jaxlm.data.builtin import builtin_dataset, exact_match
from jaxlm.data.instructions import (LOSS_ON, TEMPLATE, Records, batch_indices, batch_rows,
                                     check_template, encode, format_examples, host_batch, pack,
                                     prompt, read_records, trim_padding)
from jaxlm.data.packing import pack_rows

__all__ = ["LOSS_ON", "TEMPLATE", "Records", "batch_indices", "batch_rows", "builtin_dataset",
           "check_template", "encode", "exact_match", "format_examples", "host_batch", "pack",
           "pack_rows", "prompt", "read_records", "trim_padding"]
