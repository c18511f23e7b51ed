"""``sampling``: the next token from a decode step's float32 logits, on the device, as transformers' ``generate``
chooses it (used by :mod:`vramguard.run.fastdecode`)."""

from __future__ import annotations


class Sampler:
    """Chooses the next token from float32 logits ``[1, vocab]`` on the device, as transformers' ``generate`` does:
    EOS set to -inf while fewer than ``min_new_tokens`` exist (``MinNewTokensLengthLogitsProcessor``), then greedy
    argmax, or temperature, top-k, top-p (transformers' warpers, in ``generate``'s order), softmax and
    ``torch.multinomial`` on the global RNG. ``None`` turns a warper off, as it does in ``generate(temperature=None)``.
    """

    def __init__(self, do_sample: bool, temperature, top_k, top_p, eos_ids: list[int], min_new_tokens: int, device):
        import torch
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
        self.do_sample, self.min_new_tokens = do_sample, min_new_tokens
        self.eos = torch.tensor(eos_ids, dtype=torch.long, device=device) if eos_ids else None
        self.warpers = []
        if do_sample:
            if temperature is not None and temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(temperature))
            if top_k is not None and top_k != 0:
                self.warpers.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
            if top_p is not None and top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))

    def __call__(self, logits, n_done: int):
        """Token id ``[1, 1]`` (long, on the logits' device) after ``n_done`` new tokens."""
        import torch
        scores = logits
        if self.eos is not None and n_done < self.min_new_tokens:
            scores = scores.index_fill(-1, self.eos, float("-inf"))
        if not self.do_sample:
            return scores.argmax(-1, keepdim=True)
        for w in self.warpers:
            scores = w(None, scores)
        return torch.multinomial(torch.nn.functional.softmax(scores, dim=-1), num_samples=1)


def eos_list(model, eos_token_id) -> list[int]:
    """``eos_token_id`` as a list of ids (``"model"``: the model's ``generation_config.eos_token_id``; None: [])."""
    if eos_token_id == "model":
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos_token_id is None:
        return []
    return [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(x) for x in eos_token_id]
