"""``vramguard check``: the environment and load settings, and the kernel that runs (over
:func:`vramguard.check.check`)."""

from __future__ import annotations

from typing import Optional

import typer

from vramguard.check import check as check_fn
from vramguard.cli.common import run_guarded, write_json
from vramguard.cli.options import (Attn, CheckQuant, Dtype, DtypeArg, Format, SdpaKernel, batch_option,
                                   format_option, max_new_tokens_option, prompt_tokens_option, revision_option)
from vramguard.cli.render import check_to_json, console, print_check
from vramguard.settings import Settings


def check(
    model: Optional[str] = typer.Argument(None, metavar="MODEL",
                                 help="model folder, config.json, catalog name or Hub id (owner/name)"),
    revision: Optional[str] = revision_option(),
    quant: Optional[CheckQuant] = typer.Option(None, help="weight format; none: no quantization config, the dtype "
                                               "then decides (unset: what vramguard run/serve load here: nf4 on a "
                                               "CUDA device, else fp32)"),
    double_quant: bool = typer.Option(True, "--double-quant/--no-double-quant", help="4-bit double quantization"),
    compute_dtype: Optional[Dtype] = typer.Option(None, help="bnb_4bit_compute_dtype you pass (unset: what "
                                                             "vramguard run/serve pass, bf16 where supported else "
                                                             "fp16)"),
    dtype: Optional[DtypeArg] = typer.Option(None, help="dtype you pass to from_pretrained (unset: what vramguard "
                                                         "run/serve pass)"),
    transformers_defaults: bool = typer.Option(False, "--transformers-defaults",
                                               help="check plain from_pretrained's defaults for what you leave "
                                                    "unset (bitsandbytes computes in float32) instead of "
                                                    "vramguard's"),
    attn: Optional[Attn] = typer.Option(None, help="attn_implementation you pass (unset: what vramguard run/serve "
                                        "load: flash_attention_2 where flash_attn, the card and the dtype allow it, "
                                        "else sdpa; with --transformers-defaults, sdpa)"),
    sdpa_kernel: SdpaKernel = typer.Option(SdpaKernel['auto'], help="SDPA backend you pin (torch.nn.attention."
                                                                 "sdpa_kernel)"),
    output_attentions: bool = typer.Option(False, help="attention maps requested"),
    device_map: Optional[str] = typer.Option(None, help="device_map you pass (auto is checked for offload)"),
    batch: int = batch_option(),
    prompt_tokens: int = prompt_tokens_option(),
    max_new_tokens: int = max_new_tokens_option(),
    gpu: Optional[str] = typer.Option(None, help="check against a card instead of the detected one: a catalog name "
                                                 "(vramguard plan --list-gpus) or the name nvidia-smi prints"),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="on a GPU: load and name the kernel that runs"),
    fmt: Format = format_option(),
) -> None:
    """Check the environment and the load settings; name the attention kernel that really runs (GPU).
    Exits 1 when a finding fails."""

    def build():
        q = "bf16" if quant in (None, CheckQuant['none']) else quant.value  # unset: the library's default_quant
        s = Settings(quant=q, double_quant=double_quant, attn=attn.value if attn else "sdpa",
                     sdpa_kernel=sdpa_kernel.value, batch=batch, prompt_tokens=prompt_tokens,
                     max_new_tokens=max_new_tokens, output_attentions=output_attentions)
        return check_fn(model, s, dtype=dtype.value if dtype else None,
                        compute_dtype=compute_dtype.value if compute_dtype else None, device_map=device_map,
                        gpu=gpu, verify=verify, unquantized=quant == CheckQuant['none'],
                        loader_defaults=not transformers_defaults, revision=revision, attn_unset=attn is None,
                        quant_unset=quant is None)

    r = run_guarded(build, as_json=fmt == Format['json'], progress=f"checking {model}")
    if fmt == Format['json']:
        write_json(check_to_json(r))
    else:
        print_check(r, console())
    if r.failed:
        raise typer.Exit(1)
