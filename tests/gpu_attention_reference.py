"""Attention in torch on the GPU, for the GPU tests: the float32/float64 reference of the
contract (checked against cuflash.reference in test_gpu_fwd) and the "plain low-precision
implementation" FlashAttention's test criterion compares against (scores, softmax and PV in
the input dtype); run_poisoned, which runs a forward Problem into NaN-poisoned outputs; and
signed_scores_inputs, inputs whose scores are negative by design."""
import math

import torch


def visible(seqlen_q: int, seqlen_k: int, left: int, right: int, device) -> torch.Tensor:
    """(seqlen_q, seqlen_k) bool: query i sees key j iff i + off - left <= j <= i + off + right."""
    i = torch.arange(seqlen_q, device=device)[:, None]
    j = torch.arange(seqlen_k, device=device)[None, :]
    diag = i + (seqlen_k - seqlen_q)
    ok = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        ok &= j >= diag - left
    if right >= 0:
        ok &= j <= diag + right
    return ok


def attention(q, k, v, *, compute_dtype, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0):
    """q (B, Sq, H, D), k/v (B, Sk, Hkv, D) -> (out (B, Sq, H, D) in compute_dtype, lse (B, H, Sq) float32).
    Rows that see no key give 0 and -inf. compute_dtype = q.dtype is the plain low-precision version."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    left, right = window[0], (0 if causal else window[1])
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(headdim)
    group = nheads // nheads_kv
    qt = q.to(compute_dtype).transpose(1, 2)  # (B, H, Sq, D)
    kt = k.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.to(compute_dtype).transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    mask = visible(seqlen_q, seqlen_k, left, right, q.device)
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no visible key: all -inf -> 0
    out = torch.matmul(p, vt).transpose(1, 2)
    return out, lse


def _poisoned(shape, dtype: str) -> torch.Tensor:
    """A workspace buffer with every byte 0x7f: NaN in e4m3 and float16 (in bfloat16 and float32 a
    value near their largest, which still shows in out)."""
    dtype = getattr(torch, dtype)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.full((nbytes,), 0x7F, device="cuda", dtype=torch.uint8).view(dtype).view(shape)


def run_poisoned(problem, inputs, out_shape, lse_shape, out_dtype, workspace_out=None):
    """dispatch.execute a forward Problem on torch's current stream into out (out_dtype) and lse
    (float32; lse_shape None: no lse output, as FP8 calls without the LSE run) filled with NaN
    beforehand, so an element the kernel never wrote shows up; the kernels' workspace
    (cuflash.kernels.workspace) is poisoned too, so a kernel that reads a byte nobody wrote carries
    a NaN into out. workspace_out (a dict) receives the workspace arrays."""
    from cuflash import dispatch, kernels

    out = torch.full(out_shape, float("nan"), device="cuda", dtype=out_dtype)
    lse = None if lse_shape is None else torch.full(lse_shape, float("nan"), device="cuda", dtype=torch.float32)
    workspace = {name: _poisoned(shape, dtype) for name, (shape, dtype) in kernels.workspace(problem).items()}
    if workspace_out is not None:
        workspace_out.update(workspace)
    outputs = dict(out=out, **({} if lse is None else dict(lse=lse)), **workspace)
    dispatch.execute(problem, inputs, outputs, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    return out, lse


def signed_scores_inputs(shape_q, shape_k, generator):
    """q, k, v (float32, of shapes shape_q and shape_k) whose scores are q_0 k_0 alone: q_0 is +1 or
    -1 in alternating runs of 40 rows and 0 on every 7th, k_0 in (0.5, 2.5) with a sign that is + on
    head 0's first 400 keys and - beyond, + on every key of head 1. So rows see key blocks whose
    every score is negative (head 0), whole rows of negative scores (head 1), and a warp's 16 rows
    may all be positive, all negative, or mixed."""
    q = torch.zeros(shape_q, device="cuda")
    rows = torch.arange(shape_q[1], device="cuda")
    q[..., 0] = torch.where((rows // 40) % 2 == 0, 1.0, -1.0)[None, :, None]
    q[:, rows % 7 == 3, :, 0] = 0.0
    k = torch.randn(shape_k, device="cuda", generator=generator)
    k[..., 0] = 0.5 + 2 * torch.rand(shape_k[:3], device="cuda", generator=generator)
    k[:, 400:, 0, 0] *= -1
    v = torch.randn(shape_k, device="cuda", generator=generator)
    return q, k, v
