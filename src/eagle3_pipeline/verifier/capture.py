"""Forward hooks on the transformers verifier: the residual stream at the layer ids asked for.

The `hf` extract backend and tests that hold vLLM's hidden states against transformers use it;
ids follow the project's convention (config/layer_ids.py).
"""

from __future__ import annotations

from eagle3_pipeline.verifier.loading import decoder_layers


class LayerCapture:
    """Forward hooks that record the residual stream at the requested layer ids.

    Id k < N: the input of decoder layer k. Id N: the output of decoder layer N-1, which is the
    stream BEFORE the final norm (transformers' hidden_states[N] is after it).
    """

    def __init__(self, model, layer_ids: list[int]) -> None:
        import torch

        self._torch = torch
        self.layers = decoder_layers(model)
        self.layer_ids = layer_ids
        self.captured: dict[int, torch.Tensor] = {}
        self._handles = []
        n = len(self.layers)
        for lid in layer_ids:
            if lid < n:
                self._handles.append(
                    self.layers[lid].register_forward_pre_hook(self._pre(lid), with_kwargs=True)
                )
            else:
                self._handles.append(self.layers[n - 1].register_forward_hook(self._post(lid)))

    def _pre(self, lid: int):
        def hook(_module, args, kwargs):
            hs = args[0] if args else kwargs["hidden_states"]
            self.captured[lid] = hs.detach()

        return hook

    def _post(self, lid: int):
        def hook(_module, _args, output):
            hs = output[0] if isinstance(output, tuple) else output
            self.captured[lid] = hs.detach()

        return hook

    def stacked(self):
        """[batch, seq, n_ids, hidden] in layer_ids order."""
        return self._torch.stack([self.captured[i] for i in self.layer_ids], dim=2)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def forward_hidden_states(model, capture: LayerCapture, batch_ids: list[list[int]]):
    """Run one right-padded batch; return [batch, max_len, n_ids, hidden]."""
    import torch

    max_len = max(len(x) for x in batch_ids)
    input_ids = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
    mask = torch.zeros(len(batch_ids), max_len, dtype=torch.long)
    for i, ids in enumerate(batch_ids):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    capture.captured.clear()
    with torch.no_grad():
        base = getattr(model, "model", model)  # skip lm_head: only hidden states are needed
        base(input_ids=input_ids, attention_mask=mask, use_cache=False)
    return capture.stacked()
