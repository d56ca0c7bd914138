"""The main job (`python -m cuflash`) and its parts: the kernel check, the benchmark harness's
sizing, the report (markdown and chart). On CPU here; the GPU half runs on the lent GPU."""
import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import _cuda_available
from cuflash import api, bench, check, report

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(_cuda_available(), reason="the behaviour on a machine without a GPU")
@pytest.mark.parametrize("args", [[], ["--no-bench", "--seed", "3"], ["run", "--checks", "1"]])
def test_main_job_without_gpu_runs_the_reference_and_says_why(args):
    result = subprocess.run([sys.executable, "-m", "cuflash", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "The NumPy reference on a small problem" in result.stdout
    assert "(True)" in result.stdout  # row 0 of the causal problem equals v's first row
    assert "No GPU:" in result.stdout and "compute capability 8.0 or newer" in result.stdout


@pytest.mark.parametrize("compute_capability", [(9, 0), (8, 0)])
def test_check_draws_every_family_and_op_of_the_gpu(compute_capability):
    cases = check.draw_cases(np.random.default_rng(0), compute_capability, per_op=3)
    drawn = {(c.family, c.op) for c in cases}
    families = {"fwd_sm80", "bwd_sm80", "bwd_preprocess"}
    families |= ({"fwd_sm90", "fwd_fp8_sm90", "fwd_quantized_sm90", "bwd_sm90", "quantize_fp8"}
                 if compute_capability == (9, 0) else set())
    assert {f for f, _ in drawn} == families
    assert ("bwd_sm80", "attention_varlen_backward") in drawn
    # bwd_sm90 has no deterministic mode and compiles head dims up to 256: its draws stay within both
    assert all(c.headdim <= 256 and not c.deterministic for c in cases if c.family == "bwd_sm90")
    deterministic = {c.op for c in cases if c.deterministic}
    assert deterministic == {"attention_backward", "attention_varlen_backward"}


def _cases(seed=3):
    return check.draw_cases(np.random.default_rng(seed), (9, 0), per_op=2)


def test_check_passes_the_reference_itself():
    rng = np.random.default_rng(3)
    outcomes = [check.run_case(case, rng, on_gpu=False) for case in _cases()]
    assert all(o.ok for o in outcomes), [o.detail for o in outcomes if not o.ok]


@pytest.mark.parametrize("wrong", ["out", "lse"])
@pytest.mark.parametrize("op, function, feature", [("attention_fp8_forward", "attention_fp8", "block"),
                                                   ("attention_quantized_forward", "attention", "hadamard")])
def test_check_catches_wrong_fp8_attention(monkeypatch, wrong, op, function, feature):
    """The FP8 criteria can fail, in every drawn case of attention_fp8 (per-head descales, per-128-row
    ones, and for k and v at head dims 65-128 per-192-row ones) and of attention(fp8=True) (with the
    transform and without; with fast_exp or not): out 10% too large (the draws include long rows of
    small outputs where the e4m3 yardstick's own error reaches 5%: a single head of 674 rows at head
    dim 128, say), or the lse off by 0.05 (a descale applied twice or missed moves either by much
    more; calls with fast_exp have none)."""
    factor = 1.10
    original = getattr(api, function)

    def scaled(*args, **kw):
        if not kw["return_lse"]:  # (fast_exp: out alone)
            out = original(*args, **kw)
            return (out.astype(np.float32) * factor).astype(out.dtype)
        out, lse = original(*args, **kw)
        if wrong == "out":
            return (out.astype(np.float32) * factor).astype(out.dtype), lse
        return out, lse + np.float32(0.05)

    monkeypatch.setattr(api, function, scaled)
    cases = [c for seed in range(6) for c in _cases(seed) if c.op == op]
    assert len(cases) >= 6 and {c.features[feature] for c in cases} == (
        {None, 128, 192} if feature == "block" else {False, True})
    assert {c.features["fast_exp"] for c in cases} == {False, True}
    cases = [c for c in cases if wrong == "out" or not c.features["fast_exp"]]
    for case in cases:
        outcome = check.run_case(case, np.random.default_rng(0), on_gpu=False)
        assert not outcome.ok, (case.describe(), outcome.detail)


def test_check_catches_wrong_outputs(monkeypatch):
    """The criteria can fail: a forward whose output is 2% too large (a wrong normalisation) and a
    backward whose dk is 5% too large are caught, dense and packed, in fp16 and in bf16."""
    originals = {name: getattr(api, name) for name in ("attention", "attention_varlen", "attention_backward",
                                                       "attention_varlen_backward")}

    def forward_scaled(name):
        def call(*args, **kw):
            out, lse = originals[name](*args, **kw)
            return (out.astype(np.float32) * 1.02).astype(out.dtype), lse
        return call

    def backward_scaled(name):
        def call(*args, **kw):
            dq, dk, dv = originals[name](*args, **kw)
            return dq, (dk.astype(np.float32) * 1.05).astype(dk.dtype), dv
        return call

    for name in ("attention", "attention_varlen"):
        monkeypatch.setattr(api, name, forward_scaled(name))
    for name in ("attention_backward", "attention_varlen_backward"):
        monkeypatch.setattr(api, name, backward_scaled(name))
    checked = set()
    for seed in range(4):
        rng = np.random.default_rng(seed)
        for case in check.draw_cases(rng, (8, 0), per_op=2):
            if case.op == "backward_preprocess":
                continue
            outcome = check.run_case(case, rng, on_gpu=False)
            assert not outcome.ok, (case.describe(), outcome.detail)
            checked.add((case.op, case.dtype))
    ops = ("attention_forward", "attention_varlen_forward", "attention_backward", "attention_varlen_backward")
    assert checked == {(op, dtype) for op in ops for dtype in ("float16", "bfloat16")}, checked


@pytest.mark.parametrize("wrong", ["codes", "descale", "seed"])
def test_check_catches_a_wrong_quantizer(monkeypatch, wrong):
    """quantize_fp8's check fails for codes one step off everywhere, descales 1% off, or another
    transform seed."""
    quantize = api.quantize_fp8

    def broken(x, **kw):
        if wrong == "seed":
            kw["seed"] = kw["seed"] + 1
        x8, descale = quantize(x, **kw)
        if wrong == "codes":
            x8 = (x8.astype(np.float32) * 1.2).astype(x8.dtype)
        if wrong == "descale":
            descale = descale * np.float32(1.01)
        return x8, descale

    monkeypatch.setattr(api, "quantize_fp8", broken)
    rng = np.random.default_rng(0)
    cases = [c for c in check.draw_cases(rng, (9, 0), per_op=6) if c.op == "quantize_fp8"]
    if wrong == "seed":
        cases = [c for c in cases if c.features["hadamard"]]
    assert cases
    for case in cases:
        outcome = check.run_case(case, rng, on_gpu=False)
        assert not outcome.ok, (case.describe(), outcome.detail)


def test_bench_sizing_is_flashattention3s():
    grid = bench.configs(["bfloat16"], [64, 256], [False, True], [512, 16384])
    assert len(grid) == 8 and all(c.batch * c.seqlen == 16384 and c.nheads * c.headdim == 2048 for c in grid)
    c = grid[0]
    assert c.flops() == 4.0 * c.batch * c.nheads * c.seqlen ** 2 * c.headdim
    causal = [g for g in grid if g.causal][0]
    assert causal.flops(backward=True) == 2.5 * causal.flops() == 2.5 * 0.5 * 4.0 * 32 * 32 * 512 ** 2 * 64


def test_bench_decode_steps_read_their_keys_once():
    """Decode rows: a few query rows against long keys, GQA's kv heads; FLOPs and K and V's bytes."""
    grid = bench.decode_configs(["bfloat16"])
    assert len(grid) == len(bench.DECODE_SHAPES) + len(bench.SPECULATIVE_SHAPES)
    assert [c.causal for c in grid] == [False] * len(bench.DECODE_SHAPES) + [True] * len(bench.SPECULATIVE_SHAPES)
    assert grid[-1].label().endswith("heads=32/32 causal")
    assert grid[-1].flops() == 4.0 * 32 * (8 * (32768 - 8) + 8 * 9 / 2) * 128  # the pairs a bottom-right mask leaves
    more_rows = bench.Config("bfloat16", 64, True, 4, 1, 1, seqlen_q=8)  # rows 0-3 see no key, 4-7 see 1-4
    assert more_rows.flops() == 4.0 * (1 + 2 + 3 + 4) * 64
    c = next(c for c in grid if (c.batch, c.seqlen_q, c.seqlen, c.nheads, c.nheads_kv) == (1, 1, 32768, 32, 8))
    assert c.query_rows == 1 and c.kv_heads == 8 and "decode b=1 q=1 k=32768 heads=32/8" in c.label()
    assert c.flops() == 4.0 * 32 * 32768 * 128 and c.kv_bytes() == 2 * 32768 * 8 * 128 * 2
    square = bench.configs(["bfloat16"], [128], [False], [1024])[0]
    assert (square.query_rows, square.kv_heads) == (1024, 16)


def test_report_tables_decode_steps(tmp_path):
    """decode_torch.json -> decode.md: microseconds, cuflash's bandwidth, its speed-ups, no chart."""
    rows = [dict(impl=impl, dtype="bfloat16", headdim=128, causal=False, seqlen=32768, batch=1, nheads=32,
                 seqlen_q=1, nheads_kv=8, ms=us / 1e3, tflops=0.0, sm_clock_mhz=1980, throttled=False,
                 gpu="NVIDIA H100 80GB HBM3", input_copies=2)
            for impl, us in (("cuflash", 50.0), ("torch-flash", 60.0), ("torch-cudnn", 55.0), ("cuflash-fp8", 40.0))]
    document = dict(meta=dict(date="2026-11-27", versions={"torch": "2.11.0"}, tokens=16384, hidden=2048, reps=15,
                              graph_calls=20), rows=rows)
    (tmp_path / "decode_torch.json").write_text(json.dumps(document))
    assert [p.name for p in report.write(tmp_path, charts=True)] == ["decode.md"]
    table = (tmp_path / "decode.md").read_text()
    assert "| bfloat16 | 128 | 0 | 1 | 1 | 32768 | 32/8 | 2 | 50.0 | 60.0 | 55.0 | 40.0 | 2.68 | 1.20 | 1.10 | 1.25 | 1980 |" in table
    assert "each a CUDA graph replay of 20 calls" in table


def _document(impls_tflops: dict, seqlens=(1024, 4096)) -> dict:
    rows = [dict(impl=impl, dtype="bfloat16", headdim=hd, causal=causal, seqlen=s, tflops=tf * s / 4096,
                 sm_clock_mhz=1980, throttled=False, gpu="NVIDIA H100 80GB HBM3")
            for impl, tf in impls_tflops.items() for hd in (64, 128) for causal in (False, True) for s in seqlens]
    return dict(meta=dict(date="2026-11-26", versions={"torch": "2.11.0"}, tokens=16384, hidden=2048, reps=20),
                rows=rows)


def test_report_tables_and_charts(tmp_path):
    (tmp_path / "fwd_torch.json").write_text(json.dumps(_document({"cuflash": 600, "torch-flash": 300,
                                                                   "torch-cudnn": 640})))
    (tmp_path / "fwd_jax.json").write_text(json.dumps(_document({"jax-cudnn": 620})))
    written = report.write(tmp_path, charts=True)
    assert [p.name for p in written] == ["fwd.md", "fwd_bfloat16.png"]
    table = (tmp_path / "fwd.md").read_text()
    assert "| bfloat16 | 128 | 1 | 4096 | 600 | 300 | 640 | 620 | 2.00 | 0.94 | 1980 |" in table
    assert "unsteady" not in table
    png = (tmp_path / "fwd_bfloat16.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 20_000
    # What a new run of the main job replaces: this run's inputs and outputs, nothing else.
    (tmp_path / "notes.txt").write_text("mine")
    assert sorted(p.name for p in report.outputs(tmp_path)) == ["fwd.md", "fwd_bfloat16.png", "fwd_jax.json",
                                                               "fwd_torch.json"]


def test_report_shows_the_fp8_columns(tmp_path):
    """FP8 rows: the kernel on quantized inputs (per head, per block, per head returning the LSE), end
    to end, and the speed-up; every implementation has a colour and a label of its own."""
    (tmp_path / "fwd_torch.json").write_text(json.dumps(_document(
        {"cuflash": 600, "torch-cudnn": 640, "cuflash-fp8": 900, "cuflash-fp8-block": 840, "cuflash-fp8-lse": 870,
         "cuflash-fp8-e2e": 660})))
    assert [p.name for p in report.write(tmp_path, charts=True)] == ["fwd.md", "fwd_bfloat16.png"]
    table = (tmp_path / "fwd.md").read_text()
    assert ("| cuflash | torch-cudnn | cuflash-fp8 | cuflash-fp8-block | cuflash-fp8-lse | cuflash-fp8-e2e | "
            "cuflash / FA2 | cuflash / cuDNN | fp8 / cuflash | clock MHz |") in table
    assert "| bfloat16 | 128 | 0 | 4096 | 600 | 640 | 900 | 840 | 870 | 660 | - | 0.94 | 1.50 | 1980 |" in table
    implementations = ("cuflash",) + report.PEERS
    assert set(report.COLORS) == set(implementations) == set(report.LABELS)
    assert len(set(report.COLORS.values())) == len(implementations)


def test_report_compares_fp8_with_cudnn_fp8(tmp_path):
    """cuDNN's FP8 forward (JAX's process) gets a column, and the FP8 kernel a ratio to it."""
    (tmp_path / "fwd_torch.json").write_text(json.dumps(_document({"cuflash": 600, "torch-cudnn": 640,
                                                                   "cuflash-fp8": 900})))
    jax_document = _document({"jax-cudnn": 620, "jax-cudnn-fp8": 1000})
    (tmp_path / "fwd_jax.json").write_text(json.dumps(jax_document))
    assert [p.name for p in report.write(tmp_path, charts=True)] == ["fwd.md", "fwd_bfloat16.png"]
    table = (tmp_path / "fwd.md").read_text()
    assert "jax-cudnn, jax-cudnn-fp8 timed in JAX's process, calls back to back" in table  # (runs before jax_calls)
    assert ("| cuflash | torch-cudnn | jax-cudnn | cuflash-fp8 | jax-cudnn-fp8 | cuflash / FA2 | cuflash / cuDNN | "
            "fp8 / cuflash | fp8 / cuDNN fp8 | clock MHz |") in table
    assert "| bfloat16 | 128 | 0 | 4096 | 600 | 640 | 620 | 900 | 1000 | - | 0.94 | 1.50 | 0.90 | 1980 |" in table
    for row in jax_document["rows"]:
        row["jax_calls"] = 5
    (tmp_path / "fwd_jax.json").write_text(json.dumps(jax_document))
    report.write(tmp_path, charts=False)
    assert "jax-cudnn, jax-cudnn-fp8 timed in JAX's process, programs of 5 calls" in (tmp_path / "fwd.md").read_text()


def test_report_marks_unsteady_rows():
    document = _document({"cuflash": 600, "torch-cudnn": 640})
    for row in document["rows"]:
        row["spread_p10_p90"] = 0.4 if (row["headdim"], row["causal"], row["seqlen"]) == (64, True, 1024) else 0.02
    table = report.render([document])
    unsteady = [line for line in table.splitlines() if "unsteady" in line]
    assert unsteady == ["| bfloat16 | 64 | 1 | 1024 | 150 | 160 | - | 0.94 | 1980 (unsteady: p10-p90 0.40 of a median) |"]


def test_report_says_graph_timing():
    document = _document({"cuflash": 600, "torch-cudnn": 640})
    assert "CUDA graph" not in report.render([document])
    document["meta"]["graph_calls"] = 7
    assert "median of 20 interleaved repetitions, each a CUDA graph replay of 7 calls" in report.render([document])
    # JAX's document (which write() reads first) has none; the torch process's timing is still named.
    jax_document = _document({"jax-cudnn": 620})
    assert ("median of 20 interleaved repetitions, each of the torch process's a CUDA graph replay of 7 calls; "
            "jax-cudnn timed in JAX's process") in report.render([jax_document, document])


class _FakeTiming:
    """Events whose every interval reads 6 ms, and graphs that make their calls when replayed (the
    capture of `uncapturable` fails as a peer's would)."""

    name = "torch"

    def __init__(self, uncapturable=()):
        self.uncapturable, self.calls = uncapturable, []

    def event(self):
        return types.SimpleNamespace(record=lambda: None)

    def elapsed_ms(self, start, end):
        return 6.0

    def synchronize(self):
        pass

    def graph(self, call, calls):
        if call in self.uncapturable:
            raise RuntimeError("operation not permitted when stream is capturing")
        return lambda: [call() for _ in range(calls)]


def test_graph_timing_counts_per_call_and_leaves_out_uncapturable_peers():
    xp = _FakeTiming()
    made = []
    cuflash_call, peer = (lambda: made.append("cuflash")), (lambda: made.append("peer"))
    xp.uncapturable = (peer,)
    times = bench.time_graphs(xp, {"torch-cudnn": peer, "cuflash": cuflash_call}, reps=4, warmup=1, calls=3)
    assert times == {"cuflash": [2.0] * 4}  # 6 ms a replay of 3 calls
    assert made == ["cuflash"] * 3 * (1 + 4)  # the warm-up replay and 4 timed ones
    assert bench.time_interleaved(xp, {"cuflash": cuflash_call}, reps=2, warmup=0) == {"cuflash": [6.0, 6.0]}
    xp.uncapturable = (cuflash_call,)
    with pytest.raises(RuntimeError, match="capturing"):  # cuflash's own launches must capture
        bench.time_graphs(xp, {"cuflash": cuflash_call}, reps=1, warmup=0, calls=2)
    xp.name = "cupy"
    with pytest.raises(NotImplementedError, match="needs PyTorch"):
        bench.time_graphs(xp, {"cuflash": cuflash_call}, reps=1, warmup=0, calls=2)


def test_decode_rows_cycle_through_enough_input_copies_to_miss_the_l2():
    """A decode row's calls read K and V from memory, not from the L2 the previous call filled: they
    cycle through copies of the inputs whose others' K and V are at least twice the L2."""
    l2 = 50 * 2**20
    step = bench.Config("bfloat16", 128, False, 8192, 1, 64, seqlen_q=1, nheads_kv=8)  # 32 MiB of K and V
    assert step.kv_bytes() == 32 * 2**20 and bench.input_copies(step, l2) == 5
    assert bench.input_copies(bench.Config("bfloat16", 128, False, 32768, 8, 32, 1, 8), l2) == 2  # 1 GiB
    assert bench.input_copies(bench.Config("bfloat16", 128, False, 8192, 2, 16), l2) == 1  # not decode
    assert bench.input_copies(step, l2, element_bytes=1) == 8  # e4m3 K and V timed beside: 16 MiB
    made = []
    call = bench._cycling([lambda i=i: made.append(i) for i in range(3)])
    for _ in range(5):
        call()
    assert made == [0, 1, 2, 0, 1]


def test_run_compares_every_implementation_on_the_first_copy_and_times_from_it(monkeypatch):
    """bench.run on a decode row: each implementation's first call (whose out the error column
    compares) is on copy 0, every copy runs once before timing (a graph capture), and the timed calls
    start on copy 0 again; a peer failing on a later copy is left out, not the run."""
    made = {"cuflash": [], "torch-flash": [], "torch-cudnn": []}

    def on_copy(xp, config, backward, extra, g, copy=iter(range(100))):
        i = next(copy)

        def call(name):
            made[name].append(i)
            if name == "torch-cudnn" and i == 1:
                raise RuntimeError("cuDNN: no plan for this address")
            return i
        return {name: (lambda name=name: call(name)) for name in made}

    monkeypatch.setattr(bench, "_implementations_on", on_copy)
    monkeypatch.setattr(bench, "gpu_state", lambda: dict(sm_clock_mhz=1980, temperature_c=40, throttled=False))
    xp = _FakeTiming()
    xp.generator = lambda seed: None
    xp.l2_bytes = lambda: 50 * 2**20
    xp.max_abs_diff = lambda a, b: abs(a - b)
    step = bench.Config("bfloat16", 128, False, 8192, 1, 64, seqlen_q=1, nheads_kv=8)
    rows = bench.run([step], reps=2, warmup=0, xp=xp)
    assert {r["impl"] for r in rows} == {"cuflash", "torch-flash"}
    assert all(r["input_copies"] == 5 and r["max_abs_diff_vs_first"] == 0 for r in rows)
    assert made["cuflash"] == [0, 1, 2, 3, 4, 0, 1] and made["torch-cudnn"] == [0, 1]


@pytest.mark.gpu
def test_bench_graph_timing_on_torch():
    """Graph timing captures cuflash (bf16; e4m3 with and without the LSE, whose V^T pass and workspace
    are captured too; attention(fp8=True) with its quantizations) and torch SDPA's peers."""
    pytest.importorskip("torch")
    grid = [bench.Config("bfloat16", 256, False, 1024, 2, 4)]
    rows = bench.run(grid, reps=3, warmup=1, xp=bench._Torch(), extra=("fp8",), graph_calls=4)
    assert {r["impl"] for r in rows} >= {"cuflash", "cuflash-fp8", "cuflash-fp8-block", "cuflash-fp8-lse",
                                         "cuflash-fp8-e2e", "torch-cudnn"}
    assert all(r["graph_calls"] == 4 and r["tflops"] > 1 for r in rows)


@pytest.mark.gpu
def test_main_job_checks_every_family_on_the_gpu():
    result = subprocess.run([sys.executable, "-m", "cuflash", "--checks", "4", "--no-bench", "--seed", "0"], cwd=ROOT,
                            capture_output=True, text=True)
    print(result.stdout[-6000:])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "checks passed" in result.stdout and "FAIL" not in result.stdout


@pytest.mark.gpu
def test_bench_times_cuflash_alone_on_cupy_arrays():
    """Without PyTorch the harness times cuflash on CuPy arrays (forward and backward)."""
    grid = [bench.Config("bfloat16", 64, True, 1024, 2, 4)]
    for backward in (False, True):
        rows = bench.run(grid, backward=backward, reps=3, warmup=1, xp=bench._CuPy())
        assert [r["impl"] for r in rows] == ["cuflash"] and rows[0]["tflops"] > 1 and rows[0]["backward"] == backward


def test_a_compile_error_names_the_variant_and_keeps_its_log(monkeypatch):
    """What a user sees when NVRTC rejects a kernel (simulated: no GPU compiles here)."""
    cupy = pytest.importorskip("cupy")
    from cuflash import jit, kernels

    def reject(**kw):
        raise cupy.cuda.compiler.CompileException("fwd_sm80.cu(12): error: something is wrong", "src", "name", ())

    monkeypatch.setattr(cupy, "RawModule", reject)
    monkeypatch.setattr(jit, "device_compute_capability", lambda index: (8, 0))
    monkeypatch.setattr(cupy.cuda, "Device", lambda index: __import__("contextlib").nullcontext())
    variant = kernels.variants_for((8, 0), ["fwd_sm80"])[0]
    with pytest.raises(jit.CompileError) as info:
        jit.get_function(variant, 0)
    message = str(info.value)
    assert variant.uri in message and "sm_80" in message and "something is wrong" in message
    assert "python -m cuflash kernels --arch sm_80 --family fwd_sm80" in message
    assert "something is wrong" in info.value.log_path.read_text()
