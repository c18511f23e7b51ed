"""A model's split over several cards, as a type both splitters return (transformers' own in
:mod:`~vramguard.plan.multigpu.devicemap`, the torch-free one in :mod:`~vramguard.plan.multigpu.layerwise`), and
accelerate's rule of which device map entry places a tensor."""

from __future__ import annotations

from dataclasses import dataclass

OFF_GPU = ("cpu", "disk")
CPU_UNBOUNDED_BYTES = 2**60  # host memory given to the split: whatever does not fit the cards is reported, not lost


@dataclass(frozen=True)
class DeviceSplit:
    """The split of one model over ``cards`` GPUs (card indices 0..cards-1, as ``max_memory`` keys).

    Attributes:
        device_map: module name -> card index, ``"cpu"`` or ``"disk"`` (transformers' own result).
        weight_bytes: per card, bytes of the tensors it holds, each rounded to 512 B (quantization state included).
        raw_bytes: per card, the same tensors' bytes unrounded (4-bit weights at half a byte per value, as
            transformers' ``compute_module_sizes`` counts them).
        layers: per card, the indices of the decoder layers it holds (a layer's KV cache lives with it).
        input_card, output_card: the cards of the input embeddings and of the output embeddings (``lm_head``).
        offloaded: entries of the device map placed on the CPU or disk (they did not fit the cards), with their
            unrounded bytes.
        max_memory: the ``max_memory`` handed to transformers (bytes per card).
        no_split: the model's ``_no_split_modules`` (the torch-free split: the family's decoder layer class).
    """

    device_map: dict[str, int | str]
    weight_bytes: tuple[int, ...]
    raw_bytes: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    input_card: int | str
    output_card: int | str
    offloaded: dict[str, int]
    max_memory: tuple[int, ...]
    no_split: tuple[str, ...]


def map_key(name: str, device_map: dict[str, int | str]) -> str:
    """The entry of ``device_map`` that places tensor or module ``name``: its longest prefix (accelerate's rule;
    ``""`` is the whole model). Raises KeyError when none does."""
    best = None
    for key in device_map:
        if (key == "" or name == key or name.startswith(key + ".")) and (best is None or len(key) > len(best)):
            best = key
    if best is None:
        raise KeyError(name)
    return best


def device_of(name: str, device_map: dict[str, int | str]) -> int | str:
    """The device of tensor or module ``name`` in ``device_map`` (see :func:`map_key`)."""
    return device_map[map_key(name, device_map)]
