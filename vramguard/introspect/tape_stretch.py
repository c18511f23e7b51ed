"""The first forwards' tapes of ``generate`` at many prompts from the tapes of a few, where a chunked scan pads the
prompt to its chunk (:mod:`vramguard.introspect.stretch`): every event's bytes a polynomial in the prompt and that
padding. Knows nothing of how a tape is recorded (:mod:`vramguard.introspect.alloc_replay` passes its recorder).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Callable

from vramguard.introspect.build import cached_config, text_config
from vramguard.introspect.stretch import Sample, Stretch, context, first_periodic
from vramguard.settings import Settings

Recorder = Callable[[str, str, Settings, int, int], tuple]  # (config, name, settings, prompt, new) -> forwards


def periodic_events(record: Recorder, config_json: str, name: str, key: Settings, prompt: int, new: int, lo: int,
                    end: int | None, period: int) -> tuple[bool, tuple | None]:
    """(whether it applies, the forwards ``record`` gives for ``prompt``) of a model whose chunked scan pads to
    ``period`` (:func:`vramguard.introspect.stretch.chunk_period`) where the stretch of prompts holds two chunks or
    more (a loop's: :func:`~vramguard.introspect.stretch.first_periodic`):
    from the polynomial of the prompts from ``lo`` (and
    two chunks) to ``end`` (exclusive; None: the model's context less ``new``) where it is known, else recorded
    here and kept towards it (:class:`~vramguard.introspect.stretch.Stretch`); None where the prompt lies outside
    that stretch or no polynomial holds there, and the caller records it then (a quadratic in the prompt does not
    hold across a chunk's end)."""
    cfg = text_config(cached_config(config_json, name))
    end = end or context(cfg) - new + 1
    st = _tape_stretch(config_json, name, key, new, max(lo, first_periodic(cfg, period)), end, period)
    if st.lo >= st.end:  # no prompt past the first chunks: the prompts are not periodic in it
        return False, None
    found = st.at(prompt)
    if found is None and st.wants(prompt):  # recorded here, and kept
        found = _tape_sample(record(config_json, name, key, prompt, new))
        st.keep(prompt, found)
    if found is None:
        return True, None
    structure: tuple = found[0]  # type: ignore[assignment]
    keys, numbers = structure[0], found[1]
    out, i = [], 0
    for count in structure[2]:
        out.append(tuple(zip(keys[i:i + count], numbers[i:i + count])))
        i += count
    return True, tuple(out)


def _tape_sample(forwards: tuple) -> Sample:
    """Forwards' tapes as a :data:`~vramguard.introspect.stretch.Sample`: structure (keys, frees, forward lengths),
    numbers (each event's bytes, -1 for a free)."""
    flat = [e for fw in forwards for e in fw]
    return (tuple(k for k, _ in flat), tuple(n < 0 for _, n in flat), tuple(len(fw) for fw in forwards)), \
        tuple(n for _, n in flat)


@lru_cache(maxsize=16)
def _tape_stretch(config_json: str, name: str, key: Settings, new: int, lo: int, end: int, period: int) -> Stretch:
    """The :class:`~vramguard.introspect.stretch.Stretch` of the tapes over the prompts from ``lo`` to ``end``."""
    return Stretch(lo, end, period)
