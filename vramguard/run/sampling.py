"""``sampling``: the generation arguments (checked before any loading, completed from the model's
``generation_config``) and the next token from a decode step's float32 logits, on the device, as transformers'
``generate`` chooses it (used by :mod:`vramguard.run.fastdecode`)."""

from __future__ import annotations

from vramguard.errors import InvalidValue
from vramguard.inputs import check_sampling
from vramguard.settings import require_count


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


MAX_SEED = 2**63 - 1  # torch.manual_seed takes a signed 64-bit seed ("Overflow when unpacking long long" above)
SEED_ACCEPTED = f"an integer from 0 to {MAX_SEED:,} (2**63 - 1)"


def check_seed(seed: int | None) -> None:
    """Raise InvalidValue for a sampling seed outside ``0 .. MAX_SEED`` (``torch.manual_seed`` unpacks it as a
    signed 64-bit integer and fails above it); None (no seed) passes."""
    if seed is not None and not (isinstance(seed, int) and 0 <= seed <= MAX_SEED):
        raise InvalidValue("seed", seed, SEED_ACCEPTED, "pass a seed from 0 to 2**63 - 1, e.g. seed=0")


def check_generation_args(max_new_tokens: int, do_sample: bool = False, temperature: float | None = None,
                          top_p: float | None = None, top_k: int | None = None, seed: int | None = None) -> None:
    """Raise InvalidValue for a generation argument :func:`generate` refuses (checked before any loading):
    ``max_new_tokens`` below 1, a sampling value :func:`vramguard.inputs.check_sampling` refuses, or
    any of the three without ``do_sample`` (greedy decoding would ignore it: refused rather than dropped), and a
    ``seed`` outside :func:`check_seed`'s range."""
    require_count("max_new_tokens", max_new_tokens, 1)
    check_seed(seed)
    check_sampling(temperature, top_p, top_k)
    sampling = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    given = [n for n, v in sampling.items() if v is not None]
    if given and not do_sample:  # greedy decoding would ignore them: refuse rather than drop the user's setting
        raise InvalidValue(given[0], sampling[given[0]], "only with do_sample (greedy decoding ignores it)",
                           f"pass do_sample=True to sample with {', '.join(given)}, or leave "
                           "them out for greedy decoding")


def resolve_sampling(model, do_sample: bool, temperature, top_p, top_k) -> tuple[dict, str | None]:
    """The sampling arguments every strategy gets, explicit: a value the caller left ``None`` is the model's own
    (``model.generation_config``, e.g. a checkpoint's temperature 0.6 / top_p 0.9), so no path drops it and the
    graph decoder and ``generate`` sample alike. Returns (kwargs, a note naming the values taken from the model)."""
    gc = getattr(model, "generation_config", None)
    out = {"do_sample": do_sample}
    taken = []
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if value is None and do_sample and gc is not None and getattr(gc, name, None) is not None:
            value = getattr(gc, name)
            taken.append(f"{name} {value}")
        out[name] = value
    note = ("sampling with the model's generation_config: " + ", ".join(taken)) if taken else None
    return out, note
