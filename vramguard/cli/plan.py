"""``vramguard plan``: the prediction before loading, and the catalog listings (over :func:`vramguard.plan.plan`)."""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field
from typing import Optional

import typer

from vramguard.catalog.gpus import GPUS
from vramguard.catalog.models import MODELS
from vramguard.cli import engine as eng
from vramguard.cli.common import no_teardown_needed, run_guarded, say, write_json
from vramguard.cli.options import (DEFAULT_MAX_NEW_TOKENS, DEFAULT_PROMPT_TOKENS, Attn, Cache, Dtype, Format, Kernels,
                                   KvDtype, Logits, Quant, batch_option, format_option, max_new_tokens_option,
                                   prompt_tokens_option, quant_option, revision_option, say_fetched)
from vramguard.cli.multigpu import (defaults_card, device_map_option, emit, gpus_option, max_memory_option, plan_cards,
                                    tp_option, wants_cards)
from vramguard.cli.render import console, plan_to_json, print_plan, to_jsonable
from vramguard.deferred import unused_by_plans
from vramguard.errors import InvalidValue
from vramguard.finding import Finding
from vramguard.hardware import card_defaults
from vramguard.plan import plan as plan_fn
from vramguard.plan.planner import AUTO
from vramguard.resolve import resolve_model
from vramguard.settings import MAX_TOKENS, Settings, require_count
from vramguard.units import MAX_CARD_BYTES, decimal_size_note, parse_card_size, parse_size


HELP = """Predict memory by component, say whether it fits, solve for what fits, and rank the fixes.

Speed (what is imported): a catalog name, or a folder, config.json or Hub id, of the llama, qwen2 and mistral
families without sliding-window layers is planned without torch or transformers, the load and the allocator model
included (with a dynamic cache, unpadded prompts, sdpa or eager attention: the defaults; about two CPU seconds the
first time). The other hand-modelled families (mixtral, qwen2_moe, qwen3, qwen3_moe, gemma, gemma2, gemma3_text,
phi3, a sliding window) are read without them, but their first plan imports both for the load and the allocator
model, as does every other setting and architecture (seconds to tens of seconds). A plan is kept on disk
(VRAMGUARD_PLAN_CACHE=0 turns that off), so the same plan again, in any process, takes about a second and imports
neither."""
ATTN_HELP = ("attn_implementation (default: flash_attention_2 on a --gpu card of compute capability 8.0 or more, "
             "sdpa below it or with no card named)")
GPU_HELP = ("a catalog card (see --list-gpus) or the name nvidia-smi prints, e.g. h100 or \"NVIDIA GeForce RTX "
            "4090\" (cards used together: rtx-4090,rtx-4090)")
ALLOC_CONF_HELP = ("PYTORCH_CUDA_ALLOC_CONF of the caching-allocator model ('default', expandable_segments:True...; "
                   "'formula': the reserve formula, faster, short of the edge); without it: this shell's, with torch "
                   "installed")
KERNELS_HELP = ("path of Mamba scans, causal convolutions, gated delta rules on the target: installed (this "
                "machine's mamba_ssm, causal_conv1d, fla), fast (those packages' kernels), torch (reference PyTorch); "
                "default: installed on this machine's GPU, else both, the larger kept")
FREED_BEFORE_HELP = ("plan for a process that has deleted a model and called torch.cuda.empty_cache() (a notebook): "
                     "both segment layouts cudaMalloc gives there, judged on the worse (one card, the allocator "
                     "model: needs torch)")


def plan(
    ctx: typer.Context,
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                          help="model folder, config.json, catalog name or Hub id (owner/name)"),
    revision: Optional[str] = revision_option(),
    quant: Quant = quant_option(),
    double_quant: bool = typer.Option(True, "--double-quant/--no-double-quant", help="4-bit double quantization"),
    compute_dtype: Optional[Dtype] = typer.Option(None, help="4-bit compute dtype (default: the model dtype)"),
    dtype: Optional[Dtype] = typer.Option(None, help="model dtype (default bf16; fp16/fp32 for those quants)"),
    attn: Optional[Attn] = typer.Option(None, help=ATTN_HELP),
    kv_dtype: Optional[KvDtype] = typer.Option(None, help="KV cache type (int8/int4: quantized cache)"),
    kernels: Optional[Kernels] = typer.Option(None, help=KERNELS_HELP),
    cache: Cache = typer.Option(Cache['dynamic'], help="KV cache kind"),
    batch: int = batch_option(),
    num_beams: int = typer.Option(1, help="beams per prompt"),
    num_return_sequences: int = typer.Option(1, help="sequences returned per prompt"),
    prompt_tokens: int = prompt_tokens_option(),
    max_new_tokens: int = max_new_tokens_option(),
    prefill_chunk: Optional[int] = typer.Option(None, help="chunked prefill: tokens per forward"),
    logits: Logits = typer.Option(Logits['last'], help="last: generate(); all: a forward over every position"),
    output_attentions: bool = typer.Option(False, help="attention maps requested (forces eager)"),
    padded: bool = typer.Option(False, help="prompts of different lengths in one batch"),
    do_sample: bool = typer.Option(False, help="sampling (allows --num-return-sequences > 1 without beams)"),
    context: Optional[int] = typer.Option(None, help="context length to allow (RoPE-scaled models beyond config)"),
    gpu: Optional[str] = typer.Option(None, help=GPU_HELP),
    vram: Optional[str] = typer.Option(None, help="card memory, e.g. 24GiB, 24GB, 24000MiB (several: 24GiB,16GiB)"),
    gpus: Optional[int] = gpus_option(),
    tp: Optional[int] = tp_option(),
    device_map: str = device_map_option(),
    max_memory: Optional[str] = max_memory_option(),
    alloc_conf: Optional[str] = typer.Option(None, help=ALLOC_CONF_HELP),
    freed_before: bool = typer.Option(False, "--freed-before", help=FREED_BEFORE_HELP),
    fmt: Format = format_option(),
    list_models: bool = typer.Option(False, "--list-models", help="list the catalog architectures and exit"),
    list_gpus: bool = typer.Option(False, "--list-gpus", help="list the catalog cards and exit"),
    exit_code: bool = typer.Option(False, "--exit-code", help="exit 1 when the run fits none of the cards"),
    engine: eng.Engine = eng.engine_option(), pp: int = eng.pp_option(),
    gpu_memory_utilization: float = eng.util_option(), max_model_len: Optional[int] = eng.max_model_len_option(),
    kv_cache_dtype: eng.KvCacheDtype = eng.kv_cache_dtype_option(),
    max_num_seqs: Optional[int] = eng.max_num_seqs_option(),
    max_num_batched_tokens: Optional[int] = eng.max_num_batched_tokens_option(),
    vllm_version: Optional[str] = eng.vllm_version_option(), enable_lora: bool = eng.enable_lora_option(),
    max_lora_rank: int = eng.max_lora_rank_option(), max_loras: int = eng.max_loras_option(),
    quantization: Optional[eng.VllmQuantization] = eng.quantization_option(),
) -> None:
    """Predict memory by component, say whether it fits, solve for what fits, and rank the fixes."""
    req = PlanRequest.of(ctx)
    if req.list_models or req.list_gpus:
        return _listing(ctx, req.model, req.as_json)
    if req.engine == eng.Engine['vllm'].value:
        return _plan_vllm(req)
    run_guarded(eng.refuse_vllm_options, req.engine_args)
    notes: list[str] = []  # said once the plan is made: an error comes alone
    findings: list[Finding] = []  # of the CLI's own, added to a plan of cards used together
    with unused_by_plans(), _collector_paused():  # a plan runs no TorchDynamo, accelerate or SciPy: not imported
        p = run_guarded(lambda: _build(req, notes, findings), as_json=req.as_json, progress=f"planning {req.model}")
    no_teardown_needed()  # the plan is kept on disk already: what is left is printing it
    _emit(p, req, notes, findings)


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while the plan is made (as it was after): importing torch and
    transformers makes hundreds of thousands of long-lived objects and next to no reference cycles, and each full
    pass of the collector over them finds nothing to free (0.4 to 0.8 CPU s of a first generic plan;
    benchmarks/README.md). A plan's figures do not depend on the collector (tests/test_replay_trim.py replays with
    it off; the frame cycles a package imported in the middle of a traced forward leaves are collected by
    :func:`vramguard.deferred._real`, tests/test_hybrid.py compares this command's figures with the library's)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@dataclass(frozen=True)
class PlanRequest:
    """What ``vramguard plan`` was asked: each option's value as parsed (a choice as its string), built once from
    the command's parameters (:meth:`of`); every step below the command reads it.

    Attributes:
        given: the options set on the command line or in the environment, by parameter name (their values as
            typer parsed them); the rest of the fields are the command's parameters by the same names.
    """

    model: str | None
    revision: str | None
    quant: str
    double_quant: bool
    compute_dtype: str | None
    dtype: str | None
    attn: str | None
    kv_dtype: str | None
    kernels: str | None
    cache: str
    batch: int
    num_beams: int
    num_return_sequences: int
    prompt_tokens: int
    max_new_tokens: int
    prefill_chunk: int | None
    logits: str
    output_attentions: bool
    padded: bool
    do_sample: bool
    context: int | None
    gpu: str | None
    vram: str | None
    gpus: int | None
    tp: int | None
    device_map: str
    max_memory: str | None
    alloc_conf: str | None
    freed_before: bool
    fmt: str
    list_models: bool
    list_gpus: bool
    exit_code: bool
    engine: str
    pp: int
    gpu_memory_utilization: float
    max_model_len: int | None
    kv_cache_dtype: str
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    vllm_version: str | None
    enable_lora: bool
    max_lora_rank: int
    max_loras: int
    quantization: str | None
    given: dict[str, object] = field(default_factory=dict)

    @classmethod
    def of(cls, ctx: typer.Context) -> PlanRequest:
        """The request of the command ``ctx`` runs (``ctx.params``: each parameter by name)."""
        return cls(**{k: getattr(v, "value", v) for k, v in ctx.params.items()}, given=_given(ctx))

    @property
    def as_json(self) -> bool:
        return self.fmt == Format['json'].value

    @property
    def several(self) -> bool:
        """Whether cards used together are planned (several cards, a tensor-parallel size, a device map...)."""
        return (wants_cards(self.gpus, self.tp, self.gpu, self.vram) or self.max_memory is not None
                or self.device_map != "auto")

    @property
    def engine_args(self) -> eng.EngineArgs:
        """The vLLM options as given (``--tp`` and ``--dtype`` are options of both plans)."""
        return eng.EngineArgs(self.tp or 1, self.pp, self.gpu_memory_utilization, self.max_model_len,
                              self.kv_cache_dtype, self.max_num_seqs, self.max_num_batched_tokens, self.dtype, None,
                              self.vllm_version, self.enable_lora, self.max_lora_rank, self.max_loras,
                              self.quantization)

    def settings(self, attn: str, dtype: str | None) -> Settings:
        """The run's :class:`~vramguard.settings.Settings` with the attention and dtype chosen for the card."""
        return Settings(quant=self.quant, double_quant=self.double_quant, compute_dtype=self.compute_dtype,
                        dtype=dtype, attn=attn, kv_dtype=self.kv_dtype, cache=self.cache, batch=self.batch,
                        num_beams=self.num_beams, num_return_sequences=self.num_return_sequences,
                        prompt_tokens=self.prompt_tokens, max_new_tokens=self.max_new_tokens,
                        prefill_chunk=self.prefill_chunk, logits=self.logits, output_attentions=self.output_attentions,
                        padded=self.padded, do_sample=self.do_sample, kernels=self.kernels)


def _build(req: PlanRequest, notes: list[str], findings: list[Finding]):
    """The plan ``req`` asks for (of one card, or of cards used together), its notes added to ``notes`` and, for
    cards used together, the CLI's own findings to ``findings``."""
    _refuse_no_new_tokens(req.max_new_tokens, req.logits)
    chosen_attn, chosen_dtype = _card_defaults(req, notes)
    s = req.settings(chosen_attn, chosen_dtype)
    spec = resolve_model(_required_model(req.model), req.revision)
    say_fetched(spec)
    s = _defaults_in_context(spec, s, req.given, req.context, notes)
    if req.several:
        findings.extend(_one_card_findings(req.freed_before, req.alloc_conf, notes))
        return plan_cards(spec, s, (req.gpus, req.tp, req.gpu, req.vram), req.context, req.device_map,
                          req.max_memory)
    return plan_fn(spec, s, gpu=req.gpu, vram=req.vram, context=req.context, alloc_conf=_alloc_conf(req.alloc_conf),
                   freed_before=req.freed_before)


def _one_card_findings(freed_before: bool, alloc_conf: str | None, notes: list[str]) -> list:
    """The finding (code ``freed_before`` or ``alloc_conf``) of a plan of cards used together given an option
    that plans one card only, its note added to ``notes`` (said on stderr once the plan is made: a plan that fails
    says its error alone); [] without one."""
    if not (freed_before or (alloc_conf is not None and _alloc_conf(alloc_conf) is not None)):
        return []
    code = "freed_before" if freed_before else "alloc_conf"
    flag = "--" + code.replace("_", "-")
    notes.append(f"note: {flag} plans one card; cards used together are planned with the reserve formula")
    return [Finding(code, "warn", f"{flag} not applied for several cards: it plans one card; cards used together "
                    "are planned with the reserve formula", f"plan one card (one --gpu or --vram) to apply {flag}")]


LISTINGS = ("list_models", "list_gpus", "fmt")  # the options a catalog listing reads


def _listing(ctx: typer.Context, model: str | None, as_json: bool) -> None:
    """The catalog listing of --list-models / --list-gpus, after a note on stderr naming the model and the options
    given with it: a listing reads none of them (only --format)."""
    ignored = [f"MODEL {model!r}"] if model is not None else []
    for param in ctx.command.params:
        if param.name in _given(ctx) and param.name not in LISTINGS and param.name != "model":
            value = ctx.params[param.name]
            if param.is_flag:
                ignored.append((param.secondary_opts if param.secondary_opts and value is False else param.opts)[0])
            else:
                ignored.append(f"{param.opts[0]} {str(getattr(value, 'value', value))!r}")
    if ignored:
        listing = " and ".join(f for f, on in (("--list-models", ctx.params["list_models"]),
                                                ("--list-gpus", ctx.params["list_gpus"])) if on)
        say(f"note: {listing} lists the catalog and exits; ignored: {', '.join(ignored)}")
    _print_catalog(ctx.params["list_models"], ctx.params["list_gpus"], as_json)


def _refuse_no_new_tokens(max_new_tokens: int, logits: str) -> None:
    """The usage error of a plan of generate (``logits="last"``) with no new tokens, worded as ``run``'s, and of
    one above :data:`~vramguard.settings.MAX_TOKENS` stating the same range from 1 (Settings' own check says it
    from 0); a forward over every position (``logits="all"``) may generate none."""
    if logits == "last":
        require_count("max_new_tokens", max_new_tokens, 1, "pass a whole number of at least 1 (or --logits all "
                      "for a forward without generating)")
        require_count("max_new_tokens", max_new_tokens, 1, maximum=MAX_TOKENS)


def _defaults_in_context(spec, s, given: dict, context: int | None, notes: list[str]):
    """``s``, or, when neither --prompt-tokens nor --max-new-tokens was given and their defaults exceed the
    model's context ``ctx`` (``context`` when given, else ``max_position_embeddings``), ``s`` with a prompt of
    ``ctx // 3`` and ``2 * (ctx // 3)`` new tokens (the defaults' 1:2 ratio), the change added to ``notes``.
    A length the user gave is kept, and over the context it stays an error."""
    from dataclasses import replace
    ctx_tokens = context if isinstance(context, int) and context > 0 else spec.max_position_embeddings
    if {"prompt_tokens", "max_new_tokens"} & set(given) or s.total_tokens <= ctx_tokens or ctx_tokens < 3:
        return s
    prompt, new = ctx_tokens // 3, 2 * (ctx_tokens // 3)
    notes.append(f"note: the default --prompt-tokens {DEFAULT_PROMPT_TOKENS} + --max-new-tokens "
                 f"{DEFAULT_MAX_NEW_TOKENS} exceed "
                 + (f"the --context {ctx_tokens:,} you set" if ctx_tokens == context else
                    f"the model's context of {ctx_tokens:,} tokens") + "; planned with "
                 f"{prompt:,} + {new:,} (a third and two thirds of it); pass --prompt-tokens and --max-new-tokens "
                 "to choose")
    return replace(s, prompt_tokens=prompt, max_new_tokens=new)


def _required_model(model: str | None) -> str:
    """``model``, or the usage error of a plan with none named, with examples of each accepted form."""
    if model is not None:
        return model
    raise InvalidValue("MODEL", "none given", "a model folder, its config.json, a catalog name or a Hub id",
                       "name the model to plan, e.g. vramguard plan meta-llama/Llama-3.1-8B-Instruct, vramguard "
                       "plan ./my-model or vramguard plan llama-3.1-8b (vramguard plan --list-models lists the "
                       "catalog)")


def _given(ctx: typer.Context) -> dict[str, object]:
    """The options given on the command line (or in the environment), by parameter name, with their values."""
    given = ("COMMANDLINE", "ENVIRONMENT")  # by name: typer may vendor its own click and its ParameterSource
    return {name: value for name, value in ctx.params.items()
            if getattr(ctx.get_parameter_source(name), "name", None) in given}


def _card_defaults(req: PlanRequest, notes: list[str]) -> tuple[str, str | None]:
    """The attention and dtype the named card runs by default (each default added to ``notes``, to be said on
    stderr), and the note on a decimal --vram size."""
    chosen_attn, chosen_dtype, found = card_defaults(defaults_card(req.gpu), req.attn, req.dtype,
                                                     req.compute_dtype is not None)
    notes += found
    vram = req.vram
    sizes = [x for x in ((vram or "").split(",") if req.several else [vram]) if x and x.strip()]
    _refuse_sizes_above_any_card(sizes)
    for size in sizes:
        if decimal_size_note(size.strip()):
            notes.append("note: " + decimal_size_note(size.strip()))
    return chosen_attn, chosen_dtype


def _refuse_sizes_above_any_card(sizes: list[str]) -> None:
    """Raise for a size above any card (:func:`~vramguard.units.parse_card_size`) before any note is said; a size
    that does not parse is left to the cards' own reading, whose error knows the whole list."""
    for size in sizes:
        try:
            value = parse_size(size.strip(), "vram")
        except InvalidValue:
            continue
        if value > MAX_CARD_BYTES:
            parse_card_size(size.strip(), "vram")


def _plan_vllm(req: PlanRequest) -> None:
    """``plan --engine vllm``: vLLM's plan per card, printed; exit 1 with ``--exit-code`` when none starts. The
    options set on the command line that only the transformers plan reads are refused."""
    from vramguard.cli.vllm import build_plans, print_plans  # vLLM's memory model: loaded when the command runs
    run_guarded(eng.refuse_transformers_options, req.given)
    args = run_guarded(eng.with_quantization, req.engine_args, req.given, as_json=req.as_json)
    plans = run_guarded(lambda: build_plans(_required_model(req.model), req.gpu, req.vram, args), as_json=req.as_json)
    print_plans(plans, req.model, req.as_json)
    if req.exit_code and not any(p.starts for p in plans):
        raise typer.Exit(1)


def _emit(p, req: PlanRequest, notes: list[str], findings: list) -> None:
    """Say ``notes`` on stderr, print a plan (JSON or the tables; ``findings``, of cards used together, in its
    JSON); exit 1 with ``--exit-code`` when it fits none of the cards."""
    for note in notes:
        say(note)
    if req.several:
        return emit(p, req.as_json, req.exit_code, findings)
    if req.as_json:
        write_json(plan_to_json(p))
    else:
        print_plan(p, console())
    if req.exit_code and not any(c.fits for c in p.cards):
        raise typer.Exit(1)


def _alloc_conf(given: str | None) -> str | None:
    """The allocator setting to plan with: the option ('default' is the default allocator, 'formula' the reserve
    formula), or, without it, the plan's own default (the allocator model where it can run)."""
    if given is None:
        return AUTO
    word = given.strip().lower()
    return "" if word == "default" else None if word == "formula" else given


def _print_catalog(models: bool, gpus: bool, as_json: bool = False) -> None:
    """The catalog's architectures and cards as tables, or as JSON: a list of objects (each card with its total
    in bytes), or, both asked, one object of the two lists."""
    if as_json:
        lists = {"models": [{"name": name, "source": cfg["source"]} for name, cfg in MODELS.items()] if models
                 else None, "gpus": [to_jsonable(g) for g in GPUS.values()] if gpus else None}
        return write_json(lists if models and gpus else lists["models"] if models else lists["gpus"])
    out = console()
    if models:
        for name, cfg in MODELS.items():
            out.print(f"{name:18} {cfg['source']}")
    if gpus:
        for g in GPUS.values():
            cc = ".".join(map(str, g.compute_capability)) if g.compute_capability else "?"
            total = ("~" if g.total_estimated else "") + f"{g.total_bytes / 2**30:.2f}"
            out.print(f"{g.name:18} {g.label:34} {total:>7} GiB  cc {cc}")
        if any(g.total_estimated for g in GPUS.values()):
            out.print("~ estimated: no driver report of this card's total was found (the catalog says from which "
                      "card it is derived); --vram with the card's own total plans exactly")
