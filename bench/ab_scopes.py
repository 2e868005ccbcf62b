"""What the real-model A/Bs of bench/real_step_ab.py put back: each change's earlier form,
swapped in for the time a variant is traced (context managers) or set (`switch`)."""
from __future__ import annotations

import contextlib

from jaxlm.train import loss as L


@contextlib.contextmanager
def every_chunk():
    """Trace the loss as it was before `live_chunks`: every chunk projected, weighted or not."""
    live = L.live_chunks
    L.live_chunks = lambda weights, c: -(-weights.shape[1] // c)
    try:
        yield
    finally:
        L.live_chunks = live


@contextlib.contextmanager
def plain_attention():
    """Trace training attention as before the CPU kernel: autodiff's products, small blocks."""
    from models import kernels, layers
    core, block = kernels._cpu_softmax_attention, kernels.CPU_QUERY_BLOCK
    kernels._cpu_softmax_attention, kernels.CPU_QUERY_BLOCK = layers.softmax_attention, layers.QUERY_BLOCK
    try:
        yield
    finally:
        kernels._cpu_softmax_attention, kernels.CPU_QUERY_BLOCK = core, block


@contextlib.contextmanager
def token_major_loss():
    """Trace the loss token-major on one device too, as before jaxlm/train/online_softmax.py:
    each chunk's [B, C, V] logits block, its sums and d (`loss._token_major`)."""
    from jaxlm.train import online_softmax
    online = online_softmax.loss

    def token_major(h, emb, columns, y, w, live, cap, gradient=True):
        if not gradient:  # the value alone, which a train step does not take
            return online(h, emb, columns, y, w, live, cap, gradient)
        loss, hits, _, d_h = L._chunk_loop(h, live, None, lambda i: L._token_major(
            h[i], emb, columns, y[i], w[i], cap, train_emb=False))
        return loss, hits, d_h
    online_softmax.loss = token_major
    try:
        yield
    finally:
        online_softmax.loss = online


@contextlib.contextmanager
def whole_hidden_gradient():
    """Trace the loss's hidden gradient as before `tied_hidden_gradient`: one product over V."""
    from models import kernels
    sliced = kernels._cpu_tied_hidden_gradient
    kernels._cpu_tied_hidden_gradient = kernels._tied_hidden_gradient
    try:
        yield
    finally:
        kernels._cpu_tied_hidden_gradient = sliced


def switch(what: str, on: bool):
    """layout: the CPU decode step layout at any batch or never (`STEP_LAYOUT_MAX_ROWS`);
    screen: float32 greedy tokens through the bfloat16 screen or not (`decode.SCREEN`)."""
    from jaxlm import decode
    from models import decode_kernels
    if what == "layout":
        decode_kernels.STEP_LAYOUT_MAX_ROWS = 1 << 30 if on else 0
    else:
        decode.SCREEN = on
