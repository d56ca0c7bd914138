"""Every registered variant compiles offline (no GPU) for sm_80, sm_86 (the tile tables' rows for
~100 KB of shared memory) and sm_90a, with zero spills and no local memory: the check CI runs on
each change to cuda_src/ or the registry."""
import pytest

from cuflash import jit, kernels


@pytest.fixture(scope="module", params=["sm_80", "sm_86", "sm_90a"])
def report(request):
    arch = request.param
    cc = jit.compute_capability_of(arch)
    variants = kernels.variants_for(cc)
    return arch, variants, jit.offline_report(arch, variants)


def test_every_variant_compiles_without_spills_or_local_memory(report):
    arch, variants, rows = report
    assert [r["uri"] for r in rows] == [v.uri for v in variants]
    for r in rows:
        assert r["registers"] > 0, r
        assert r["spill_store_bytes"] == 0 and r["spill_load_bytes"] == 0, r
        if r["family"] == "check_cu_seqlens":  # printf's arguments, on its error path, go through a local buffer
            assert r["stack_frame_bytes"] <= 64 and r["local_memory_instructions"] == r["sass_opcodes"].get("STL"), r
        else:
            assert r["stack_frame_bytes"] == 0, r
            assert r["local_memory_instructions"] == 0, r
        assert r["sass_opcodes"].get("EXIT", 0) >= 1, r


def test_bwd_preprocess_sass_matches_its_design(report):
    """16-byte vector loads where the variant asks for them, a warp-shuffle reduction, no division."""
    _, _, rows = report
    for r in rows:
        if r["family"] != "bwd_preprocess":
            continue
        ops = r["sass_opcodes"]
        assert ops.get("LDG", 0) > 0 and ops.get("STG", 0) == 1, r["uri"]
        assert ops.get("SHFL", 0) >= 1, r["uri"]
        assert "CALL" not in ops, f"{r['uri']} calls a subroutine (integer division?)"


def test_uris_and_name_expressions_are_unique():
    variants = kernels.variants_for((8, 0)) + kernels.variants_for((9, 0)) + kernels.variants_for((8, 6))
    variants = list({v.uri: v for v in variants}.values())
    assert len({v.uri for v in variants}) == len(variants)
    assert len({v.name_expression for v in variants}) == len(variants)


def test_source_hash_is_in_the_compile_options():
    assert any(o.startswith("-DCUFLASH_SOURCE_HASH=0x") and jit.source_hash()[:16] in o
               for o in jit.compile_options("sm_90a"))


def test_illegal_variants_are_refused():
    from cuflash.kernels.bwd_preprocess import BwdPreprocessVariant

    with pytest.raises(ValueError, match="vec"):
        BwdPreprocessVariant("float16", 100, 8)
    with pytest.raises(ValueError, match="dtype"):
        BwdPreprocessVariant("float32", 128, 8)


def test_fwd_sm80_sass_uses_the_tensor_core_path(report):
    """mma.sync -> HMMA, ldmatrix -> LDSM, cp.async -> LDGSTS, exp2 on the SFU -> MUFU."""
    _, _, rows = report
    fwd = [r for r in rows if r["family"] == "fwd_sm80"]
    assert fwd
    for r in fwd:
        ops = r["sass_opcodes"]
        for opcode in ("HMMA", "LDSM", "LDGSTS", "MUFU"):
            assert ops.get(opcode, 0) > 0, f"{r['uri']} has no {opcode}"


def test_fwd_sm90_sass_uses_the_hopper_path(report):
    """wgmma -> HGMMA (QGMMA for e4m3), TMA -> UTMALDG, mbarriers -> SYNCS, setmaxnreg -> USETMAXREG;
    and ptxas did not serialise the wgmmas (C7510/C7515: accumulators touched mid-pipeline, or
    registers short)."""
    arch, _, rows = report
    fwd = [r for r in rows if r["name_expression"].startswith("cuflash::fwd_sm90<")]
    if arch != "sm_90a":
        assert not fwd, "sm_90a kernels must not be offered to other archs"
        return
    assert {r["family"] for r in fwd} == {"fwd_sm90", "fwd_fp8_sm90"}
    for r in fwd:
        ops = r["sass_opcodes"]
        mma = "QGMMA" if r["family"] == "fwd_fp8_sm90" else "HGMMA"
        for opcode in (mma, "UTMALDG", "SYNCS", "USETMAXREG", "MUFU"):
            assert ops.get(opcode, 0) > 0, f"{r['uri']} has no {opcode}"
        assert not {"C7510", "C7515"} & set(r["ptxas_notes"]), f"{r['uri']}: wgmma serialised {r['ptxas_notes']}"


def test_fp8_v_transpose_kernel_comes_with_the_pretransposed_variants(report):
    """The FP8 table's pre-transposed rows bring the kernel that writes V^T: byte permutes (PRMT) and
    stores, nothing spilled."""
    arch, _, rows = report
    pretransposed = [r for r in rows if r["family"] == "fwd_fp8_sm90" and "v_pretransposed=True" in r["uri"]]
    transpose = [r for r in rows if r["name_expression"].startswith("cuflash::transpose_v_fp8<")]
    assert bool(transpose) == bool(pretransposed)
    for r in transpose:
        assert r["sass_opcodes"].get("PRMT", 0) > 0 and r["sass_opcodes"].get("STG", 0) > 0, r["sass_opcodes"]
        assert r["spill_store_bytes"] == 0 and r["local_memory_instructions"] == 0


def test_split_kv_variants_come_with_the_combine_kernel(report):
    """fwd_sm90's split-KV variants (float32 partials, stored straight: 8-byte STG) come with
    combine_splits, which merges them (exponentials on the SFU, 8-byte stores), nothing spilled."""
    arch, _, rows = report
    split = [r for r in rows if r["family"] == "fwd_sm90" and "split_kv=True" in r["uri"]]
    combine = [r for r in rows if r["name_expression"].startswith("cuflash::combine_splits<")]
    assert bool(split) == bool(combine) == (arch == "sm_90a")
    for r in split + combine:
        assert r["sass_opcodes"].get("STG", 0) > 0 and r["spill_store_bytes"] == 0, r["uri"]
    for r in combine:
        assert r["sass_opcodes"].get("MUFU", 0) > 0 and r["local_memory_instructions"] == 0, r["sass_opcodes"]


def test_fwd_sm90_main_loops_keep_their_counters_uniform(report):
    """The consumers' slot, phase and descriptor arithmetic stays in uniform registers: at most a few
    R2UR between the first and the last wgmma. When ptxas loses the counters' uniformity (it did, for
    a change of code shape, benchmarks/NOTES-sm90.md version 13) there are 35-86, and the kernels lose
    2-7% of their speed. The serial schedule at head dim 256 has 25: 16 at the tile's last P V (once a
    tile) and 9 in the loop's S = Q K^T, whose 16 k steps' descriptors (64 uniform registers) ptxas
    keeps partly in ordinary ones; measured as it is (NOTES-sm90.md, version 38). (e4m3's 192-key
    row with P's row sums on the tensor cores had 28 until its loop broadcast the counter again each
    block, kRebroadcastEachBlock: NOTES-fp8.md, session 41.)"""
    arch, _, rows = report
    for r in rows:
        if r["family"] in ("fwd_sm90", "fwd_fp8_sm90", "bwd_sm90"):
            bound = 32 if "schedule=serial" in r["uri"] else 16
            assert r["r2ur_between_gmmas"] <= bound, f"{r['uri']}: {r['r2ur_between_gmmas']} R2UR in its main loops"


def test_fwd_sm90_register_split_fits_the_register_file():
    """setmaxnreg moves registers between warpgroups of one CTA: for each consumer count, the
    producer's and the consumers' budgets must fit 64K registers, in steps of 8 within [24, 256]
    (the kernel static_asserts the first; this reads the table and checks both)."""
    import re

    from cuflash.jit import source_dir

    text = (source_dir() / "common" / "sm90.cuh").read_text()  # the table fwd_sm90 and bwd_sm90 share
    splits = re.findall(r"struct RegisterSplit<(\d)> \{\s*static constexpr int kProducer = (\d+), kConsumer = (\d+);", text)
    assert {int(c) for c, _, _ in splits} == {1, 2, 3}
    for consumers, producer, consumer in ((int(a), int(b), int(c)) for a, b, c in splits):
        assert 128 * (producer + consumers * consumer) <= 65536
        assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= producer <= consumer <= 256


def test_fwd_sm90_tile_counter_slots_match_the_kernel():
    """The host hands out counter slots modulo TILE_COUNTERS; the kernel has kTileCounters of them."""
    import re

    from cuflash.jit import source_dir
    from cuflash.kernels import fwd_sm90

    text = (source_dir() / "fwd_sm90.cu").read_text()
    assert int(re.search(r"constexpr int kTileCounters = (\d+);", text).group(1)) == fwd_sm90.TILE_COUNTERS
