"""Representative calls of every kernel family, small enough for compute-sanitizer (memcheck,
racecheck, synccheck): aligned and misaligned, fp16 and bf16, odd shapes, empty rows, varlen,
each head dim class and both K/V pipelines; the forward on every backend this GPU has (fwd_sm90
on Hopper besides fwd_sm80). Run by tests/device_check.sh."""
import cupy as cp, numpy as np, ml_dtypes
import cuflash
from cuflash import api, reference
def randn(shape, dtype, offset=0):
    n = int(np.prod(shape))
    x = np.random.standard_normal(n + offset).astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    return cp.asarray(x)[offset:].reshape(shape)
for dtype, shape, offset in (("float16", (2, 129, 3, 128), 0), ("bfloat16", (1, 7, 2, 96), 1), ("float16", (3, 1, 5, 256), 8)):
    o, g = randn(shape, dtype, offset), randn(shape, dtype)
    d = api.backward_preprocess(g, o)
    print("bwd_preprocess", dtype, shape, float(np.abs(d.get() - reference.backward_preprocess(cp.asnumpy(g).astype(np.float64), cp.asnumpy(o).astype(np.float64))).max()))
CASES = (("bfloat16", 200, 333, 4, 2, 128, dict(causal=True)), ("float16", 77, 50, 2, 1, 64, dict(window=(16, 8), softcap=5.0)),
         ("bfloat16", 130, 130, 2, 2, 256, {}), ("float16", 65, 1, 2, 2, 40, dict(causal=True)),
         ("float16", 300, 300, 2, 2, 64, {}), ("bfloat16", 129, 257, 2, 1, 32, dict(window=(40, -1))),
         # more tiles than a Hopper has SMs: the persistent fwd_sm90 runs several tiles per CTA
         ("bfloat16", 600, 600, 32, 8, 64, dict(causal=True)), ("float16", 300, 300, 48, 48, 256, {}),
         ("bfloat16", 300, 300, 64, 16, 128, dict(causal=True)),
         # and unmasked (head dim 128: two ping-pong consumers; 64: three)
         ("bfloat16", 500, 700, 48, 8, 128, {}), ("float16", 700, 500, 40, 40, 64, {}),
         # the tile table's rows at head dim 128 past 1024 keys: three consumers (up to 4096), then
         # two with the P V overlap; at head dim 256 past 512 keys (the cases above: the serial
         # schedule's row, O staged in the last V slot), 80-key blocks; and tiles without key blocks
         # there (their O zero, not staged)
         ("bfloat16", 300, 2100, 4, 2, 128, dict(causal=True)), ("bfloat16", 300, 4200, 4, 2, 128, {}),
         ("bfloat16", 300, 700, 8, 2, 256, dict(causal=True)), ("bfloat16", 700, 100, 4, 2, 256, dict(causal=True)),
         # decode steps: GQA's query heads as rows of their kv head, and (fwd_sm90, few tiles) split-KV
         # with float32 partials merged by combine_splits; the small unmasked cases above split too
         ("bfloat16", 1, 5000, 16, 4, 128, dict(causal=True)), ("float16", 1, 700, 8, 1, 256, {}),
         ("bfloat16", 5, 3000, 2, 2, 64, dict(softcap=5.0)),
         # a speculative step of a few causal rows: the masked split variants
         # (at head dim 256 passing blocks by)
         ("bfloat16", 4, 6000, 8, 2, 128, dict(causal=True)), ("float16", 3, 2500, 2, 1, 256, dict(window=(-1, 1))),
         ("bfloat16", 4, 5000, 8, 1, 64, dict(causal=True)))
BACKENDS = ["sm80"] + (["sm90"] if cp.cuda.Device().compute_capability == "90" else [])
for backend in BACKENDS:
    for dtype, sq, sk, h, hkv, d, kw in CASES:
        q, k, v = randn((1, sq, h, d), dtype), randn((1, sk, hkv, d), dtype), randn((1, sk, hkv, d), dtype)
        out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend, **kw)
        ref, _ = reference.forward(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)), **kw)
        print(backend, dtype, (sq, sk, h, hkv, d), kw, float(np.abs(cp.asnumpy(out).astype(np.float64) - ref).max()))
    cu = cp.asarray(np.array([0, 5, 5, 140], np.int32))
    q, k = randn((140, 4, 64), "float16"), randn((140, 2, 64), "float16")
    out = cuflash.attention_varlen(q, k, k, cu, cu, 135, 135, causal=True, backend=backend)
    print(backend, "varlen ran; max |out| =", float(cp.abs(out.astype(cp.float32)).max()))
# the backward (bwd_sm80, and bwd_sm90 on Hopper), each bwd_sm80 tile shape of its table: Pᵀ in registers (32, 64) or through shared
# memory (96-256), 224 padded to 256's kernel; GQA, sliding window, softcap, ragged tails, key blocks no
# query sees, a padded head dim; deterministic (ordered dQ) and varlen with an empty sequence
for dtype, d, kw in (("bfloat16", 64, dict(window=(10, 0))), ("float16", 32, dict(window=(10, 0))),
                     ("bfloat16", 128, dict(causal=True, deterministic=True)), ("float16", 80, dict(softcap=4.0)),
                     ("bfloat16", 224, dict(window=(30, 5))), ("float16", 256, dict(deterministic=True))):
    fwd_kw = {n: x for n, x in kw.items() if n != "deterministic"}
    q, k = randn((2, 77, 4, d), dtype), randn((2, 130, 2, d), dtype)
    out, lse = cuflash.attention(q, k, k, return_lse=True, **fwd_kw)
    # bwd_sm90 (Hopper) as well where it serves the call: not deterministic (224: the split head)
    for backend in BACKENDS if not kw.get("deterministic") else ["sm80"]:
        dq, dk, dv = cuflash.attention_backward(out, q, k, k, out, lse, backend=backend, **kw)
        print("bwd", backend, dtype, d, kw, "ran; max |dk| =", float(cp.abs(dk.astype(cp.float32)).max()))
cu_q, cu_k = cp.asarray(np.array([0, 70, 70, 173], np.int32)), cp.asarray(np.array([0, 5, 90, 190], np.int32))
for backend, deterministic in [("sm80", False), ("sm80", True)] + [("sm90", False)] * ("sm90" in BACKENDS):
    q, k = randn((173, 4, 128), "bfloat16"), randn((190, 2, 128), "bfloat16")
    out, lse = cuflash.attention_varlen(q, k, k, cu_q, cu_k, 103, 100, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_varlen_backward(out, q, k, k, out, lse, cu_q, cu_k, 103, 100, causal=True,
                                                   deterministic=deterministic, backend=backend)
    print("bwd", backend, "varlen deterministic", deterministic, "ran; max |dq| =", float(cp.abs(dq.astype(cp.float32)).max()))
# bwd_sm90 with more query tiles than Q/dO slots in flight and both consumers taking dQ turns
if "sm90" in BACKENDS:
    q, k = randn((1, 700, 4, 64), "float16"), randn((1, 300, 1, 64), "float16")
    out, lse = cuflash.attention(q, k, k, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(out, q, k, k, out, lse, backend="sm90")
    print("bwd sm90 GQA 4, 700 x 300 ran; max |dq| =", float(cp.abs(dq.astype(cp.float32)).max()))
    # the split head (head dim 256): both consumers' halves of Pᵀ and dSᵀ through shared memory, ragged tails
    q, k = randn((2, 333, 4, 256), "bfloat16"), randn((2, 200, 2, 256), "bfloat16")
    out, lse = cuflash.attention(q, k, k, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(out, q, k, k, out, lse, causal=True, backend="sm90")
    print("bwd sm90 head dim 256 GQA 2, 333 x 200 causal ran; max |dk| =", float(cp.abs(dk.astype(cp.float32)).max()))
try:
    import torch
except ImportError:
    torch = None
    print("quantize_fp8 not run: it needs torch (CuPy has no e4m3 dtype)")
if torch is not None and int(cp.cuda.Device().compute_capability) >= 89:  # quantize_fp8: e4m3 from sm_89
    for dtype, shape, block, hadamard in (("bfloat16", (2, 129, 3, 128), None, True), ("float16", (1, 77, 2, 40), 128, False),
                                          ("bfloat16", (1, 300, 1, 256), 128, True), ("float16", (1, 5, 2, 64), 128, False),
                                          ("float16", (1, 40000, 1, 64), None, False),  # more blocks than threads
                                          ("bfloat16", (2, 200, 3, 128), 128, False), ("float16", (1, 131, 2, 256), None, False)):
        x = torch.randn(shape, device="cuda", dtype=getattr(torch, dtype))
        x8, descale = cuflash.quantize_fp8(x, block=block, hadamard=hadamard, seed=3)
        print("quantize_fp8", dtype, shape, block, hadamard, "ran; descale", tuple(descale.shape), "max", float(descale.max()))
    for block in (None, 128):  # rows 2 bytes past 16-byte boundaries: element-wise loads
        x = torch.randn((1, 300, 2, 72), device="cuda", dtype=torch.float16)[..., 1:65]
        x8, descale = cuflash.quantize_fp8(x, block=block, hadamard=True, seed=3)
        print("quantize_fp8 misaligned", block, "ran; descale max", float(descale.max()))
    if int(cp.cuda.Device().compute_capability) == 90:  # fwd_fp8_sm90: V transposed by the producer warps
        # or beforehand into a workspace (head dim 256 beyond 512 query rows or from 256 with no more
        # keys, 128 beyond 2048, 64 beyond 4096: fwd_sm90.FP8_TILES, FP8_SHORT_KEYS_PRETRANSPOSED; there,
        # with per-head descales, the wider blocks of FP8_PER_HEAD_TILES)
        for shape_q, shape_k, block, causal, *lse in (((2, 300, 4, 128), (2, 333, 2, 128), 128, True),
                                                      ((1, 129, 2, 256), (1, 257, 1, 256), None, False),
                                                      ((1, 64, 2, 64), (1, 1, 2, 64), 128, False),
                                                      ((2, 400, 4, 64), (2, 333, 2, 64), None, True),
                                                      ((1, 300, 4, 128), (1, 2100, 2, 128), 128, True),
                                                      ((1, 2100, 2, 128), (1, 2200, 1, 128), None, True),
                                                      ((1, 2100, 2, 128), (1, 2200, 1, 128), 128, False),
                                                      ((1, 600, 2, 256), (1, 2061, 1, 256), None, False),
                                                      ((2, 300, 2, 256), (2, 290, 1, 256), None, True),
                                                      ((2, 700, 2, 256), (2, 555, 2, 256), 128, True),
                                                      ((1, 200, 2, 64), (1, 4099, 2, 64), 128, False),
                                                      ((1, 4100, 2, 64), (1, 4111, 1, 64), 128, True),
                                                      ((1, 4100, 2, 64), (1, 4111, 1, 64), None, True),
                                                      # unmasked, without the LSE: FP8_EXP_ON_FMA's rows
                                                      # (the two causal ones just above, at 64, too)
                                                      ((1, 2100, 2, 128), (1, 2200, 1, 128), None, False),
                                                      ((1, 4100, 2, 64), (1, 4111, 1, 64), 128, False),
                                                      # returning the LSE (a fifth field): FP8_LSE_EXP_PAIRS'
                                                      # rows, exponential pairs on the FMA pipe
                                                      ((1, 2100, 2, 128), (1, 2200, 1, 128), 128, False, True),
                                                      ((1, 2100, 2, 128), (1, 2200, 1, 128), 128, True, True),
                                                      ((1, 4100, 2, 64), (1, 4111, 1, 64), 128, False, True),
                                                      ((1, 2100, 2, 128), (1, 2200, 1, 128), None, False, True),
                                                      # decode steps: query heads as rows (q's descales one a
                                                      # row: a split variant, in one part for few keys) and
                                                      # split-KV; MHA split
                                                      ((1, 1, 16, 128), (1, 5000, 4, 128), 128, True),
                                                      ((4, 1, 32, 64), (4, 700, 8, 64), None, True),
                                                      ((2, 1, 8, 256), (2, 3000, 8, 256), None, True),
                                                      # speculative steps of a few causal rows: the masked
                                                      # split variants (at head dim 256 passing blocks by)
                                                      ((1, 4, 8, 128), (1, 6000, 2, 128), 128, True),
                                                      ((1, 3, 2, 256), (1, 2500, 1, 256), None, True),
                                                      ((1, 4, 8, 64), (1, 5000, 1, 64), 128, True)):
            q, k = (torch.randn(s, device="cuda", dtype=torch.bfloat16) for s in (shape_q, shape_k))
            (q8, qd), (k8, kd) = cuflash.quantize_fp8(q, block=block), cuflash.quantize_fp8(k, block=block)
            out = cuflash.attention_fp8(q8, k8, k8, qd, kd, kd, causal=causal, return_lse=bool(lse))
            out = out[0] if lse else out
            print("fwd_fp8_sm90", shape_q, shape_k, block, causal, "LSE" if lse else "", "ran; max |out| =",
                  float(out.abs().max()))
        # attention(fp8=True) (fwd_quantized_sm90: q and k quantized, v straight into V^T, then the
        # FP8 forward) on CuPy arrays: its e4m3 copies held as uint8 bits; ragged key tails (V^T's
        # padding keys), GQA, misaligned v rows (element loads), and each head dim
        for dtype, shape_q, shape_k, hadamard, offset in (("float16", (1, 600, 2, 256), (1, 700, 1, 256), True, 0),
                                                          ("bfloat16", (2, 300, 4, 128), (2, 333, 2, 128), False, 1),
                                                          ("float16", (1, 130, 2, 64), (1, 1, 2, 64), True, 0),
                                                          ("bfloat16", (1, 77, 2, 96), (1, 140, 1, 96), False, 1),
                                                          # from 4096 keys at 128: k, v per 192 rows, 192-key row
                                                          ("bfloat16", (1, 200, 2, 128), (1, 4200, 1, 128), True, 1)):
            q, k, v = randn(shape_q, dtype), randn(shape_k, dtype), randn(shape_k, dtype, offset)
            out = cuflash.attention(q, k, v, fp8=True, hadamard=hadamard, causal=True)
            print("fwd_quantized_sm90 CuPy fp8=True", dtype, q.shape, k.shape, hadamard, offset,
                  "ran; max |out| =", float(cp.abs(out.astype(cp.float32)).max()))
