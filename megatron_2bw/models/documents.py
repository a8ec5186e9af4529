"""--reset-attention-mask: attention within each document of a packed GPT sample (Megatron's
get_ltor_masks_and_position_ids).

A sample packs documents, each ended by the tokenizer's end-of-document token (eod). Megatron's
rule: for an eod at position i, the positions after i do not attend to positions 0..i. So an eod
belongs to the document it ends (it attends to that document, itself included) and a token
attends causally to the tokens from the one after the last eod before it. Equivalently: query q
attends to key k when k <= q and both have the same document id, the number of eods strictly
before the position.

The first stage turns the tokens into document ids [b, s] (int64, `document_ids`); the ids travel
with the hidden state through every layer and, between pipeline stages, as a second tensor of the
activation (b * s int64, not the s * s mask). The layers of a model share a `DocumentMasks`,
which builds the boolean mask [b, 1, s, s] once per microbatch and stage and hands the same mask
to all of that stage's layers. Without the flag none of this exists: the embedding returns the
hidden state alone and attention is plain causal.
"""
from __future__ import annotations

import weakref

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] int64: the number of eod tokens strictly before each position."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def document_mask(ids: torch.Tensor) -> torch.Tensor:
    """The boolean attention mask [b, 1, s, s] (True = attend) of document ids [b, s]: causal,
    and within the query's document."""
    s = ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=ids.device).tril()
    return (ids[:, None, :, None] == ids[:, None, None, :]) & causal


class DocumentMasks:
    """Hands the layers of a stage one mask per microbatch. A layer passes on a new view of the
    ids it got (`__call__`'s second result, no copy), and the mask is kept for that view only:
    the next layer of the same forward gets that very object and reuses the mask, while the
    first layer of every forward gets another object (the embedding's fresh ids, a received
    buffer, a recomputation's detached input) and builds the mask anew. The key is not the ids'
    values (comparing them would be a host sync) nor a buffer's identity (received buffers are
    pooled: one object carries many microbatches)."""

    def __init__(self):
        self._out: weakref.ref | None = None
        self._mask: torch.Tensor | None = None

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the mask of `ids`, the ids to pass on)"""
        if self._out is not None and self._out() is ids:
            return self._mask, ids
        out = ids.view_as(ids)
        self._mask, self._out = document_mask(ids), weakref.ref(out)
        return self._mask, out
