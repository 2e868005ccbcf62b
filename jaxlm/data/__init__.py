"""Training data: instruction files (CSV/JSONL/JSON), the built-in checkable dataset, packing."""
from jaxlm.data.builtin import builtin_dataset, exact_match
from jaxlm.data.instructions import (TEMPLATE, Records, batch_indices, check_template,
                                     format_examples, host_batch, pack, prompt, read_records)

__all__ = ["TEMPLATE", "Records", "batch_indices", "builtin_dataset", "check_template",
           "exact_match", "format_examples", "host_batch", "pack", "prompt", "read_records"]
