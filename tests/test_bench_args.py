"""benchmarks/bench_fwd.py's --sm90-tiles and --fp8-tiles rows become fwd_sm90 variants field for field,
and --jax --extra fp8 times cuDNN's FP8 forward; benchmarks/fp8_accuracy.py's study runs on the
reference backend."""
import argparse
import importlib.util
from pathlib import Path

import pytest

from cuflash import bench
from cuflash.kernels import fwd_sm90


def _script(name):
    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_fwd():
    return _script("bench_fwd")


def test_sm90_tiles_rows_match_the_table_layout():
    rows = _bench_fwd().sm90_tiles("128:3x80x2x0x1,64:3x128x2x2,256:2x128x1x1x2")
    assert rows == {128: (3, 80, 2, "tile", "overlap_pv"), 64: (3, 128, 2, "free", "overlap"),
                    256: (2, 128, 1, "pingpong", "serial")}
    for headdim, tiles in rows.items():
        # the same positions as a TILES row: a variant built from it names the fields it was given
        variant = fwd_sm90.FwdSm90Variant("bfloat16", "bfloat16", headdim, *tiles, False, False, True, False, False)
        variant.check()
        assert (variant.consumers, variant.block_n, variant.stages, variant.sync, variant.schedule) == tiles
    assert all(len(tiles) == 5 for tiles in fwd_sm90.SOFTCAP_TILES.values())
    assert all(len(tiles) == 5 for rows in fwd_sm90.TILES.values() for _, tiles in rows)


def test_fp8_tiles_rows_match_the_table_layout():
    rows = _bench_fwd().fp8_tiles("256:2x128x3x1x0x1,64:3x128x2x0x0x0")
    assert rows == {256: (2, 128, 3, "pingpong", "overlap", True), 64: (3, 128, 2, "tile", "overlap", False)}
    for headdim, tiles in rows.items():
        variant = fwd_sm90.FwdFp8Sm90Variant(fwd_sm90.FP8, "bfloat16", headdim, *tiles[:5], False, False, True,
                                             False, tiles[5])
        variant.check()
        assert (variant.consumers, variant.block_n, variant.stages, variant.sync, variant.schedule,
                variant.v_pretransposed) == tiles
    assert all(len(tiles) == 6 for rows in fwd_sm90.FP8_TILES.values() for _, tiles in rows)


@pytest.mark.parametrize("text", ["64:3x128x2", "64:3x128x2x0x1x1", "64:3xAx2x0", "64:3x128x2x0x3", "64:3x128x2x3"])
def test_sm90_tiles_refuses_malformed_rows(text):
    with pytest.raises((argparse.ArgumentTypeError, ValueError)):
        _bench_fwd().sm90_tiles(text)


@pytest.mark.parametrize("text", ["256:2x128x3x1x0", "256:2x128x3x1x0x1x1"])
def test_fp8_tiles_takes_every_field(text):
    with pytest.raises(argparse.ArgumentTypeError):
        _bench_fwd().fp8_tiles(text)


def test_graph_timing_is_refused_for_the_jax_peer_and_counts_calls(tmp_path, capsys):
    with pytest.raises(SystemExit):
        _bench_fwd().main(["--out", str(tmp_path), "--jax", "--graph", "20"])
    assert "--graph times the torch process" in capsys.readouterr().err
    for bad in ("-3", "x"):
        with pytest.raises(SystemExit):
            _bench_fwd().main(["--out", str(tmp_path), "--graph", bad])
        assert "expected a number of calls >= 0" in capsys.readouterr().err


def test_decode_steps_are_refused_for_the_jax_peer_and_the_backward(tmp_path, capsys):
    for other in ("--jax", "--backward"):
        with pytest.raises(SystemExit):
            _bench_fwd().main(["--out", str(tmp_path), "--decode", other])
        assert "--decode times the forward's decode steps" in capsys.readouterr().err


def test_jax_process_times_cudnn_fp8_with_extra_fp8(tmp_path, monkeypatch):
    """--jax asks bench.run_jax for cuDNN's FP8 forward exactly when --extra names fp8."""
    asked = []

    def run_jax(grid, reps, fp8=False):
        asked.append((len(grid), reps, fp8))
        return []

    monkeypatch.setattr(bench, "run_jax", run_jax)
    grid = ["--headdims", "64,128", "--seqlens", "512", "--causal", "0", "--reps", "7"]
    for extra, fp8 in ((["--extra", "fp8"], True), ([], False), (["--extra", "sm80"], False)):
        (tmp_path / "fwd_jax.json").unlink(missing_ok=True)
        assert _bench_fwd().main(["--out", str(tmp_path), "--jax", *grid, *extra]) == 0
        assert asked.pop() == (2, 7, fp8)
        assert (tmp_path / "fwd_jax.json").exists()


def test_jax_peers_say_by_name_where_cudnn_cannot_run(capsys):
    """On JAX's CPU device neither cuDNN forward runs: each is named unavailable, and no row is made."""
    jax = pytest.importorskip("jax")
    with jax.default_device(jax.devices("cpu")[0]):
        assert bench.run_jax([bench.Config("bfloat16", 64, False, 128, 1, 2)], reps=5, fp8=True) == []
    err = capsys.readouterr().err
    for name in ("jax-cudnn", "jax-cudnn-fp8"):
        assert f"  {name} unavailable for bfloat16 d= 64 causal=0 s=  128: " in err


@pytest.mark.parametrize("causal", [False, True])
def test_cudnn_fp8_peer_traces_to_cudnns_fp8_forward(monkeypatch, causal):
    """The FP8 peer's call, traced with cuDNN's version check answered (no GPU here): JAX accepts its
    FP8 parameters and layout and gives e4m3 out of q's shape, one argument tuple per q."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91900)
    shape = (2, 256, 4, 128)
    k, v, *qs = (jax.random.normal(jax.random.PRNGKey(i), shape, jnp.bfloat16) for i in range(4))
    call, arg_tuples = bench._jax_cudnn_fp8(qs, k, v, causal)
    assert len(arg_tuples) == 2 and all(args[1] is arg_tuples[0][1] for args in arg_tuples)  # k rounded once
    out = jax.eval_shape(call, *arg_tuples[1])
    assert out.shape == shape and out.dtype == jnp.float8_e4m3fn


@pytest.mark.gpu
def test_cudnn_fp8_peer_runs_and_agrees_with_cudnn_bf16():
    """On the GPU, cuDNN's FP8 forward (the fp8 benchmark's peer) gives a row beside cuDNN's bf16 one,
    its out within FP8's error of bf16's: standard normal inputs (|v| under ~5), each of v and out
    rounded to e4m3 (2^-4 relative; measured 0.14 on H100), where a lost descale or P scale would be
    off by orders of magnitude."""
    pytest.importorskip("jax")
    for causal in (False, True):
        rows = bench.run_jax([bench.Config("bfloat16", 128, causal, 1024, 2, 4)], reps=5, fp8=True)
        assert [r["impl"] for r in rows] == ["jax-cudnn", "jax-cudnn-fp8"]
        assert rows[0]["max_abs_diff_vs_first"] == 0 and 0 < rows[1]["max_abs_diff_vs_first"] < 0.5
        assert all(r["tflops"] > 0 for r in rows)


def test_fp8_accuracy_study_runs_on_the_reference(tmp_path, capsys):
    """The study's table on CPU (the reference's FP8 simulation): one row per (head dim, seqlen), the
    FP8 errors ordered as issue 6 expects, bf16's far below them, and the ratio column (a) / (c)."""
    pytest.importorskip("torch")
    out = tmp_path / "fp8.md"
    assert _script("fp8_accuracy").main(["--headdims", "64", "--seqlens", "200,300", "--device", "cpu",
                                          "--out", str(out)]) == 0
    text = out.read_text()
    assert text.strip() == capsys.readouterr().out.strip()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| 64 |")]
    assert [int(r[1]) for r in rows] == [200, 300]
    for _, _, bf16, a, b, c, ratio in rows:
        bf16, a, b, c = map(float, (bf16, a, b, c))
        assert bf16 < c / 4 and c < b < a and float(ratio) == pytest.approx(a / c, abs=0.01)


def test_fp8_accuracy_parts_split_the_errors(capsys):
    """--parts: rounding q and k only, or v only, each errs less than rounding all three, and the
    transform lowers q and k's part."""
    pytest.importorskip("torch")
    assert _script("fp8_accuracy").main(["--headdims", "64", "--seqlens", "300", "--device", "cpu", "--parts"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("| head dim"))
    names = [cell.strip() for cell in header.split("|")[1:-1]]
    assert names[-4:] == ["(a) q, k only", "(c) q, k only", "v only", "(a) / (c)"]
    row = dict(zip(names, (cell.strip() for cell in next(line for line in lines if line.startswith("| 64 |")).split("|")[1:-1])))
    err = {name: float(row[name]) for name in names[2:-1]}
    a, c = err["(a) per tensor"], err["(c) per 128 rows + Hadamard"]
    assert err["(c) q, k only"] < err["(a) q, k only"] < a and err["(c) q, k only"] < c and err["v only"] < c
