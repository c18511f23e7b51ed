"""explain: OOM messages of several PyTorch versions; C15 and its opposite; the recorded H200 messages."""

import json
from pathlib import Path

import pytest

from vramguard.errors import InvalidValue
from vramguard.explain import explain, parse_oom_message, plan_candidates
from vramguard.resolve import resolve_model
from vramguard.settings import Settings
from vramguard.units import GiB, MiB

C15_NEW = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of "
           "8.00 GiB of which 0 bytes is free. Including non-PyTorch memory, this process has 7.29 GiB memory in use. "
           "Of the allocated memory 6.63 GiB is allocated by PyTorch, and 675.84 MiB is reserved by PyTorch but "
           "unallocated. If reserved but unallocated memory is large try setting "
           "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
           "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
C15_OLD = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 8.00 GiB total capacity; 6.63 GiB "
           "already allocated; 0 bytes free; 7.29 GiB reserved in total by PyTorch) If reserved memory is >> "
           "allocated memory try setting max_split_size_mb to avoid fragmentation.")
TORCH_1_4 = ("RuntimeError: CUDA out of memory. Tried to allocate 2.00 MiB (GPU 0; 10.76 GiB total capacity; "
             "9.70 GiB already allocated; 3.56 MiB free; 9.91 GiB cached)")
TORCH_2_1_TYPO = ("CUDA out of memory. Tried to allocate 64.00 MiB. GPU 0 has a total capacty of 23.65 GiB of which "
                  "50.06 MiB is free. Process 38265 has 6.00 GiB memory in use. Including non-PyTorch memory, this "
                  "process has 17.56 GiB memory in use. Of the allocated memory 17.01 GiB is allocated by PyTorch, "
                  "and 12.25 MiB is reserved by PyTorch but unallocated.")
BIGGER_THAN_CARD = ("CUDA out of memory. Tried to allocate 30.00 GiB. GPU 0 has a total capacity of 23.65 GiB of "
                    "which 20.10 GiB is free. Including non-PyTorch memory, this process has 3.40 GiB memory in use. "
                    "Of the allocated memory 2.90 GiB is allocated by PyTorch, and 40.00 GiB is reserved by PyTorch "
                    "but unallocated.")
STEADY = ("CUDA out of memory. Tried to allocate 32.00 MiB. GPU 0 has a total capacity of 23.65 GiB of which "
          "21.06 MiB is free. Including non-PyTorch memory, this process has 23.20 GiB memory in use. Of the allocated "
          "memory 22.90 GiB is allocated by PyTorch, and 14.12 MiB is reserved by PyTorch but unallocated.")


def test_c15_fragmentation_with_the_33x_ratio():
    for text in (C15_NEW, C15_OLD):
        e = explain(text)
        assert e.kind == "fragmentation", text
        assert e.message.request_bytes == 20 * MiB
        assert e.message.reserved_unallocated_bytes == 675.84 * MiB or \
            abs(e.message.reserved_unallocated_bytes - int(0.66 * GiB)) < 10 * MiB
        assert "33x" in e.summary
        assert any("used outside PyTorch's pool" in x and "0.71 GiB" in x for x in e.evidence)
        assert any("expandable_segments:True" in f for f in e.fixes)
        assert any("static KV cache" in f for f in e.fixes)
    assert explain(C15_NEW).message.format == "torch>=2.1" and explain(C15_OLD).message.format == "torch<2.1"


def test_expandable_segments_already_set_is_not_suggested_again():
    e = explain(C15_NEW, alloc_conf="expandable_segments:True")
    assert e.kind == "fragmentation" and not any(f.startswith("export PYTORCH") for f in e.fixes)


def test_c15_opposite_a_request_larger_than_the_card_is_never_fragmentation():
    e = explain(BIGGER_THAN_CARD)  # 40 GiB reserved-unallocated would look like fragmentation: it is not
    assert e.kind == "algorithmic" and "larger than all the memory" in e.summary


def test_other_processes_and_steady_growth():
    e = explain(TORCH_2_1_TYPO)
    assert e.message.total_bytes == int(23.65 * GiB) and e.message.other_processes == [(38265, 6 * GiB)]
    assert e.kind == "other_processes" and any("pid 38265" in x for x in e.evidence)
    s = explain(STEADY)
    assert s.kind == "steady_growth" and "quantized KV cache" in s.fixes[0]


def test_torch_1_4_cached_format():
    m = parse_oom_message(TORCH_1_4)
    assert m.total_bytes == int(10.76 * GiB) and m.allocated_bytes == int(9.70 * GiB)
    assert m.reserved_bytes == int(9.91 * GiB) and m.free_bytes == int(3.56 * MiB)
    assert explain(TORCH_1_4).kind == "fragmentation"  # 0.21 GiB cached-unallocated against a 2 MiB request


def test_recorded_h200_messages():
    """The messages of the runs that ran out of memory under the 24 GiB cap (benchmarks/results/h200_matrix)."""
    recs = [json.loads(line) for p in sorted(Path(__file__).parents[1].glob("benchmarks/results/h200_matrix/*/"
                                                                           "matrix.jsonl")) for line in open(p)]
    errs = {(r["model"], r["quant"], r["attn"], r["batch"], r["prompt"]): r["err"] for r in recs
            if r["kind"] == "gen" and not r["ok"]}
    frag = explain(errs[("llama-3.1-8b", "bf16", "sdpa", 4, 16384)])  # 1.75 GiB asked, 2.75 GiB unallocated
    assert frag.kind == "fragmentation" and frag.message.allowed_bytes == 24 * GiB
    spec = resolve_model("llama-3.1-8b")
    s = Settings(quant="bf16", attn="eager", batch=4, prompt_tokens=4096, max_new_tokens=64)
    algo = explain(errs[("llama-3.1-8b", "bf16", "eager", 4, 4096)], candidates=plan_candidates(spec, s))
    assert algo.kind == "algorithmic" and "eager attention scores in float32" in algo.matched_allocation
    assert "sdpa" in algo.fixes[0]


def test_not_an_oom_message():
    with pytest.raises(InvalidValue) as e:
        explain("Segmentation fault")
    assert "Tried to allocate" in str(e.value)


def test_cli_reads_stdin():
    from conftest import run_cli
    r = run_cli("explain", "-", "--format", "json", input=C15_NEW)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kind"] == "fragmentation"


def test_cublas_mps_and_accelerate_messages_are_explained():
    from vramguard.explain import explain
    e = explain("RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert e.kind == "cublas_alloc" and any("nvidia-smi" in f for f in e.fixes)
    mps = explain("RuntimeError: MPS backend out of memory (MPS allocated: 18.08 GB, other allocations: 1.42 GB, "
                  "max allowed: 18.13 GB). Tried to allocate 1.00 MB on private pool. Use "
                  "PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 to disable upper limit for memory allocations (may cause "
                  "system failure).")
    # MPSAllocator prints 1024-based sizes: 18.13 GB = int(18.13 x 2**30), 1.00 MB = 2**20
    assert mps.kind == "mps" and mps.message.allowed_bytes == int(18.13 * GiB) and mps.message.request_bytes == 2**20
    assert any("PYTORCH_MPS_HIGH_WATERMARK_RATIO" in f for f in mps.fixes)
    acc = explain("ValueError: Some modules are dispatched on the CPU or the disk. Make sure you have enough GPU "
                  "RAM to fit the quantized model. If you want to dispatch the model on the CPU or the disk while "
                  "keeping these modules in 32-bit, you need to set `llm_int8_enable_fp32_cpu_offload=True` and "
                  "pass a custom `device_map` to `from_pretrained`.")
    assert acc.kind == "offload" and any("vramguard plan" in f for f in acc.fixes)


def test_explain_on_a_terminal_says_what_it_waits_for(capsys):
    import io

    from vramguard.cli import read_message

    class Tty(io.StringIO):
        def isatty(self):
            return True
    assert read_message(None, Tty("CUDA out of memory ...")) == "CUDA out of memory ..."
    assert "paste the out-of-memory message, then press Ctrl-D" in capsys.readouterr().err
    assert read_message(None, io.StringIO("piped")) == "piped"  # a pipe: no prompt
    assert capsys.readouterr().err == ""


def test_binary_input_is_named_not_echoed():
    import pytest as _pytest

    from vramguard.errors import InvalidValue
    from vramguard.explain import parse_oom_message
    with _pytest.raises(InvalidValue) as e:
        parse_oom_message("\x00\x1b\udce3" * 50)
    assert e.value.value == "150 characters of binary data"


def test_unallocated_and_free_memory_together_are_fragmentation():
    """2.00 GiB asked with 1.12 GiB free on the card and 1.90 GiB reserved but unallocated: PyTorch had released its
    free segments and retried, so the 1.90 GiB are split inside segments in use; together with the free 1.12 GiB
    they cover the request (3.02 >= 2.00, and 1.90 >= half of 2.00): fragmentation, with expandable segments."""
    msg = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
           "23.64 GiB of which 1.12 GiB is free. Including non-PyTorch memory, this process has 22.50 GiB memory in "
           "use. Of the allocated memory 20.10 GiB is allocated by PyTorch, and 1.90 GiB is reserved by PyTorch but "
           "unallocated.")
    e = explain(msg)
    assert e.kind == "fragmentation" and "1.12 GiB still free" in e.summary
    assert "expandable_segments:True" in e.fixes[0]
    # the same figures with only 0.05 GiB free: 1.95 < 2.00, memory is simply short
    assert explain(msg.replace("1.12 GiB is free", "0.05 GiB is free")).kind != "fragmentation"


def test_explain_a_path_that_names_no_file_says_so(tmp_path):
    from conftest import run_cli
    missing = tmp_path / "oom.txt"
    r = run_cli("explain", str(missing))
    assert r.returncode == 2 and f"no such file: {missing}" in r.stdout + r.stderr


# torch's C10_CUDA_CHECK text (c10/cuda/CUDAException.cpp) as raised by a matmul on a full card, torch 2.x
CUDA_ERROR = ("Traceback (most recent call last):\n  File \"gen.py\", line 12, in <module>\n"
              "    out = model.generate(**inputs)\n"
              "RuntimeError: CUDA error: out of memory\n"
              "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
              "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
              "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
# ProcessGroupNCCL's error with NCCL's CUDACHECK text (torch 2.1, NCCL 2.18)
NCCL_ERROR = ("torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
              "ProcessGroupNCCL.cpp:1331, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version "
              "2.18.1\nncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n"
              "Cuda failure 'out of memory'")


def test_cuda_error_out_of_memory_is_explained_not_refused():
    e = explain(CUDA_ERROR)
    assert e.kind == "cuda_error" and e.message.format == "cuda_error"
    assert e.message.request_bytes is None and e.message.allocated_bytes is None  # the message has no figures
    assert "outside PyTorch's caching allocator" in e.summary
    assert any("asynchronously" in x and "may not be the call" in x for x in e.evidence)
    assert any("TORCH_USE_CUDA_DSA" in x for x in e.evidence)
    assert e.fixes[0].startswith("locate it: rerun with CUDA_LAUNCH_BLOCKING=1")
    assert any("nvidia-smi" in f for f in e.fixes) and any("batch" in f for f in e.fixes)
    assert any("vram_budget=" in f for f in e.fixes)
    assert not any("NCCL could not" in x or "NCCL_BUFFSIZE" in x for x in e.evidence + e.fixes)  # not an NCCL one


def test_nccl_cuda_failure_out_of_memory_names_nccl():
    e = explain(NCCL_ERROR)
    assert e.kind == "cuda_error"
    assert any("NCCL could not allocate" in x for x in e.evidence)
    assert "NCCL_BUFFSIZE" in e.fixes[1]
    assert not any("asynchronously" in x for x in e.evidence)  # this message does not say it
    assert e.fixes[0].startswith("rerun with CUDA_LAUNCH_BLOCKING=1")


def test_cuda_error_with_allocator_figures_is_read_by_the_allocator_rules():
    """A traceback with both texts (a later CUDA call after the allocator's OOM) is classified by its figures."""
    e = explain(C15_NEW + "\nRuntimeError: CUDA error: out of memory")
    assert e.kind == "fragmentation"


def test_cli_explains_cuda_error_with_exit_0():
    from conftest import run_cli
    r = run_cli("explain", "-", input=CUDA_ERROR)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("cuda_error: CUDA could not allocate memory") and "CUDA_LAUNCH_BLOCKING=1" in r.stdout
    j = run_cli("explain", "-", "--format", "json", input=NCCL_ERROR)
    assert j.returncode == 0 and json.loads(j.stdout)["kind"] == "cuda_error"


EMPTY_TRACEBACK = ('Traceback (most recent call last):\n  File "/home/u/big.py", line 3, in <module>\n'
                   '    x = torch.empty(100 * 2**30, dtype=torch.uint8, device="cuda")\n')
ATTENTION_TRACEBACK = ('Traceback (most recent call last):\n  File "/x/modeling_llama.py", line 230, in forward\n'
                       '    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * self.scaling\n')


def test_a_plain_tensor_oom_gets_no_attention_fix_unless_the_traceback_names_attention():
    """A traceback that names no attention code (a user's torch.empty larger than the card) gets the fix of its own
    tensor, no attention setting; one through the attention's code, or a message without a traceback (nothing says
    where the allocation was made), still gets the attention fix."""
    plain = explain(EMPTY_TRACEBACK + "torch.OutOfMemoryError: " + BIGGER_THAN_CARD)
    assert plain.kind == "algorithmic"
    assert not any("attention" in f or "attn" in f or "prefill" in f for f in plain.fixes), plain.fixes
    assert plain.fixes[0].startswith("make the tensor of the traceback's last frame smaller")
    assert any("names no attention code" in x for x in plain.evidence)
    for text in (ATTENTION_TRACEBACK + "torch.OutOfMemoryError: " + BIGGER_THAN_CARD, BIGGER_THAN_CARD):
        e = explain(text)
        assert e.kind == "algorithmic" and any("eager attention" in f for f in e.fixes), e.fixes
        assert not any("names no attention code" in x for x in e.evidence)
