"""``check``: the environment and the load settings, each finding a value with its reason and fix.

Library entry point :func:`check` returns a :class:`CheckReport`; the CLI prints it and exits non-zero when a
finding fails. On a machine with a CUDA GPU and a local model, the attention kernel that really runs is named by
profiling one short forward (:mod:`vramguard.probe.kernels`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from vramguard.catalog.gpus import GpuSpec
from vramguard.catalog.models import MODELS
from vramguard.check.devicemap import auto_placement
from vramguard.check.rules import environment_findings, finding_line, model_findings, runtime_findings
from vramguard.errors import InvalidValue
from vramguard.finding import Finding
from vramguard.hardware import gpu_from_catalog, require_card_name
from vramguard.hub import fetched_line
from vramguard.introspect.build import attention_support, cached_config
from vramguard.plan import check_context, choose, estimate, plan
from vramguard.plan.estimator import misfit_text
from vramguard.probe.checkpoint import CheckpointInfo, hub_checkpoint_info, read_checkpoint, resolve_param_dtype
from vramguard.probe.env import Env, probe_env
from vramguard.probe.kernels import AttentionKernel, profile_attention
from vramguard.resolve import catalog_name, model_folder, resolve_model
from vramguard.runtime.handle import pin_sdpa
from vramguard.runtime.load import (LoadReport, _attention_support, _not_native, choose_attn, choose_dtypes,
                                    default_quant, load_model, unload)
from vramguard.runtime.tokenizer import folder_tokenizer
from vramguard.settings import Settings, require_bool, require_settings
from vramguard.units import fmt_gib

__all__ = ["CheckReport", "Finding", "check"]


@dataclass
class CheckReport:
    """All findings; ``failed`` is True when any has level fail."""

    findings: list[Finding]
    param_dtype: str
    gpu: GpuSpec | None
    kernel: AttentionKernel | None = None
    notes: list[str] = field(default_factory=list)
    model: str | None = None

    @property
    def failed(self) -> bool:
        return any(f.level == "fail" for f in self.findings)


def _check_arguments(model: object, settings: object, device_map: object, gpu: object, **switches: object) -> None:
    """Raise InvalidValue for an argument of :func:`check` of the wrong type or value: ``model`` not a str, a path
    or None; ``settings`` not a Settings or None; ``device_map`` not one from_pretrained takes; ``gpu`` not a card
    name or None; a switch (``verify``, ``unquantized``, ``loader_defaults``) not a bool."""
    import os
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise InvalidValue("model", model, f"a model as a str (or a path) or None, not type {type(model).__name__}",
                           "pass e.g. model='llama-3.2-1b' (a catalog name), a Hub id 'owner/name' or a model "
                           "folder; None checks the environment only")
    require_settings(settings)
    if device_map is not None and (not isinstance(device_map, str) or device_map not in (
            "auto", "balanced", "balanced_low_0", "sequential", "cpu", "cuda", "disk") and not device_map.isdigit()):
        raise InvalidValue("device_map", device_map, "auto | balanced | balanced_low_0 | sequential | cpu | cuda "
                           "| a GPU index", "pass what you give from_pretrained as device_map")
    require_card_name(gpu)
    for name, value in switches.items():
        require_bool(name, value)


def check(model: str | None = None, settings: Settings | None = None, *, dtype: str | None = None,
          compute_dtype: str | None = None, device_map: str | None = None, gpu: str | None = None,
          verify: bool = True, env: Env | None = None, unquantized: bool = False,
          loader_defaults: bool = False, revision: str | None = None, attn_unset: bool = False,
          quant_unset: bool = False) -> CheckReport:
    """Check the environment and the settings a model will be loaded with.

    Args:
        model: a local folder, config.json, cached model id or catalog name (None: environment only).
        settings: quant, attention, lengths (``settings.dtype``/``compute_dtype`` are ignored: see below).
        dtype: the ``dtype`` passed to from_pretrained; None = not passed (transformers' default decides).
        compute_dtype: ``bnb_4bit_compute_dtype``; None = not passed (bitsandbytes' default: float32).
        device_map: the ``device_map`` that will be passed (``"auto"`` is checked for silent offload).
        gpu: check against this catalog card instead of the detected one.
        verify: on a CUDA GPU with a local model, load it and name the attention kernel that runs.
        unquantized: no quantization config at all: the weights take whatever dtype ``dtype`` (or its absence)
            resolves to, which is what ``settings.quant`` is then set to.
        loader_defaults: ``dtype`` and ``compute_dtype`` left unset take what :func:`vramguard.runtime.load.load_model`
            (and so ``run`` and ``serve``) passes: bf16 where the card supports it, else fp16; False checks
            plain transformers' and bitsandbytes' defaults instead.
        revision: the Hub revision of a Hub id (read from the Hub: config and safetensors headers, no weights).
        attn_unset: no ``attn_implementation`` passed (``settings.attn`` is then not used): with ``loader_defaults``
            the one ``run`` and ``serve`` load here (:func:`vramguard.runtime.load.choose_attn`'s ``auto``), else
            sdpa, transformers' default; a finding says which was checked and why.
        quant_unset: no weight format given (``settings.quant`` is then not used): the one ``run`` and ``serve``
            load here (:func:`vramguard.runtime.load.default_quant`); a finding ``quant`` says which and why.

    Raises:
        UnknownModel, ConfigError, UnknownGpu: the model or the card cannot be read.
        InvalidValue: an argument of another type than the one named here, a ``device_map`` from_pretrained
            does not take, or a ``compute_dtype`` with weights that are not 4-bit.
    """
    _check_arguments(model, settings, device_map, gpu, verify=verify, unquantized=unquantized,
                     loader_defaults=loader_defaults, attn_unset=attn_unset, quant_unset=quant_unset)
    spec = resolve_model(model, revision) if model else None  # a bad model or card is said before the probe
    named = gpu_from_catalog(gpu) if gpu else None
    folder = model_folder(model) if model and revision is None else None
    hub_ckpt = hub_checkpoint_info(spec) if spec is not None and folder is None else None
    ckpt = read_checkpoint(folder) if folder else hub_ckpt or (  # a damaged weight file is said before the probe
        CheckpointInfo("", (), None, None, spec.checkpoint_dtype, False) if spec else None)  # imports torch
    env = env or probe_env()
    s, quant_finding = _quant(settings or Settings(attn="sdpa"), env, named, quant_unset and not unquantized,
                              compute_dtype, unquantized)
    card = named or (env.gpus[0] if env.gpus else None)
    source = "named with gpu= (catalog)" if gpu else ("detected by NVML" if card else "")
    given_dtype = dtype
    if loader_defaults and not unquantized and (dtype is None or compute_dtype is None):
        compute_dtype, dtype = _loader_dtypes(card, s, compute_dtype, dtype)
    param_dtype, why = resolve_param_dtype(dtype, ckpt, env.transformers_version,
                                           "none" if unquantized else s.quant)
    why = _default_dtype_why(card, dtype, why) if given_dtype is None and dtype is not None else why
    if unquantized:
        s = s.with_(quant=param_dtype, compute_dtype=None, dtype=None)
    compute = compute_dtype or ("fp32" if s.is_4bit else None)
    why_c = " (bnb_4bit_compute_dtype not set: bitsandbytes computes in float32)" if s.is_4bit and not compute_dtype \
        else ""
    s = s.with_(dtype=param_dtype if s.quant not in ("bf16", "fp16", "fp32") else None,
                compute_dtype=compute if s.is_4bit else None)
    findings = environment_findings(env, card, source) + quant_finding
    if attn_unset:
        s, attn_finding = _default_attn(env, card, s, spec, param_dtype, loader_defaults)
        findings.append(attn_finding)
    findings += runtime_findings(env, card, s, spec, param_dtype, why)
    findings += model_findings(spec, ckpt if folder or hub_ckpt else None, s, env, param_dtype, why, card,
                               dtype not in (None, "auto"), bool(quant_finding) and s.quant == "fp32")  # auto: stored
    findings += _attention_support_findings(spec, s)
    if folder is not None:
        findings += _tokenizer_findings(folder)
    if hub_ckpt is not None:
        findings.append(finding_line("checkpoint_read", "info", f"{spec.checkpoint.format}, "
                                     f"{len(spec.checkpoint.files)} file(s)", fetched_line(spec) or spec.source))
    if why_c:
        findings = [replace(f, message=f.message + why_c) if f.code == "compute_dtype" else f for f in findings]
    report = CheckReport(findings, param_dtype, card, model=spec.name if spec else None)
    if spec is not None:
        check_context(spec, s, beyond=" (a RoPE-scaled model may allow more: plan with context=N)")
        findings += _plan_findings(model, spec, s, card, env, device_map)
    if verify and folder is not None and env.cuda_available:
        findings.extend(_verify_kernel(str(folder), s, param_dtype, report))
    return report


def _quant(s: Settings, env: Env, named: GpuSpec | None, unset: bool, compute_dtype: str | None,
           unquantized: bool) -> tuple[Settings, list[Finding]]:
    """(settings, findings): with ``unset``, ``s`` with the weight format ``run`` and ``serve`` load
    (:func:`vramguard.runtime.load.default_quant`, one rule for all three) on the card ``named`` (a CUDA device),
    else on this machine, and the ``quant`` finding that says which and why; else ``s`` as given. Raises
    InvalidValue for a ``compute_dtype`` with weights that are not 4-bit."""
    found: list[Finding] = []
    said = ""
    if unset:
        quant, why = default_quant(named is not None or env.cuda_available)
        where = f"on the card named ({named.label})" if named is not None else "here"
        s = s.with_(quant=quant)
        said = f" (none given: vramguard run and serve load it {where}, {why.split(':')[0].split(' (')[0]})"
        found.append(finding_line("quant", "info", f"{quant} (none given)",
                                  f"the weight format vramguard run and serve load {where}: {why}"))
    if compute_dtype is not None and not s.is_4bit:
        given = "none" if unquantized else s.quant
        raise InvalidValue("compute_dtype", compute_dtype, f"unset with quant='{given}'{said}: the weights are not "
                           "4-bit", "the compute dtype applies to 4-bit weights only: pass it with quant='nf4' (or "
                           "quant='fp4')")
    return s, found


def _tokenizer_findings(folder) -> list[Finding]:
    """Whether the model folder has a tokenizer (:func:`vramguard.runtime.tokenizer.folder_tokenizer`): text
    prompts need one (``run``, the server's chat endpoint); none without transformers installed (the environment
    findings say so)."""
    try:
        tok, why = folder_tokenizer(folder)
    except ModuleNotFoundError:
        return []
    if tok is None:
        return [finding_line("tokenizer", "warn", "none in the folder", f"{why}; a text prompt needs one, token "
                             "ids do not", "save the tokenizer of the checkpoint these weights come from into the "
                             "folder (AutoTokenizer.from_pretrained(ID).save_pretrained(folder))")]
    template = "with a chat template" if getattr(tok, "chat_template", None) else "no chat template (raw prompts)"
    return [finding_line("tokenizer", "ok", f"{type(tok).__name__}, {len(tok):,} tokens", template)]


def _loader_dtypes(card, s: Settings, compute_dtype: str | None, dtype: str | None) -> tuple[str | None, str]:
    """(compute dtype, dtype) with what is unset taken as :func:`vramguard.runtime.load.choose_dtypes` chooses it.
    A bf16 given is checked as given (the bf16 finding says where it is not native): the one left unset pairs with
    it, not with the fp16 a load would put in its place on such a card."""
    asked_bf16 = "bf16" in (dtype, compute_dtype)
    cd, dt = choose_dtypes(None if asked_bf16 else card, s.quant, compute_dtype, dtype, None, False)
    return compute_dtype or (cd if s.is_4bit else None), dtype or dt


def _default_dtype_why(card, dtype: str, why: str) -> str:
    """Why a dtype nobody passed is checked (``why``: the reason :func:`resolve_param_dtype` gives for ``dtype``):
    what :func:`vramguard.runtime.load.choose_dtypes` passes, and why."""
    if not why.startswith(f"dtype={dtype} passed"):
        return why  # the dtype is not what decides (e.g. quant=bf16 weights)
    head = f"none given: vramguard run and serve pass {dtype} to from_pretrained"
    if card is not None and card.supports_bf16 is False:
        if dtype == "bf16":  # paired with a bf16 the user gave (_loader_dtypes): checked as asked
            return (f"none given: checked as bf16, paired with the bf16 given; {_not_native(card)}, so vramguard run "
                    "and serve load float16 in its place and say so")
        return f"{head}; {_not_native(card)}"
    return f"{head} (bfloat16 where the card supports it, else float16)"


def _default_attn(env: Env, card, s: Settings, spec, param_dtype: str,
                  loader_defaults: bool) -> tuple[Settings, Finding]:
    """The attention implementation checked when none is passed, and the finding that says which and why: with
    ``loader_defaults`` the one :func:`vramguard.runtime.load.choose_attn` loads for ``run`` and ``serve`` here
    (flash_attention_2 where the flash_attn package, the card, the dtype and the head_dim allow it, else sdpa, as
    ``vramguard plan --gpu`` assumes for a card of compute capability 8.0 or more), else sdpa, what a
    ``from_pretrained`` without ``attn_implementation`` loads."""
    if not loader_defaults:
        return s.with_(attn="sdpa"), finding_line("attention", "info", "sdpa (none given)", "from_pretrained without "
                                                  "attn_implementation loads sdpa, transformers' default")
    try:
        supports = _attention_support(spec) if spec is not None else None
    except ImportError:  # no transformers: the environment findings say so
        supports = None
    report = LoadReport("", {})
    attn = choose_attn("auto", env, card, param_dtype, spec.head_dim if spec is not None else 0, report, False,
                       supports or None)
    why = report.notes[-1].removeprefix(f"attention: {attn}").strip(" ()") if report.notes else ""
    if attn == "flash_attention_2":
        why = "the flash_attn package, the card, the dtype and the head_dim allow it, as vramguard plan assumes"
    elif card is not None and card.supports_flash_attn2 and "flash_attn package" in why:
        why += "; vramguard plan assumes flash_attention_2 on this card, the loader's choice where it is installed"
    return s.with_(attn=attn), finding_line("attention", "info", f"{attn} (none given)",
                                            f"vramguard run and serve load {attn} here" + (f": {why}" if why else ""))


def _plan_findings(model, spec, s: Settings, card, env, device_map) -> list[Finding]:
    """The plan's verdict for the card (or the need, without one), and where device_map='auto' would put modules."""
    if card is None:
        est = estimate(choose(spec, s).model, s)
        return [finding_line("plan", "info", f"needs {fmt_gib(est.device_used_bytes)} on the card",
                             f"the weights as run and serve load them here ({s.quant}, compute {s.act_dtype}), "
                             f"{s.prompt_tokens:,} + {s.max_new_tokens:,} tokens, batch {s.batch}; no card to "
                             "compare with", "pass gpu=NAME to check against a card")]
    v = plan(spec, s, gpus=[card], solve=False).cards[0]
    out = [finding_line("plan", "ok" if v.fits else "fail",
                        f"needs {fmt_gib(v.need_bytes)} of {fmt_gib(v.usable_bytes)}",
                        f"vramguard plan for {s.quant} weights (compute {s.act_dtype}), {s.prompt_tokens:,} + "
                        f"{s.max_new_tokens:,} tokens, batch {s.batch}"
                        + (f"; it {misfit_text(v)}" if v.misfit_reason in ("kept_free", "fragmentation") else ""),
                        None if v.fits else "run `vramguard plan` for the changes that make it fit")]
    if device_map == "auto" and v.fits:
        out.append(_placement_finding(model, spec, s, card, env))
    return out


def _attention_support_findings(spec, s: Settings) -> list[Finding]:
    """A failing finding when the model's class refuses the requested attention implementation (its own
    ``_supports_sdpa`` / ``_supports_flash_attn``, :func:`vramguard.introspect.build.attention_support`)."""
    if spec is None or not spec.config_json or s.attn == "eager":
        return []
    try:
        supports = attention_support(cached_config(spec.config_json, spec.name))
    except ImportError:
        return []
    if supports.get(s.attn, True):
        return []
    other = " or ".join(a for a in ("sdpa", "flash_attention_2") if a != s.attn and supports.get(a))
    return [finding_line("attn_supported", "fail", f"{s.attn} refused by the model class",
                         f"transformers' class for {spec.model_type} does not accept attn_implementation={s.attn}",
                         "pass attn=eager" + (f" (or {other}, where it can run)" if other else ""))]


def _placement_finding(model, spec, s, card, env) -> Finding:
    import json
    key = catalog_name(model) if model else None
    if key:
        cfg = dict(MODELS[key])
    else:
        folder = model_folder(model)
        cfg = json.loads((folder / "config.json").read_text()) if folder else (
            json.loads(spec.config_json) if spec.config_json else {})
    try:
        pl = auto_placement(cfg, s, card.usable_bytes, env.ram_available_bytes or 0)
    except Exception as e:  # accelerate cannot build this config: say so instead of guessing
        return finding_line("device_map", "info", "auto", f"placement unknown ({type(e).__name__}: {e})")
    if pl is None:
        return finding_line("device_map", "info", "auto", "placement unknown: torch/accelerate not installed")
    if pl.offloaded:
        names = ", ".join(list(pl.offloaded)[:4]) + (" ..." if len(pl.offloaded) > 4 else "")
        return finding_line("device_map", "warn", f"{len(pl.offloaded)} modules off the GPU: {names}",
                            f"device_map='auto' keeps ~10% of GPU memory back ({pl.reason}) and offloads to "
                            "CPU/disk although the plan says the model fits, making generation many times slower",
                            "pass device_map={'': 0} (or load with vramguard's load_model)")
    return finding_line("device_map", "ok", "auto: every module on the GPU", pl.reason)


def _verify_kernel(folder: str, s: Settings, param_dtype: str, report: CheckReport) -> list[Finding]:
    """Load with the requested settings (no automatic choice), profile one forward, unload: the attention kernel
    finding, and the unload finding (memory back to the pre-load baseline, or what still holds it)."""
    attn = s.attn
    try:
        loaded = load_model(folder, quant=s.quant, double_quant=s.double_quant,
                            compute_dtype=s.resolved_compute_dtype if s.is_4bit else None,
                            dtype=param_dtype, attn=attn, strict=True, verify=False)
    except Exception as e:  # the load itself failing is the finding: name the exception
        return [finding_line("attention_kernel", "fail", f"{attn}: the model did not load",
                             f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                             "use attn_implementation='sdpa'" if attn == "flash_attention_2" else None)]
    pinned = s.sdpa_kernel if attn == "sdpa" and s.sdpa_kernel != "auto" else None
    weights = loaded.report.weights_bytes
    try:
        if pinned:
            pin_sdpa(loaded.model, pinned)
        k = profile_attention(loaded.model, attn if attn != "auto" else "sdpa", pinned=pinned)
    except Exception as e:
        return [finding_line("attention_kernel", "fail", f"{attn}: the forward failed",
                             f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"),
                _unload_finding(unload(loaded), weights)]
    report.kernel = k
    return [finding_line("attention_kernel", "ok" if k.matches_request else "warn", k.label,
                         k.reason + ("; kernels: " + ", ".join(k.evidence[:2]) if k.evidence else ""),
                         None if k.matches_request else "see `vramguard check` findings for what forces this path"),
            _unload_finding(unload(loaded), weights)]


def _unload_finding(rep, weights_bytes: int | None) -> Finding:
    """The unload after verification: memory back to the baseline (ok), or the residual and its holders (warn)."""
    ok = rep.returned(weights_bytes)
    return finding_line("unload", "ok" if ok or ok is None else "warn",
                        "memory returned" if ok else ("not measured" if ok is None else "memory not returned"),
                        rep.describe(weights_bytes),
                        None if ok or ok is None else "in a long-lived process, free models with "
                        "vramguard.runtime.load.unload (it breaks the reference cycles gc.collect() would) and drop "
                        "your own references to the tensors named")