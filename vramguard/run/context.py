"""Long prompts: fill the prompt with the retrieved chunks that fit the token budget the plan allows, or, for
context that can never fit, summarize it chunk by chunk and ask with the summaries.

Relevance is Okapi BM25 over lower-cased word tokens (Robertson and Zaragoza, "The Probabilistic Relevance
Framework: BM25 and Beyond", 2009; k1 = 1.5, b = 0.75). Chunks keep their original order in the prompt.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from vramguard.errors import InvalidValue
from vramguard.inputs import read_text
from vramguard.run.generate import generate, prompt_budget
from vramguard.run.prompt import prepare_prompt
from vramguard.runtime.handle import handle_of

BM25_K1, BM25_B = 1.5, 0.75
_WORD = re.compile(r"\w+", re.UNICODE)


@dataclass
class Chunk:
    """A piece of the context: its text, source file, position and token count."""

    text: str
    source: str
    index: int
    tokens: int


@dataclass
class PackedContext:
    """The prompt built from the context, the chunks it holds, and what was left out or summarized."""

    prompt: str
    prompt_tokens: int
    used: list[Chunk]
    total_chunks: int
    budget_tokens: int
    summarized: bool = False
    notes: list[str] = field(default_factory=list)


def _count(tokenizer, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def split_chunks(text: str, source: str, tokenizer, chunk_tokens: int = 256) -> list[Chunk]:
    """Paragraphs (blank-line separated) merged up to ``chunk_tokens`` tokens; longer paragraphs split at sentence
    ends, then at ``chunk_tokens`` tokens."""
    pieces: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        para = para.strip()
        if not para:
            continue
        if _count(tokenizer, para) <= chunk_tokens:
            pieces.append(para)
            continue
        for sent in re.split(r"(?<=[.!?])\s+", para):
            ids = tokenizer(sent, add_special_tokens=False)["input_ids"]
            for i in range(0, len(ids), chunk_tokens):
                pieces.append(tokenizer.decode(ids[i:i + chunk_tokens]))
    chunks: list[Chunk] = []
    cur, cur_n = "", 0
    for p in pieces:
        n = _count(tokenizer, p)
        if cur and cur_n + n > chunk_tokens:
            chunks.append(Chunk(cur, source, len(chunks), cur_n))
            cur, cur_n = "", 0
        cur = f"{cur}\n\n{p}" if cur else p
        cur_n = _count(tokenizer, cur)
    if cur:
        chunks.append(Chunk(cur, source, len(chunks), cur_n))
    return chunks


def bm25_scores(query: str, docs: list[str]) -> list[float]:
    """BM25 score of every document for ``query`` (see the module docstring)."""
    toks = [[w.lower() for w in _WORD.findall(d)] for d in docs]
    n = len(toks)
    avg = sum(len(t) for t in toks) / n if n else 0.0
    df = Counter(w for t in toks for w in set(t))
    q = [w.lower() for w in _WORD.findall(query)]
    out = []
    for t in toks:
        tf = Counter(t)
        score = 0.0
        for w in q:
            if w not in tf:
                continue
            idf = math.log(1 + (n - df[w] + 0.5) / (df[w] + 0.5))
            f = tf[w]
            score += idf * f * (BM25_K1 + 1) / (f + BM25_K1 * (1 - BM25_B + BM25_B * len(t) / (avg or 1)))
        out.append(score)
    return out


def build_prompt(question: str, chunks: list[Chunk]) -> str:
    body = "\n\n".join(f"[{c.source} #{c.index + 1}]\n{c.text}" for c in chunks)
    return f"Context:\n{body}\n\nQuestion: {question}\nAnswer:"


def pack(question: str, chunks: list[Chunk], tokenizer, budget_tokens: int,
         count: Callable[[str], int] | None = None) -> PackedContext:
    """The most relevant chunks whose prompt fits ``budget_tokens`` tokens, in their original order; ``count``
    gives a prompt's tokens as it will be sent (default: its text's tokens, without special tokens)."""
    count = count or (lambda text: _count(tokenizer, text))
    scores = bm25_scores(question, [c.text for c in chunks])
    order = sorted(range(len(chunks)), key=lambda i: -scores[i])
    chosen: list[Chunk] = []
    for i in order:
        trial = sorted(chosen + [chunks[i]], key=lambda c: (c.source, c.index))
        if count(build_prompt(question, trial)) <= budget_tokens:
            chosen = trial
    prompt = build_prompt(question, chosen)
    res = PackedContext(prompt, count(prompt), chosen, len(chunks), budget_tokens)
    if len(chosen) < len(chunks):
        res.notes.append(f"{len(chunks) - len(chosen)} of {len(chunks)} chunks left out (token budget "
                         f"{budget_tokens:,})")
    return res


MIN_SUMMARY_TOKENS = 8  # the shortest summary worth asking for


def summary_prompt(text: str) -> str:
    return f"Summarize the following text.\n\n{text}\n\nSummary:"


def summarize_then_ask(question: str, chunks: list[Chunk], tokenizer, budget_tokens: int,
                       summarize: Callable[[str, int], str], context_tokens: int | None = None,
                       chunk_tokens: int | None = None, count: Callable[[str], int] | None = None) -> PackedContext:
    """Summarize every chunk (``summarize(prompt, max_new_tokens) -> text``) to an equal share of the budget,
    then pack the summaries like chunks (``count``: as :func:`pack` counts the prompt).

    Raises:
        InvalidValue: a chunk's summary request (instruction + chunk + at least 8 new tokens) is longer than
            ``context_tokens``, the model's context; the fix gives a ``--chunk-tokens`` that fits. Otherwise each
            summary's share of new tokens is capped to what the context leaves after the longest request.
    """
    count = count or (lambda text: _count(tokenizer, text))
    base = count(build_prompt(question, []))
    header = max((count(build_prompt(question, [Chunk("", c.source, c.index, 0)])) - base
                  for c in chunks), default=0)  # the "[source #i]" line and separators of each chunk
    share = max(MIN_SUMMARY_TOKENS, (budget_tokens - base) // max(len(chunks), 1) - header - 2)
    if context_tokens is not None and chunks:  # each summary request must fit the model's context
        longest = max(_count(tokenizer, summary_prompt(c.text)) for c in chunks)
        if longest + MIN_SUMMARY_TOKENS > context_tokens:
            fits = max(c.tokens for c in chunks) - (longest + MIN_SUMMARY_TOKENS - context_tokens) - 1
            raise InvalidValue("chunk_tokens", chunk_tokens, f"chunks whose summary request (instruction, chunk "
                               f"and at least {MIN_SUMMARY_TOKENS} new tokens) fits the model's context of "
                               f"{context_tokens:,} tokens", f"pass chunk_tokens={fits}" if fits >= 16 else
                               "the context is too short to summarize even 16-token chunks: shorten the files")
        share = min(share, context_tokens - longest)
    summaries = []
    for c in chunks:
        text = summarize(summary_prompt(c.text), share)
        summaries.append(Chunk(text.strip(), c.source, c.index, _count(tokenizer, text)))
    res = pack(question, summaries, tokenizer, budget_tokens, count)
    res.summarized = True
    res.total_chunks = len(chunks)
    res.notes.insert(0, f"{len(chunks)} chunks summarized to at most {share} tokens each")
    return res


def context_prompt(model, tokenizer, question: str, files: list[str], *, chunk_tokens: int = 256,
                   max_new_tokens: int = 256, budget_bytes: int | None = None, auto: bool = True,
                   summarize: bool = False, chat: bool | None = None) -> tuple[PackedContext, int]:
    """The prompt for ``question`` from the text ``files``: split into chunks of ``chunk_tokens``, ranked by BM25,
    packed within the longest prompt the plan allows with ``max_new_tokens`` (:func:`vramguard.run.generate.
    prompt_budget`); with ``summarize``, chunks that cannot all fit are summarized first (:func:`summarize_then_ask`,
    summaries generated by :func:`vramguard.run.generate.generate` under the same budget). The prompt is counted
    as it will be sent: through :func:`vramguard.run.prompt.prepare_prompt` with ``chat`` (the chat template when
    the tokenizer has one and ``chat`` is not False), so its ``prompt_tokens`` are the ids generated from.
    ``model`` is the :class:`~vramguard.runtime.handle.LoadedModel` :func:`vramguard.runtime.load.load_model`
    returned (or a model vramguard did not load), passed on as it is to the budget and the summaries.

    Returns:
        (the packed context, the token budget it was packed into).

    Raises:
        InvalidValue: ``chunk_tokens`` below 16, or a file that is not readable UTF-8 text.
    """

    def count(text: str) -> int:
        return len(prepare_prompt(tokenizer, text, chat).ids)
    if chunk_tokens < 16:
        raise InvalidValue("chunk_tokens", chunk_tokens, "an integer >= 16", "use larger chunks")
    chunks: list[Chunk] = []
    for f in files:
        chunks += split_chunks(read_text(f, "files"), f, tokenizer, chunk_tokens)  # a FIFO is refused, not waited on
    h = handle_of(model, tokenizer)
    limit = prompt_budget(h, max_new_tokens, budget_bytes, auto)
    packed = pack(question, chunks, tokenizer, limit, count)
    if summarize and len(packed.used) < len(chunks):
        def summ(p: str, n: int) -> str:
            return generate(h, tokenizer, p, n, budget_bytes=budget_bytes, auto=auto).text
        packed = summarize_then_ask(question, chunks, tokenizer, limit, summ,
                                    context_tokens=getattr(h.model.config, "max_position_embeddings", None),
                                    chunk_tokens=chunk_tokens, count=count)
    elif len(packed.used) < len(chunks):
        packed.notes.append("summarize=True summarizes them first" + (
            "; no chunk fits whole: pass a smaller chunk_tokens=" if not packed.used else ""))
    return packed, limit
