"""The files and values a user hands vramguard, checked once where they are read: nothing here loads a model.

A path must name a regular file: a FIFO, a device, a socket or a folder is refused from its ``stat`` alone (never
opened for reading, where a FIFO would block forever), and a symlink loop is said as one. A JSON file is bounded in
size and nesting depth. A config.json's size fields are integers within limits real models keep far inside, its
``torch_dtype`` a dtype name torch has. A safetensors header is checked against the file's format
(https://huggingface.co/docs/safetensors, "Format": an 8-byte little-endian length ``N``, ``N`` bytes of JSON,
then the tensor data, which the ``data_offsets`` must cover exactly), and a weights index is bounded in its count
of shards, each of which must be a file of the folder. Sampling values are range-checked.

Every refusal names the file or field, the limit, the value and the fix: :class:`~vramguard.errors.ConfigError`
(exit 3) for a model's files, :class:`~vramguard.errors.InvalidValue` (exit 2) for an option's. Imports neither
torch nor transformers.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from vramguard.errors import ConfigError, InvalidValue, VramguardError
from vramguard.spec import MAX_LAYERS  # decoder layers

MAX_CONFIG_BYTES = 64 * 2**20  # a config.json or weights index; real ones are kilobytes (an index ~100 KiB)
MAX_JSON_DEPTH = 64  # nested objects/lists; real configs nest 4 deep (quantization_config's module lists)
MAX_SHARDS = 2048  # weight files one index may name; the largest public checkpoints have under 200
MAX_WIDTH = 2**20  # hidden / intermediate sizes, heads and head_dim (the largest models: hidden 16,384)
MAX_VOCAB = 2**24  # tokens (the largest vocabularies hold 262,144)
MAX_CONTEXT = 2**28  # max_position_embeddings in tokens (the longest contexts named: 10,485,760)
MAX_EXPERTS = 2**16  # MoE experts (the most: 512)
# scores / temperature stays finite in float32 (max 3.4e38) for logits up to 3.4e34 at this temperature; smaller
# positive temperatures overflow the logits to inf and the softmax to NaN, which torch.multinomial refuses
MIN_TEMPERATURE = 1e-4

# config.json field -> (lowest, highest accepted); a field absent or null is not checked here; a head_dim of 0
# stands for hidden_size / num_attention_heads (transformers' own default for glm5_next)
CONFIG_INTS: dict[str, tuple[int, int]] = {
    "num_hidden_layers": (1, MAX_LAYERS), "hidden_size": (1, MAX_WIDTH), "intermediate_size": (1, MAX_WIDTH),
    "num_attention_heads": (1, MAX_WIDTH), "num_key_value_heads": (1, MAX_WIDTH), "head_dim": (0, MAX_WIDTH),
    "vocab_size": (1, MAX_VOCAB), "max_position_embeddings": (1, MAX_CONTEXT),
    "moe_intermediate_size": (0, MAX_WIDTH), "shared_expert_intermediate_size": (0, MAX_WIDTH),
    "num_local_experts": (0, MAX_EXPERTS), "num_experts": (0, MAX_EXPERTS), "num_experts_per_tok": (0, MAX_EXPERTS),
}
# the names torch gives its floating dtypes (``torch.<name>``), which transformers reads from ``torch_dtype``/``dtype``
# (tests/test_bad_inputs.py checks each against torch); "auto" asks transformers to take the checkpoint's
CONFIG_DTYPE_NAMES = ("float32", "float", "float16", "half", "bfloat16", "float64", "double", "float8_e4m3fn",
                      "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu")

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotAFile(ConfigError):
    """A path that must name a regular file names a FIFO, a device, a socket, a folder, a symlink loop or nothing:
    refused at once, even where a damaged file's content would only be noted (a plan from config.json alone)."""


def regular_file(path: str | os.PathLike, field: str, what: str, error: type[VramguardError] = NotAFile,
                 instead: str = "put the file itself there") -> os.stat_result:
    """The ``stat`` of ``path`` when it names a regular file (through symlinks); never opens it. ``instead`` ends
    the fix (what to pass in its place).

    Raises:
        ``error`` (naming ``field``): the path is missing, a symlink loop, unreadable, or not a regular file.
    """
    try:
        st = os.stat(path)
    except OSError as e:
        why = ("a symlink loop (a link that points back to itself)" if e.errno == errno.ELOOP
               else e.strerror or type(e).__name__)
        raise error(field, str(path), f"a readable {what}", f"{path}: {why}; {instead}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise error(field, str(path), f"a regular file ({what})",
                    f"{path} is {kind}, which vramguard does not read; {instead}")
    return st


def open_regular(path: str | os.PathLike, field: str, what: str, error: type[VramguardError] = NotAFile):
    """``path`` opened for binary reading when it is a regular file (:func:`regular_file`).

    The file is opened non-blocking and checked again from its descriptor, so a FIFO put in its place after the
    ``stat`` is refused too, not waited on."""
    regular_file(path, field, what, error)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise error(field, str(path), f"a readable {what}", f"{path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise error(field, str(path), f"a regular file ({what})", f"{path} changed into another kind of file")
    return os.fdopen(fd, "rb")


def read_bytes(path: str | os.PathLike, field: str, what: str, max_bytes: int,
               error: type[VramguardError] | None = None, instead: str = "put the file itself there") -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`), refused when it holds over ``max_bytes``;
    ``error`` is raised instead of :class:`NotAFile` and :class:`~vramguard.errors.ConfigError` when given."""
    size = regular_file(path, field, what, error or NotAFile, instead).st_size
    if size > max_bytes:
        raise (error or ConfigError)(field, str(path), f"a {what} of at most {max_bytes:,} bytes",
                                     f"{path} holds {size:,} bytes: pass the right file")
    with open_regular(path, field, what, error or NotAFile) as f:
        return f.read(max_bytes + 1)[:max_bytes]


def json_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply ``value``'s objects and lists nest (a scalar 0, ``{}`` 1), counted without recursion; the count
    stops at ``limit + 1``."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if not isinstance(v, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def read_json(path: str | os.PathLike, field: str, what: str, max_bytes: int = MAX_CONFIG_BYTES) -> dict:
    """The JSON object in the file ``path`` (:func:`read_bytes`), nested at most :data:`MAX_JSON_DEPTH` deep.

    Raises:
        ConfigError (naming ``field`` and the file): not a regular file, too large, not UTF-8 JSON, not an object,
            nested too deep.
    """
    raw = read_bytes(path, field, what, max_bytes)
    fix = "pass the model folder or its config.json, or re-download the file"
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(field, str(path), f"a {what} (UTF-8 JSON)", f"{path} is not JSON text (byte {e.start:,} "
                          f"is not UTF-8): {fix}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(field, str(path), f"a {what} (JSON)", f"{path} is not JSON text (line {e.lineno}, "
                          f"column {e.colno}: {e.msg}): {fix}") from None
    except RecursionError:
        data = None  # nested deeper than the parser goes: said below as too deep
    if data is None or json_depth(data) > MAX_JSON_DEPTH:
        raise ConfigError(field, str(path), f"JSON nested at most {MAX_JSON_DEPTH} levels deep",
                          f"{path} nests deeper: it is not a {what}; re-download it")
    if not isinstance(data, dict):
        raise ConfigError(field, str(path), f"a {what} holding one JSON object",
                          f"{path} holds a JSON {type(data).__name__}: pass the model's config.json")
    return data


def check_config(cfg: dict, where: str) -> dict:
    """``cfg`` (a config.json's object) when its size fields (:data:`CONFIG_INTS`) are integers within their limits
    and its ``torch_dtype``/``dtype`` a dtype name torch has; a multimodal ``text_config`` is checked the same way.

    Raises:
        ConfigError: ``config.json:<field>`` with the value, the accepted range and the fix naming ``where``.
    """
    for part, prefix in ((cfg, ""), (cfg.get("text_config"), "text_config.")):
        if not isinstance(part, dict):
            continue
        for key, (lo, hi) in CONFIG_INTS.items():
            _check_int(part.get(key), f"{prefix}{key}", lo, hi, where)
        for key in ("torch_dtype", "dtype"):
            _check_dtype(part.get(key), f"{prefix}{key}", where)
        _check_kv_heads(part.get("num_attention_heads"), part.get("num_key_value_heads"), prefix, where)
    return cfg


def _check_kv_heads(heads: Any, kv: Any, prefix: str, where: str) -> None:
    """Grouped-query attention shares each KV head among ``heads / kv`` query heads: transformers' ``repeat_kv`` and
    SDPA's ``enable_gqa`` need ``kv`` to divide ``heads`` (a forward of any other config fails there)."""
    if isinstance(heads, int) and isinstance(kv, int) and not isinstance(kv, bool) and kv >= 1 and heads % kv:
        raise ConfigError(f"config.json:{prefix}num_key_value_heads", kv,
                          f"a divisor of num_attention_heads ({heads}): each KV head serves the same number of query "
                          "heads", f"set {prefix}num_key_value_heads in {where} to the model's real value")


def _check_int(value: Any, key: str, lo: int, hi: int, where: str) -> None:
    """``value`` an integer in [lo, hi], or a list or object of them (per layer or per part, as some
    architectures give it)."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi):
        return
    if isinstance(value, (list, dict)) and value and json_depth(value) == 1:
        for i, item in (value.items() if isinstance(value, dict) else enumerate(value)):
            _check_int(item, f"{key}[{i}]" if isinstance(i, int) else f"{key}.{i}", lo, hi, where)
        return
    accepted = f"an integer from {lo} to {hi:,}"
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        fix = f"write {key}: {value.strip()} without quotes (a JSON number) in {where}"
    elif isinstance(value, float) and value.is_integer() and lo <= value <= hi:
        fix = f"write {key}: {int(value)} without a decimal point or exponent in {where}"
    else:
        fix = f"set {key} in {where} to the model's real value"
    raise ConfigError(f"config.json:{key}", value, accepted, fix)


def _check_dtype(value: Any, key: str, where: str) -> None:
    if value is None or isinstance(value, dict) or value == "auto" or \
            (isinstance(value, str) and value.removeprefix("torch.") in CONFIG_DTYPE_NAMES):
        return
    raise ConfigError(f"config.json:{key}", value, "a torch floating dtype name (" + ", ".join(CONFIG_DTYPE_NAMES)
                      + ") or auto", f"set {key} in {where} to the dtype the weights are stored in (e.g. bfloat16)")


def read_config(path: str | os.PathLike, field: str = "MODEL") -> dict:
    """A config.json read by :func:`read_json` and checked by :func:`check_config`."""
    return check_config(read_json(path, field, "config.json"), str(path))


def check_index(folder: Path) -> None:
    """Check a weights index (``*.safetensors.index.json``) of ``folder``: at most :data:`MAX_SHARDS` files, each
    a plain file name of the folder that exists as a regular file.

    Raises:
        ConfigError: naming the index, the count or the first file at fault, and the fix.
    """
    for index in sorted(folder.glob("*.safetensors.index.json")):
        data = read_json(index, "MODEL", "weights index (JSON)")
        weight_map = data.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ConfigError("MODEL", str(index), "an index whose weight_map maps tensor names to file names",
                              "re-download the index with the weights")
        shards = sorted(set(weight_map.values()))
        if len(shards) > MAX_SHARDS:
            raise ConfigError("MODEL", str(index), f"an index naming at most {MAX_SHARDS:,} weight files",
                              f"it names {len(shards):,}: re-download the index with the weights")
        outside = [s for s in shards if os.path.isabs(s) or ".." in Path(s).parts]
        if outside:
            raise ConfigError("MODEL", str(index), "weight files inside the model folder",
                              f"it names {outside[0]!r}, outside {folder}: re-download the index")
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise ConfigError("MODEL", str(index), "every weight file it names, present in the folder",
                              f"{len(missing):,} of {len(shards):,} are missing (first: {missing[0]}): download "
                              "them into " + str(folder))
        for s in shards:
            regular_file(folder / s, "MODEL", "safetensors file")


def weight_files_regular(folder: str | os.PathLike) -> None:
    """Every ``*.safetensors`` file and weights index of ``folder`` is a regular file (:func:`regular_file`, from
    ``stat`` alone: nothing is opened).

    Raises:
        NotAFile: naming the first that is not.
    """
    for path in sorted(Path(folder).glob("*.safetensors*")):
        regular_file(path, "MODEL", "safetensors file" if path.suffix == ".safetensors" else "weights index")


def read_text(path: str, field: str, max_bytes: int = 2**30, instead: str = "pass a regular text file") -> str:
    """The UTF-8 text of the regular file ``path`` (an option's file, e.g. ``--prompt-file``); ``instead`` ends
    the fix for a path that is no regular file.

    Raises:
        InvalidValue (naming ``field``): not a regular file, too large, binary (NUL bytes) or not UTF-8.
    """
    raw = read_bytes(path, field, "text file", max_bytes, InvalidValue, instead)
    fix = "convert it to UTF-8 text (e.g. iconv -t UTF-8), or pass a text file"
    if b"\0" in raw:
        raise InvalidValue(field, path, "a UTF-8 text file", f"it holds NUL bytes (byte {raw.index(0):,}): it is "
                           f"a binary file; {fix}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidValue(field, path, "a UTF-8 text file", f"byte {e.start:,} (0x{raw[e.start]:02x}) is not "
                           f"UTF-8; {fix}") from None


def check_sampling(temperature: float | None, top_p: float | None, top_k: int | None) -> None:
    """Raise InvalidValue for a sampling value outside what sampling can compute: ``temperature`` a finite number
    of at least :data:`MIN_TEMPERATURE`, ``top_p`` in (0, 1], ``top_k`` at least 1."""
    if temperature is not None and not MIN_TEMPERATURE <= temperature < math.inf:
        raise InvalidValue("temperature", temperature, f"a finite number >= {MIN_TEMPERATURE} (a smaller one "
                           "overflows the float32 logits to NaN)", "use temperature=0.7, or leave temperature= and "
                           "do_sample= out for greedy decoding")
    if top_p is not None and not 0 < top_p <= 1:
        raise InvalidValue("top_p", top_p, "a number in (0, 1]", "use e.g. top_p=0.9")
    if top_k is not None and top_k < 1:
        raise InvalidValue("top_k", top_k, "an integer >= 1", "use e.g. top_k=50")
