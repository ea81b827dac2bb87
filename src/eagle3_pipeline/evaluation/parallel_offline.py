"""Offline simulated acceptance of a DFlash drafter: one parallel pass per draft, as vLLM drafts.

DFlash drafts a whole block from the verifier's context alone: the anchor (the last verified
token), then mask tokens in the slots it drafts. Nothing it drafted is fed back, so its
teacher-forced pass IS its inference, and the simulation runs speculators' own anchored-block
forward with every position an anchor (in chunks, the sequence padded so the last positions
anchor too). Row i of the result is numbered as `offline.draft_matches` numbers EAGLE-3's (the
draft made once position i + 1 is verified): slot j + 1 of the block anchored at i + 1 proposes
position i + 2 + j, accepted when it equals the verifier's greedy token there over the FULL
target vocab (d2t maps draft ids; speculators' own `eal` compares within the draft vocab, which
never misses). `offline.accepted_prefix` and `offline.served_walk` then count the rows as they
count EAGLE-3's, so the two families' figures are the same measure.

P-EAGLE is not simulated: speculators 0.9 has no P-EAGLE pass outside its training forward,
which samples the depths it trains (COD) rather than drafting every slot.
"""

from __future__ import annotations

from typing import Any

import torch

ANCHORS_PER_PASS = 512  # a chunk of anchors per forward: bounds the dense (sdpa) mask on CPU


def dflash_matches(
    drafter: Any,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    greedy: torch.Tensor,
    num_steps: int,
    anchors_per_pass: int = ANCHORS_PER_PASS,
) -> torch.Tensor:
    """bool [L - 1, num_steps] (CPU): slot k + 1 of the block anchored at i + 1 equals the
    verifier's greedy token at i + 2 + k (False past the end)."""
    block = int(drafter.block_size)
    if num_steps > block - 1:
        raise ValueError(f"DFlash block {block} drafts {block - 1} tokens, not {num_steps}")
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    length = token_ids.shape[0]
    # `block` padding positions: select_anchors never anchors a sequence's last `block`
    # positions; past the real end nothing is compared (the context before an anchor is all a
    # block attends to, so the padding reaches no real anchor).
    aux = hidden_states[:, :-1].flatten(1)
    aux = torch.cat([aux, aux.new_zeros(block, aux.shape[1])]).to(device=device, dtype=dtype)
    final = hidden_states[:, -1]
    final = torch.cat([final, final.new_zeros(block, final.shape[1])]).to(device, dtype)
    ids = torch.cat([token_ids, token_ids.new_zeros(block)]).to(device)
    total = length + block
    d2t = drafter.d2t.cpu() if drafter.d2t is not None else None
    ok = torch.zeros(length - 1, num_steps, dtype=torch.bool)
    for start in range(1, length, anchors_per_pass):
        stop = min(start + anchors_per_pass, length)
        anchor_mask = torch.zeros(1, total, dtype=torch.long, device=device)
        anchor_mask[0, start:stop] = 1  # exactly these positions anchor (all of them fit)
        with torch.no_grad():
            _, logits, _, _, indices = drafter._backbone_forward(  # noqa: SLF001
                aux.unsqueeze(0),
                ids.unsqueeze(0),
                anchor_mask,
                final.unsqueeze(0),
                torch.zeros(1, total, dtype=torch.long, device=device),
                max_anchors=stop - start,
            )
        anchors = indices.view(-1, block)[:, 0].cpu()
        if not torch.equal(anchors, torch.arange(start, stop)):
            raise RuntimeError(f"DFlash anchored {anchors.tolist()}, not {start}..{stop - 1}")
        drafts = logits[0].argmax(-1).view(-1, block).cpu()
        for k in range(num_steps):
            draft = drafts[:, k + 1]
            target = draft + d2t[draft] if d2t is not None else draft
            pos = anchors + k + 1  # the position slot k + 1 proposes
            valid = pos < length
            verifier = torch.full_like(pos, -1)
            verifier[valid] = greedy[pos[valid] - 1]  # greedy[p]: the verifier's token at p + 1
            ok[anchors - 1, k] = valid & (target == verifier)
    return ok
