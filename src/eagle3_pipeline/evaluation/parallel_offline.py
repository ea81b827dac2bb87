"""Offline simulated acceptance of parallel drafters (DFlash, P-EAGLE): one pass per draft,
as vLLM drafts them.

A parallel drafter proposes all its slots in one pass from the verifier's context: the anchor (the
last verified token), then mask tokens in the slots it drafts. Nothing it drafted is fed back,
so its teacher-forced pass with every position an anchor IS its inference.

- DFlash: speculators' own anchored-block forward, every position an anchor (in chunks, the
  sequence padded so the last positions anchor too).
- P-EAGLE: the pass of speculators' training forward with every (anchor, depth) pair in place of
  its COD sample: depth 0 is EAGLE-3's input (token i + 1, the verifier's states at i), depth
  d >= 1 the mask token and the learned `mask_hidden`, each attending to every depth-0 entry up to
  its anchor and to its own rollout's lower depths (speculators' `create_peagle_mask_mod`); vLLM
  drafts the same (parallel drafting: mask slots after the last verified token, their hidden
  state `combine_hidden_states(mask_hidden)`).

Row i of the result is numbered as `offline.draft_matches` numbers EAGLE-3's (the draft made once
position i + 1 is verified): slot k proposes position i + 2 + k, accepted when it equals the
verifier's greedy token there over the FULL target vocab (d2t maps draft ids; speculators' own
DFlash `eal` compares within the draft vocab, which never misses). `offline.accepted_prefix` and
`offline.served_walk` then count the rows as they count EAGLE-3's, so every family's figures are
the same measure.
"""

from __future__ import annotations

from typing import Any

import torch

from eagle3_pipeline.evaluation.offline import slot_verdicts

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
    verifier's greedy token at i + 2 + k (False past the end).

    The block is the served one: vLLM queries the anchor and `num_steps` mask slots, which
    attend to each other (non-causal), so fewer drafts than trained is a shorter block, not the
    trained block's first slots."""
    trained = int(drafter.block_size)
    if num_steps > trained - 1:
        raise ValueError(f"DFlash block {trained} drafts {trained - 1} tokens, not {num_steps}")
    drafter.block_size = num_steps + 1  # speculators' anchored pass reads its block size here
    try:
        return _dflash_blocks(
            drafter, hidden_states, token_ids, greedy, num_steps, anchors_per_pass
        )
    finally:
        drafter.block_size = trained


def _dflash_blocks(
    drafter: Any,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    greedy: torch.Tensor,
    num_steps: int,
    anchors_per_pass: int,
) -> torch.Tensor:
    block = int(drafter.block_size)
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
        rows = anchors - 1  # the block anchored at i + 1 is row i; its slot k + 1 is step k
        for k in range(num_steps):
            ok[rows, k] = slot_verdicts(drafts[:, k + 1], rows, k, d2t, greedy, length)
    return ok


def peagle_matches(
    drafter: Any,
    hidden_states: torch.Tensor,
    token_ids: torch.Tensor,
    greedy: torch.Tensor,
    num_steps: int,
    anchors_per_pass: int = ANCHORS_PER_PASS,
) -> torch.Tensor:
    """bool [L - 1, num_steps] (CPU): depth k of the rollout anchored at row i (token i + 1,
    states at i) equals the verifier's greedy token at i + 2 + k (False past the end)."""
    device = next(drafter.parameters()).device
    dtype = next(drafter.parameters()).dtype
    length = token_ids.shape[0]
    rows = length - 1  # speculators' shift_batch: token i + 1 beside the states of i
    aux = hidden_states[:-1, :-1].flatten(1).to(device=device, dtype=dtype)
    ids = token_ids[1:].to(device)
    d2t = drafter.d2t.cpu() if drafter.d2t is not None else None
    ok = torch.zeros(rows, num_steps, dtype=torch.bool)
    for start in range(0, rows, anchors_per_pass):
        stop = min(start + anchors_per_pass, rows)
        # depth 0 of every row up to the chunk's last anchor (their context), then the chunk's
        # anchors at each depth, as generate_cod_sample_indices orders its sample.
        spans = [torch.arange(stop)] + [torch.arange(start, stop)] * (num_steps - 1)
        anchor = torch.cat(spans).to(device)
        depth = torch.cat([torch.full((len(x),), d) for d, x in enumerate(spans)]).to(device)
        with torch.no_grad():
            logits = peagle_logits(drafter, aux[:stop], ids[:stop], anchor, depth)
        drafts = logits.argmax(-1).cpu()
        anchor, depth = anchor.cpu(), depth.cpu()
        for k in range(num_steps):
            pick = (depth == k) & (anchor >= start)
            ok[anchor[pick], k] = slot_verdicts(drafts[pick], anchor[pick], k, d2t, greedy, length)
    return ok


def peagle_logits(
    drafter: Any,
    aux: torch.Tensor,
    ids: torch.Tensor,
    anchor: torch.Tensor,
    depth: torch.Tensor,
) -> torch.Tensor:
    """[len(anchor), draft vocab]: PEagleDraftModel.forward's logits for the sample (anchor,
    depth) of rows `aux` [S, n_aux * H] / `ids` [S] (already shifted), one document; the
    forward's own steps without its COD sampling and loss (it would index depth >= 1 rows past
    the sequence's end, which a draft at the last positions needs)."""
    from speculators.models.peagle.attention import create_peagle_mask_mod

    is_depth_0 = depth == 0
    row = anchor.clamp(max=len(ids) - 1)  # depth >= 1 reads neither token nor states
    sampled_ids = torch.where(is_depth_0, ids[row], drafter.mask_token_id).unsqueeze(0)
    embeds = drafter.embed_tokens(sampled_ids).to(aux.dtype)
    mask_hidden = drafter.mask_hidden.to(aux.dtype).reshape(1, -1)
    hidden = torch.where(is_depth_0.unsqueeze(-1), aux[row], mask_hidden).unsqueeze(0)
    if drafter.input_norm is not None:
        hidden = drafter.input_norm(hidden)
    if drafter.fc_norm is not None:
        chunks = hidden.chunk(len(drafter.fc_norm), dim=-1)
        hidden = torch.cat([n(c) for n, c in zip(drafter.fc_norm, chunks, strict=True)], dim=-1)
    layer_input = torch.cat([embeds, drafter.fc(hidden)], dim=-1)
    position_ids = (anchor + depth).unsqueeze(0)
    position_embeddings = drafter.rotary_emb(layer_input, position_ids)
    documents = torch.zeros(len(ids), dtype=torch.long, device=ids.device)

    def attention_mask(window: int | None) -> Any:
        mask_mod = create_peagle_mask_mod(anchor, depth, documents, sliding_window=window)
        n = len(anchor)
        return drafter._create_mask_fn(  # noqa: SLF001
            mask_mod, B=None, H=None, Q_LEN=n, KV_LEN=n, device=ids.device
        )

    full = attention_mask(None) if drafter.uses_full_attn else None
    window = attention_mask(drafter.sliding_window) if drafter.uses_sliding_window_attn else None
    out = layer_input
    for index, layer in enumerate(drafter.layers):
        out = layer(
            out,
            attention_mask=window if index in drafter.sliding_window_indices else full,
            position_ids=position_ids,
            position_embeddings=position_embeddings,
        )
    return drafter.lm_head(drafter.norm(out))[0]


MATCHES = {"dflash": dflash_matches, "peagle": peagle_matches}  # by family (speculator type)
