"""Hub ids planned from config.json and safetensors headers, through huggingface_hub's real HTTP calls to a Hub on
loopback (tests/hubserver.py) reached through HF_ENDPOINT; the bytes it sends are counted (no weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hubserver import TOKEN, Repo, serve

from vramguard.errors import HubError
from vramguard.memory.weights import rounded

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors import safe_open
from safetensors.torch import save_file

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024)
LINEARS = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
           "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 128), "mlp.up_proj": (64, 128),
           "mlp.down_proj": (128, 64)}  # (in_features, out_features)
MAX_SENT = 3 * 2**20  # a few MB at most per repo: metadata only


def _llama_config(**extra) -> dict:
    import transformers
    cfg = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False).to_dict()
    cfg.update(dtype="float16", architectures=["LlamaForCausalLM"], **extra)
    return cfg


def _unquantized(layer_tensors) -> dict:
    """Embeddings, norms and lm_head of the tiny Llama, fp16, plus each layer's ``layer_tensors(prefix)``."""
    t = {"model.embed_tokens.weight": torch.zeros(512, 64, dtype=torch.float16),
         "model.norm.weight": torch.ones(64, dtype=torch.float16),
         "lm_head.weight": torch.zeros(512, 64, dtype=torch.float16)}
    for i in range(2):
        t[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(64, dtype=torch.float16)
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = torch.ones(64, dtype=torch.float16)
        for name, (fin, fout) in LINEARS.items():
            t.update(layer_tensors(f"model.layers.{i}.{name}", fin, fout))
    return t


def _gptq(prefix: str, fin: int, fout: int) -> dict:
    """AutoGPTQ's 4-bit layout, group size 32: qweight (in/8, out), qzeros (in/32, out/8), scales (in/32, out),
    g_idx (in,)."""
    return {f"{prefix}.qweight": torch.zeros(fin // 8, fout, dtype=torch.int32),
            f"{prefix}.qzeros": torch.zeros(fin // 32, fout // 8, dtype=torch.int32),
            f"{prefix}.scales": torch.ones(fin // 32, fout, dtype=torch.float16),
            f"{prefix}.g_idx": torch.zeros(fin, dtype=torch.int32)}


def _fp8(prefix: str, fin: int, fout: int) -> dict:
    """Fine-grained FP8 (transformers' FP8Linear): weight float8_e4m3 (out, in), weight_scale_inv float32 per
    32 x 32 block."""
    return {f"{prefix}.weight": torch.zeros(fout, fin, dtype=torch.float8_e4m3fn),
            f"{prefix}.weight_scale_inv": torch.ones(fout // 32, fin // 32, dtype=torch.float32)}


def _write(folder: Path, config: dict, tensors: dict | None = None, weights: str = "model.safetensors",
           **files: bytes) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    if tensors is not None:
        save_file(tensors, str(folder / weights), metadata={"format": "pt"})
    for name, data in files.items():
        (folder / name.replace("__", ".")).write_bytes(data)
    return folder


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    import transformers
    root = tmp_path_factory.mktemp("hub")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**LLAMA)).to(torch.float16)
    model.save_pretrained(root / "public")
    wide = transformers.LlamaConfig(**{**LLAMA, "hidden_size": 128, "intermediate_size": 256, "head_dim": 32})
    transformers.AutoModelForCausalLM.from_config(wide).to(torch.float16).save_pretrained(
        root / "sharded", max_shard_size="300KB")  # 3 shards of 263-296 kB
    gptq_q = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    fp8_q = {"quant_method": "fp8", "weight_block_size": [32, 32], "activation_scheme": "dynamic"}
    repos = {"acme/tiny-llama": Repo(root / "public"), "acme/gated-llama": Repo(root / "public", gated=True),
             "acme/tiny-llama-sharded": Repo(root / "sharded"),
             # named as AutoGPTQ names it: not model.safetensors, no index (parse_safetensors_file_metadata)
             "acme/tiny-llama-gptq": Repo(_write(root / "gptq", _llama_config(quantization_config=gptq_q),
                                                 _unquantized(_gptq), "gptq_model-4bit-32g.safetensors")),
             "acme/tiny-llama-fp8": Repo(_write(root / "fp8", _llama_config(quantization_config=fp8_q),
                                                _unquantized(_fp8))),
             "acme/tiny-llama-bin": Repo(_write(root / "bin", _llama_config(), None,
                                                pytorch_model__bin=b"\x80" * 600_000))}
    state, server = serve(repos)
    yield state
    server.shutdown()


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """The loopback Hub as HF_ENDPOINT, an empty Hugging Face cache and header cache, no token, not offline."""
    import huggingface_hub.constants as c
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(c, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setenv("VRAMGUARD_CACHE_DIR", str(tmp_path / "vg"))
    return hub


def _stored(folder: Path) -> list[tuple[str, str, tuple, int]]:
    """(name, dtype, shape, bytes) of every tensor, read with the safetensors library itself."""
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                out.append((k, str(t.dtype), tuple(t.shape), t.numel() * t.element_size()))
    return out


def _header_end(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _assert_headers_only(hub, repo: str, folder: Path) -> None:
    """Each safetensors file got at most huggingface_hub's header ranges; the repo's bytes stay under MAX_SENT."""
    for f in folder.glob("*.safetensors"):
        limit = max(100_001, _header_end(f))
        for start, end in hub.ranges.get((repo, f.name), []):
            assert end < limit, (f.name, start, end, limit)
        assert f.stat().st_size > 100_001  # so that a whole-file read would show
    assert 0 < hub.sent_bytes[repo] < MAX_SENT


def test_public_repo_is_planned_from_its_headers_over_http(online):
    """huggingface_hub 1.33 and 2.4 both read HF_ENDPOINT once, at import (``constants.ENDPOINT``): vramguard reads
    it at each call and passes ``endpoint=`` to huggingface_hub, so the loopback Hub set after import is the one
    asked."""
    import huggingface_hub.constants as c

    from vramguard.hub.fetch import endpoint
    from vramguard.resolve import resolve_model
    assert c.ENDPOINT != online.url and endpoint() == online.url
    folder = online.repos["acme/tiny-llama"].folder
    spec = resolve_model("acme/tiny-llama", revision="main")
    ck = spec.checkpoint
    assert spec.source == f"hub:acme/tiny-llama@{online.repos['acme/tiny-llama'].commit[:12]}"
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (2, 64, 512)
    stored = _stored(folder)
    assert sorted((t.name, t.shape, t.nbytes) for t in ck.tensors) == sorted((n, s, b) for n, _, s, b in stored)
    assert ck.header_bytes == _header_end(folder / "model.safetensors")
    got = {f.what: f for f in ck.fetched}
    sent = sum(e - s + 1 for s, e in online.ranges[("acme/tiny-llama", "model.safetensors")])
    assert got["model.safetensors header"].nbytes == sent == 100_001  # one range, bytes=0-100000
    assert got["config.json"].origin == "network" and got["generation_config.json"].origin == "network"
    _assert_headers_only(online, "acme/tiny-llama", folder)
    # again: config from the Hugging Face cache, headers from vramguard's header cache, no header range requested
    n_ranges = len(online.ranges[("acme/tiny-llama", "model.safetensors")])
    again = resolve_model("acme/tiny-llama", revision="main").checkpoint
    assert len(online.ranges[("acme/tiny-llama", "model.safetensors")]) == n_ranges
    assert {f.origin for f in again.fetched} == {"cache"} and again.tensors == ck.tensors
    from vramguard.plan import plan
    from vramguard.settings import Settings
    p = plan(spec, Settings(quant="bf16"), vram="8GiB", solve=False)
    f = {x.code: x for x in p.findings}
    n_stored = sum(t.numel for t in ck.tensors)
    assert n_stored == p.estimate.weights.parameter_count and "checkpoint_mismatch" not in f
    assert f"stores {n_stored:,} parameters" in f["checkpoint_stored"].message


def test_gated_repo_without_a_token_says_how_to_log_in(online, monkeypatch):
    from vramguard.resolve import resolve_model
    with pytest.raises(HubError) as e:
        resolve_model("acme/gated-llama", revision="main")
    assert "gated" in e.value.accepted and "hf auth login" in e.value.fix and "HF_TOKEN" in e.value.fix
    assert "huggingface-cli" not in str(e.value)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    spec = resolve_model("acme/gated-llama", revision="main")
    assert spec.checkpoint.total_bytes == sum(b for *_, b in _stored(online.repos["acme/gated-llama"].folder))


def test_sharded_repo_reads_the_index_and_every_shard_header(online):
    from vramguard.resolve import resolve_model
    folder = online.repos["acme/tiny-llama-sharded"].folder
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) == 3
    ck = resolve_model("acme/tiny-llama-sharded", revision="main").checkpoint
    assert ck.files == tuple(shards)
    assert ck.total_bytes == sum(b for *_, b in _stored(folder))
    assert ck.header_bytes == sum(_header_end(folder / s) for s in shards)
    assert ck.file_bytes == tuple((folder / s).stat().st_size for s in shards)
    assert "model.safetensors.index.json" in {f.what for f in ck.fetched}
    _assert_headers_only(online, "acme/tiny-llama-sharded", folder)


def test_gptq_weights_are_the_sum_of_their_header_bytes(online):
    """Per layer and linear (in, out), group size 32: qweight in/8 x out x 4 B, qzeros in/32 x out/8 x 4 B,
    scales in/32 x out x 2 B, g_idx in x 4 B; q_proj (64, 64): 2,048 + 64 + 256 + 256 B, each rounded to
    512 B -> 2,048 + 512 + 512 + 512 = 3,584 B. The fp16 embeddings, norms and lm_head load in the model dtype
    (2 B either way), so the planned weights equal the stored bytes, each rounded to 512 B."""
    from vramguard.plan import plan
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    folder = online.repos["acme/tiny-llama-gptq"].folder
    spec = resolve_model("acme/tiny-llama-gptq", revision="main")
    assert spec.prequantized == "gptq"
    p = plan(spec, Settings(quant="fp16"), vram="24GiB", solve=False)
    stored = _stored(folder)
    assert p.estimate.weights.total_bytes == sum(rounded(b) for *_, b in stored)
    q = {n: b for n, _, _, b in stored if n.startswith("model.layers.0.self_attn.q_proj.")}
    assert sum(rounded(b) for b in q.values()) == 3_584
    assert p.estimate.weights.quantized_linear_bytes == sum(rounded(b) for n, *_, b in stored if n.endswith("qweight"))
    codes = {f.code: f for f in p.findings}
    assert "prequantized_weights" in codes and p.estimate.load is None
    assert spec.checkpoint.files == ("gptq_model-4bit-32g.safetensors",)
    _assert_headers_only(online, "acme/tiny-llama-gptq", folder)


def test_fp8_is_dequantized_to_bf16_on_a_card_below_compute_capability_8_9(online):
    """Each FP8 weight (out, in) of 1 B per value becomes bf16 (2 B) and its float32 scales are freed below
    compute capability 8.9 (transformers' FineGrainedFP8HfQuantizer.validate_environment)."""
    from vramguard.plan import plan
    from vramguard.resolve import resolve_model
    from vramguard.settings import Settings
    spec = resolve_model("acme/tiny-llama-fp8", revision="main")
    stored = _stored(online.repos["acme/tiny-llama-fp8"].folder)
    kept = plan(spec, Settings(quant="bf16"), gpu="h100-80gb", solve=False)
    assert kept.estimate.weights.total_bytes == sum(rounded(b) for *_, b in stored)
    old = plan(spec, Settings(quant="bf16"), gpu="rtx-3090", solve=False)
    fp8 = [(n, b) for n, dt, _, b in stored if "float8" in dt]
    scales = [b for n, *_, b in stored if n.endswith("weight_scale_inv")]
    assert old.estimate.weights.total_bytes == (kept.estimate.weights.total_bytes
                                                + sum(rounded(2 * b) - rounded(b) for _, b in fp8)
                                                - sum(rounded(b) for b in scales))
    f = {x.code: x for x in old.findings}["prequantized_dequantized"]
    assert "8.9" in f.message and f.bytes == old.estimate.weights.total_bytes - kept.estimate.weights.total_bytes


def test_bin_only_repo_is_planned_from_config_without_reading_the_bin(online):
    from vramguard.resolve import resolve_model
    spec = resolve_model("acme/tiny-llama-bin", revision="main")
    assert spec.checkpoint.format == "pytorch" and spec.checkpoint.files == ("pytorch_model.bin",)
    assert any(".bin weights" in n and "config.json alone" in n for n in spec.notes)
    assert ("acme/tiny-llama-bin", "pytorch_model.bin") not in online.ranges
    assert online.sent_bytes["acme/tiny-llama-bin"] < 10_000


def test_unknown_repo_and_unknown_revision(online):
    from vramguard.resolve import resolve_model
    with pytest.raises(HubError) as e:
        resolve_model("acme/no-such-model", revision="main")
    assert e.value.field == "MODEL" and "no such repository" in e.value.accepted
    with pytest.raises(HubError) as e:
        resolve_model("acme/tiny-llama", revision="v9")
    assert e.value.field == "revision" and e.value.value == "v9" and "acme/tiny-llama" in e.value.accepted


def test_no_network_falls_back_to_the_cache_and_says_so(online, monkeypatch):
    from vramguard.resolve import resolve_model
    resolve_model("acme/tiny-llama", revision="main")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: connection refused
    spec = resolve_model("acme/tiny-llama", revision="main")
    assert any("cannot be reached" in n and "local cache" in n for n in spec.notes)
    assert spec.checkpoint.tensors and {f.origin for f in spec.checkpoint.fetched} == {"cache"}
    assert resolve_model("acme/tiny-llama").source.startswith("hf-cache:")  # no revision: the cache, no network
    with pytest.raises(HubError) as e:
        resolve_model("acme/tiny-llama-gptq", revision="main")
    assert "cannot be reached" in e.value.accepted and "cache" in e.value.accepted and "hf download" in e.value.fix
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError) as e:
        resolve_model("acme/tiny-llama-gptq")
    assert "HF_HUB_OFFLINE" in e.value.accepted


def test_cli_plans_a_hub_id_and_shows_what_it_read(online):
    """plan, check and their errors as the CLI prints them: JSON on stdout, what was read on stderr."""
    from typer.testing import CliRunner

    from vramguard.cli import app

    def run(*args):
        r = CliRunner().invoke(app, list(args))
        return r.exit_code, r.stdout, " ".join(r.stderr.split())  # stderr as one line: rich wraps it

    code, out, err = run("plan", "acme/tiny-llama-gptq", "--revision", "main", "--quant", "fp16", "--vram", "8GiB",
                         "--format", "json")
    assert code == 0, err
    data = json.loads(out)
    ck = data["model"]["checkpoint"]
    stored = _stored(online.repos["acme/tiny-llama-gptq"].folder)
    assert ck["stored_bytes"] == sum(b for *_, b in stored) and ck["tensor_count"] == len(stored)
    assert data["weights"]["total_bytes"] == sum(rounded(b) for *_, b in stored)
    assert ck["fetched_network_bytes"] == sum(f["bytes"] for f in ck["fetched"]) < MAX_SENT
    assert "read for acme/tiny-llama-gptq: config.json" in err and "no weights" in err
    code, out, err = run("plan", "acme/gated-llama", "--revision", "main")
    assert code == 3 and "Traceback" not in err
    assert "gated" in err and "hf auth login" in err
    code, out, err = run("check", "acme/tiny-llama", "--revision", "main", "--gpu", "rtx-4090", "--format", "json")
    assert code in (0, 1) and "Traceback" not in err, err
    names = {f["name"]: f for f in json.loads(out)["findings"]}
    assert names["checkpoint_read"]["status"] == "info" and names["ram_vs_shard"]["status"] == "ok"
    code, out, err = run("explain", "CUDA out of memory. Tried to allocate 2.00 GiB", "--model", "acme/tiny-llama",
                         "--revision", "main")
    assert code == 0 and "read for acme/tiny-llama: config.json" in err, err
