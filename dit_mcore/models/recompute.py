"""Activation recompute inside a layer: one branch freed and recomputed in the backward
(:func:`recomputed`, selective recompute of the MLP), and a branch run over chunks of the token stream,
each recomputed (:func:`over_chunks`, ``model.chunk_tokens``): the branch's peak is then one chunk's.
"""
from __future__ import annotations

import torch

from dit_mcore.models import te_fp8


def recomputed(fn, *args, config, traceable: bool = True):
    """``fn(*args)``, its activations freed and recomputed in the backward (selective recompute of the
    MLP). Inside a compiled layer through torch's non-reentrant checkpoint, which dynamo traces into the
    layer's graph; megatron's ``tensor_parallel.checkpoint`` saves the RNG states with calls dynamo does
    not trace, and broke every compiled layer into pieces (two llama-tiny layers: 8 graphs and 6 breaks
    instead of 6 and 4). Eagerly, and for a branch that is not ``traceable``, through megatron's, which
    also restores the model-parallel RNG tracker and runs the first forward without grad: megatron's MoE
    router tells that forward from the recompute by it (its load-balancing metrics would count twice).
    A dense branch draws no random numbers, so both recompute it exactly. Under Transformer Engine's
    FP8 (``config.fp8``; never compiled) through TE's checkpoint, as megatron's layer does: it
    recomputes inside the forward's FP8 state."""
    if traceable and torch.compiler.is_compiling():
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False)
    return te_fp8.checkpoint(config, fn, *args, distribute=False)  # (megatron's, or TE's under its FP8)


def over_chunks(fn, hidden_states: torch.Tensor, conditioning, *per_sample: torch.Tensor, chunk: int, config):
    """``fn(x, conditioning, *per_sample)`` for a per-token ``fn`` (its rows depend only on the same rows of
    ``x``), run over ``chunk`` tokens (dim 0 of ``hidden_states``) at a time, each chunk recomputed in the
    backward (megatron's checkpoint, as :func:`recomputed`): the forward keeps each chunk's input only,
    the backward rebuilds one chunk's activations at a time. Equal to ``fn`` on the whole stream."""
    tokens = hidden_states.shape[0]
    if tokens <= chunk:
        return recomputed(lambda x, *p: fn(x, conditioning, *p), hidden_states, *per_sample, config=config)
    parts = []
    for start in range(0, tokens, chunk):
        rows = min(chunk, tokens - start)
        part = conditioning.narrow(start, rows)
        parts.append(recomputed(lambda x, *p, part=part: fn(x, part, *p), hidden_states.narrow(0, start, rows),
                                *per_sample, config=config))
    return torch.cat(parts)
