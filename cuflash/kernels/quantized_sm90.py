"""fwd_quantized_sm90: attention(q, k, v, fp8=True) on Hopper as one op (attention_quantized_forward).
Its launch runs, on the caller's stream: quantize_fp8 on q (one scale per 128 rows) and on k (one
per reference.fp8_key_block rows: 192 at head dim 128 from 2k keys), after the Hadamard transform
where asked; quantize_fp8_vt on v (k's blocks), which writes e4m3 V straight into V^T (the layout
the pre-transposed FP8 forward loads, so no e4m3 V is written and read again by a pass of its
own); then fwd_fp8_sm90 on a pre-transposed tile row whose key block is k's and v's scale block.
The e4m3 copies and the descales are workspace (Family.workspace: the caller's framework allocates
them, CuPy's as uint8 bits, so CuPy arrays take this path too). Semantics:
reference.attention_quantized."""
from __future__ import annotations

import dataclasses

from .. import jit, reference
from . import Family, compiled_headdim, rows_aligned
from . import fwd_sm90, quantize_fp8
from .forward import check_headdim

FAMILY_NAME = "fwd_quantized_sm90"
FP8 = fwd_sm90.FP8


def _fp8_problem(problem):
    """The attention_fp8_forward problem the attention kernel runs: e4m3 inputs, out in the inputs' dtype
    (fp8_block as attention_fp8's: FP8_WIDE_KEY_BLOCK where k and v take 192-row scales)."""
    wide = _key_block(problem) == reference.FP8_WIDE_KEY_BLOCK
    return dataclasses.replace(problem, op="attention_fp8_forward", dtype=FP8,
                               fp8_block=reference.FP8_WIDE_KEY_BLOCK if wide else None, hadamard_seed=None)


def _key_block(problem) -> int:
    """Rows per k and v scale of this call (reference.fp8_key_block), the key block of its row."""
    return reference.fp8_key_block(problem.headdim, problem.seqlen_k)


def _quantize_problem(problem, name: str):
    """The quantize_fp8 problem of q, k or v: one scale per FP8_BLOCK rows of q, per
    reference.fp8_key_block rows of k and v; q and k with the call's transform."""
    seqlen, nheads = (problem.seqlen_q, problem.nheads) if name == "q" else (problem.seqlen_k, problem.nheads_kv)
    block = reference.FP8_BLOCK if name == "q" else _key_block(problem)
    return dataclasses.replace(problem, op="quantize_fp8", seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads,
                               nheads_kv=nheads, fp8_block=block, causal=False, window_left=-1,
                               window_right=-1, out_dtype=None,
                               hadamard_seed=None if name == "v" else problem.hadamard_seed)


def _tiles(problem) -> tuple[int, int, int, str, str, bool]:
    """The FP8 forward's tile row (or the forced one, fwd_sm90.fp8_tiles_override). Where k's and v's
    scale blocks are 128 keys, fwd_fp8_sm90's own row for the problem, always pre-transposed: V^T
    costs no pass of its own here. A row that transposes V in the kernel keeps its blocks, stages,
    sync and schedule: end to end on H100 (session 31, one graph-timed run each,
    benchmarks/NOTES-fp8.md) those measured within 1% of the in-kernel row at head dims 64 (1k, 4k)
    and 128 (1k) and 4% faster at 128, 2k, where the head dim's own V^T-beforehand row of FP8_TILES
    was 0-9% slower. Where they are wider (reference.fp8_key_block: 192 keys at head dim 128 from 2k
    keys), the row of that key block, FP8_PER_HEAD_TILES'."""
    headdim = compiled_headdim(problem.headdim, fwd_sm90.FP8_HEADDIMS)
    forced = fwd_sm90.fp8_forced_row(headdim)
    if forced is not None:
        return forced
    if _key_block(problem) != reference.FP8_BLOCK:
        return fwd_sm90.FP8_PER_HEAD_TILES[headdim]
    return (*fwd_sm90.fp8_tiles(_fp8_problem(problem))[:5], True)


def workspace(problem) -> dict[str, tuple[tuple[int, ...], str]]:
    """q8, k8 and v's e4m3 copy (V^T for a pre-transposed row, else v8), and the three descales."""
    b, sq, sk, h, hkv, d = (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.nheads, problem.nheads_kv,
                            problem.headdim)
    key_blocks = reference.fp8_blocks(sk, _key_block(problem))
    buffers = {"q8": ((b, sq, h, d), FP8), "k8": ((b, sk, hkv, d), FP8),
               "q_descale": ((b, h, reference.fp8_blocks(sq)), "float32"),
               "k_descale": ((b, hkv, key_blocks), "float32"), "v_descale": ((b, hkv, key_blocks), "float32")}
    if d > fwd_sm90.FP8_HEADDIMS[-1]:  # refused by select: no V to lay out
        return buffers
    if _tiles(problem)[5]:
        buffers["v_transposed"] = (fwd_sm90.v_transposed_shape(problem.batch, problem.seqlen_k, hkv, d), FP8)
    else:
        buffers["v8"] = ((b, sk, hkv, d), FP8)
    return buffers


def select(problem, inputs) -> fwd_sm90.FwdSm90Variant:
    check_headdim(FAMILY_NAME, problem.headdim, fwd_sm90.FP8_HEADDIMS[-1])
    if problem.seqlen_q == 0 or problem.seqlen_k == 0:  # (as fwd_sm90.check_loadable says it)
        raise ValueError(f"{FAMILY_NAME} loads through TMA descriptors, which cannot describe an empty q, k or v")
    if problem.headdim % 16:
        raise ValueError(f"{FAMILY_NAME} loads e4m3 rows of 16-byte multiples: head dims that are multiples of 16; "
                         f"got {problem.headdim}")
    for name in ("q", "k", "v"):
        quantize_problem = _quantize_problem(problem, name)
        quantize_fp8.select(quantize_problem, {"x": inputs[name]})
        quantize_fp8.check_items(quantize_problem.batch, quantize_problem.nheads, quantize_problem.seqlen_q,
                                 quantize_problem.fp8_block)
    fp8 = _fp8_problem(problem)
    tiles = _tiles(problem)
    headdim = compiled_headdim(problem.headdim, fwd_sm90.FP8_HEADDIMS)
    key_block = _key_block(problem)
    if tiles[1] != key_block:
        raise ValueError(f"{FAMILY_NAME} quantizes k and v per {key_block} rows at head dim {problem.headdim}: a "
                         f"forced row of {tiles[1]} keys cannot take them")
    if not tiles[5] and -(-problem.seqlen_k // tiles[1]) > fwd_sm90.FP8_MAX_KEY_BLOCKS:  # (a forced row)
        raise ValueError(f"{FAMILY_NAME} on a row that transposes V in the kernel takes at most "
                         f"{fwd_sm90.FP8_MAX_KEY_BLOCKS * tiles[1]} keys; got seqlen_k {problem.seqlen_k}")
    variant = fwd_sm90.fp8_variant(problem.dtype, headdim, tiles, fwd_sm90.mask_fields(fwd_sm90.FP8_PASS_BY, headdim, fp8),
                                   problem.with_lse, kv_per_head=False,  # (k and v per block of keys)
                                   fast_exp=problem.fast_exp)
    fwd_sm90.check_tile_count(FAMILY_NAME, fp8, variant)
    return variant


def prepare(variant: fwd_sm90.FwdSm90Variant, function, problem, inputs, outputs):
    """Family.prepare: the four launches, each prepared once (quantize_fp8.prepare,
    quantize_fp8.prepare_transposed, fwd_sm90.prepare), run one after the other on the stream as a
    chain (grid_dependency.cuh, ChainLink): each after the first launched as the programmatic
    dependent of the one before, so that the quantizers overlap each other's tails (they share no
    data) and the attention kernel's setup overlaps the last one's; it waits for them all before
    it reads. Over ordinary launches (H200, FA3 sizing, session 50 in benchmarks/NOTES-fp8.md):
    +3.5% at head dim 128 and 1k keys (causal +4.3%), +1.4% at 4k; 256 +4.0% at 1k, +0.9% at 8k."""
    index = problem.device.index
    launches = []
    # quantize_fp8 on q, k, and v too where the row transposes V in the kernel (a forced row)
    for name in ("q", "k") if variant.v_pretransposed else ("q", "k", "v"):
        quantize_problem = _quantize_problem(problem, name)
        quantizer = quantize_fp8.select(quantize_problem, {"x": inputs[name]})
        launch = quantize_fp8.prepare(quantizer, jit.get_function(quantizer, index), quantize_problem,
                                      {"x": inputs[name]}, _quantized(outputs, name), dependent=name != "q")
        launches.append(lambda inputs, outputs, stream, launch=launch, name=name:
                        launch({"x": inputs[name]}, _quantized(outputs, name), stream))
    if variant.v_pretransposed:
        headdim = compiled_headdim(problem.headdim, quantize_fp8.HEADDIMS)
        aligned = rows_aligned(inputs["v"], quantize_fp8.ELEMENT_BYTES)
        quantizer = quantize_fp8.QuantizeFp8TransposedVariant(
            problem.dtype, _key_block(problem), headdim,
            quantize_fp8.select_loads(index, aligned, _key_block(problem), headdim))
        launch_v = quantize_fp8.prepare_transposed(quantizer, jit.get_function(quantizer, index), index, problem.batch,
                                                   problem.seqlen_k, problem.nheads_kv, problem.headdim, inputs["v"],
                                                   outputs["v_transposed"], dependent=True)
        launches.append(lambda inputs, outputs, stream:
                        launch_v(inputs["v"], outputs["v_transposed"], outputs["v_descale"], stream))
    attention = fwd_sm90.prepare(variant, function, _fp8_problem(problem), _attention_inputs(outputs),
                                 outputs, after_chain=True)
    launches.append(lambda inputs, outputs, stream: attention(_attention_inputs(outputs), outputs, stream))

    def launch_prepared(inputs, outputs, stream) -> None:
        for launch in launches:
            launch(inputs, outputs, stream)

    return launch_prepared


def _quantized(outputs, name: str) -> dict:
    """quantize_fp8's outputs for q, k or v (as v8): the workspace's e4m3 copy and descale."""
    return {"x8": outputs[f"{name}8"], "descale": outputs[f"{name}_descale"]}


def _attention_inputs(outputs) -> dict:
    """The FP8 forward's inputs, from the workspace (v: only where the row transposes V in the kernel)."""
    inputs = {"q": outputs["q8"], "k": outputs["k8"]}
    if "v8" in outputs:
        inputs["v"] = outputs["v8"]
    return {**inputs, **{name: outputs[name] for name in ("q_descale", "k_descale", "v_descale")}}


def _flipped_rows(headdim: int) -> list[tuple]:
    """FP8_TILES' rows at this head dim that transpose V in the kernel, pre-transposed, but those
    FP8_TILES has as they are (fwd_fp8_sm90's variants; so is FP8_PER_HEAD_TILES', _tiles' row where
    k and v take wider blocks)."""
    rows = [row for _, row in fwd_sm90.FP8_TILES[headdim]]
    return [fwd_sm90.pretransposed(row) for row in rows if not row[5] and fwd_sm90.pretransposed(row) not in rows]


def variants_for(compute_capability: tuple[int, int]) -> tuple:
    """Its kernel of its own (V to V^T) and the FP8 forward's rows that transpose V in the kernel,
    pre-transposed (_tiles); the others are quantize_fp8's and fwd_fp8_sm90's variants."""
    attention = tuple(variant for out in sorted(fwd_sm90.CXX_TYPES) for hd in fwd_sm90.FP8_HEADDIMS
                      for tiles in _flipped_rows(hd) for variant in fwd_sm90.fp8_row_variants(out, hd, tiles, (False,)))
    return quantize_fp8.TRANSPOSED_VARIANTS + attention


FAMILY = Family(
    name=FAMILY_NAME,
    backend="sm90",
    ops=("attention_quantized_forward",),
    description="attention(fp8=True) on Hopper: q, k quantized (Hadamard optional), v quantized into V^T, "
                "then the FP8 forward",
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    variants_for=variants_for,
    select=select,
    prepare=prepare,
    workspace=workspace,
)
