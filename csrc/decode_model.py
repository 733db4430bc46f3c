"""Lane-level numpy model of paged_decode_kernel + paged_decode_reduce_kernel (paged_attention.cu): the same lane
mapping, butterfly shuffles (x[lane ^ o]), lazy online softmax, warp / shared-memory merges and partitions, checked
against the float64 reference of tests/test_attention.py. A development aid for machines without a GPU (the kernel
itself is tested by tests/test_gpu.py); keep it in step with the kernel when changing the index math.

    python csrc/decode_model.py        # ~5 s
"""

import sys
from pathlib import Path

import numpy as np
import torch

np.seterr(invalid="ignore")  # -inf - -inf in masked merges; those lanes are zero-weighted

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_attention import make_case, reference

W = 32
NW = 4
LOG2E = 1.4426950408889634


def kernel(p, elem_bytes, HEAD_DIM, GROUP, bx, seq, part, out, tmp):
    VEC = 16 // elem_bytes
    LANES = min(HEAD_DIM // VEC, W)
    ELEMS = HEAD_DIM // LANES
    LOADS = ELEMS // VEC
    TPW = W // LANES
    STEP = NW * TPW
    UNROLL = 2
    per_kv = p["H"] // p["Hkv"]
    chunks = (per_kv + GROUP - 1) // GROUP
    kv = bx // chunks
    first = kv * per_kv + (bx % chunks) * GROUP
    heads_here = min(GROUP, (kv + 1) * per_kv - first)
    ctx = p["ctx"][seq]
    start = ctx - p["window"] if p["window"] > 0 and ctx > p["window"] else 0
    begin, end = start, ctx
    if p["P"] > 0:
        begin = start + part * p["P"]
        if begin >= ctx:
            return
        end = min(ctx, begin + p["P"])
    capped = p["softcap"] > 0
    qs = p["scale"] / p["softcap"] if capped else p["scale"] * LOG2E
    cap = p["softcap"] * LOG2E
    lane = np.arange(W)
    sub = lane % LANES
    slot = lane // LANES
    dims = np.array(
        [[(i * LANES + sub) * VEC + e for i in range(LOADS) for e in range(VEC)] for sub in range(LANES)]
    )  # [LANES, ELEMS]
    dl = dims[sub]  # [W, ELEMS]
    s_acc = np.zeros((NW, GROUP, HEAD_DIM))
    s_m = np.zeros((NW, GROUP))
    s_l = np.zeros((NW, GROUP))
    for warp in range(NW):
        q = np.zeros((GROUP, W, ELEMS))
        for g in range(GROUP):
            if g < heads_here:
                q[g] = p["q"][seq, first + g][dl] * qs
        m = np.full((GROUP, W), -np.inf)
        l = np.zeros((GROUP, W))
        acc = np.zeros((GROUP, W, ELEMS))
        t0 = begin + warp * TPW
        while t0 < end:
            for u in range(UNROLL):
                t = t0 + u * STEP + slot
                valid = t < end
                k = np.zeros((W, ELEMS))
                v = np.zeros((W, ELEMS))
                for ln in range(W):
                    if valid[ln]:
                        blk = t[ln] // p["bs"]
                        off = t[ln] - blk * p["bs"]
                        page = p["tables"][seq, blk]
                        k[ln] = p["kc"][page, off, kv][dl[ln]]
                        v[ln] = p["vc"][page, off, kv][dl[ln]]
                s = np.einsum("gwe,we->gw", q, k)
                o = LANES // 2
                while o > 0:
                    s = s + s[:, lane ^ o]
                    o //= 2
                for g in range(GROUP):
                    x = np.tanh(s[g]) * cap if capped else s[g]
                    for ln in range(W):
                        if not valid[ln]:
                            continue
                        if x[ln] > m[g, ln]:
                            c = 2 ** (m[g, ln] - x[ln])
                            l[g, ln] *= c
                            acc[g, ln] *= c
                            m[g, ln] = x[ln]
                        w = 2 ** (x[ln] - m[g, ln])
                        l[g, ln] += w
                        acc[g, ln] += w * v[ln]
            t0 += UNROLL * STEP
        o = LANES
        while o < W:
            mo = m[:, lane ^ o]
            lo = l[:, lane ^ o]
            ao = acc[:, lane ^ o]
            mn = np.maximum(m, mo)
            a = np.where(m == -np.inf, 0, 2 ** (m - mn))
            b = np.where(mo == -np.inf, 0, 2 ** (mo - mn))
            l = l * a + lo * b
            acc = acc * a[..., None] + ao * b[..., None]
            m = mn
            o *= 2
        for ln in range(W):
            if slot[ln] == 0:
                for g in range(GROUP):
                    s_acc[warp, g, dl[ln]] = acc[g, ln]
                    if sub[ln] == 0:
                        s_m[warp, g] = m[g, ln]
                        s_l[warp, g] = l[g, ln]
    for g in range(heads_here):
        M = s_m[:, g].max()
        c = np.where(s_m[:, g] == -np.inf, 0, 2 ** (s_m[:, g] - M))
        L = (s_l[:, g] * c).sum()
        O = (s_acc[:, g] * c[:, None]).sum(0)
        val = O / L if L > 0 else 0 * O
        head = first + g
        if p["P"] > 0:
            tmp["out"][seq, head, part] = val
            tmp["max"][seq, head, part] = M
            tmp["sum"][seq, head, part] = L
        else:
            out[seq, head] = val


def reduce(p, seq, head, out, tmp):
    ctx = p["ctx"][seq]
    start = ctx - p["window"] if p["window"] > 0 and ctx > p["window"] else 0
    count = (ctx - start + p["P"] - 1) // p["P"] if ctx > start else 0
    mx = tmp["max"][seq, head, :count]
    sm = tmp["sum"][seq, head, :count]
    M = mx.max() if count else -np.inf
    w = sm * np.where(mx == -np.inf, 0, 2 ** (mx - M))
    tot = w.sum()
    out[seq, head] = (w[:, None] * tmp["out"][seq, head, :count]).sum(0) * (1 / tot if tot > 0 else 0)


def plan(len_, req):
    if req <= 0 or len_ <= 0:
        return 0, 1
    n = -(-len_ // req)
    return (0, 1) if n <= 1 else (req, n)


def run(seqs, H, Hkv, D, bs, elem, window, softcap, P, seed):
    query, kc, vc, cu, ctx, tables, keys, values = make_case(seqs, H, Hkv, D, bs, torch.float32, seed)
    maxctx = max(c for _, c in seqs)
    length = min(window, maxctx) if window else maxctx
    Pp, nP = plan(length, P)
    p = dict(
        q=query.double().numpy(),
        kc=kc.double().numpy(),
        vc=vc.double().numpy(),
        tables=tables.numpy(),
        ctx=ctx.tolist(),
        H=H,
        Hkv=Hkv,
        bs=bs,
        window=window or 0,
        softcap=softcap or 0.0,
        scale=0.3,
        P=Pp,
    )
    per_kv = H // Hkv
    G = 1 if per_kv <= 1 else 2 if per_kv <= 2 else 4 if per_kv <= 4 else 8
    chunks = -(-per_kv // G)
    out = np.zeros((len(seqs), H, D))
    tmp = dict(out=np.zeros((len(seqs), H, nP, D)), max=np.zeros((len(seqs), H, nP)), sum=np.zeros((len(seqs), H, nP)))
    for seq in range(len(seqs)):
        for bx in range(Hkv * chunks):
            for part in range(nP if Pp > 0 else 1):
                kernel(p, elem, D, G, bx, seq, part, out, tmp)
    if Pp > 0:
        for seq in range(len(seqs)):
            for h in range(H):
                reduce(p, seq, h, out, tmp)
    ref = reference(query, keys, values, [1] * len(seqs), 0.3, window, softcap).numpy()
    err = np.abs(out - ref).max()
    print(f"H={H} Hkv={Hkv} D={D} bs={bs} elem={elem} win={window} cap={softcap} P={P}->{Pp}x{nP}: max err {err:.2e}")
    assert err < 1e-9, err


if __name__ == "__main__":
    seqs = [(1, n) for n in (1, 7, 16, 17, 70, 45)]
    run(seqs, 8, 2, 64, 16, 2, None, None, -1, 0)
    run(seqs, 8, 2, 64, 16, 2, None, None, 16, 1)
    run(seqs, 12, 1, 64, 8, 4, 9, None, 0, 2)  # per_kv 12 -> G 8, 2 chunks, window
    run(seqs, 6, 2, 128, 16, 4, None, 5.0, 24, 3)  # per_kv 3 -> G 4, softcap, partitions
    run(seqs, 4, 4, 64, 5, 2, 13, 2.0, 8, 4)  # MHA, block 5 (not pow2), window + cap + partitions
    run(seqs, 16, 2, 256, 16, 2, None, None, 32, 5)  # D 256: LANES 32
    run(seqs, 2, 1, 256, 16, 4, 30, None, -1, 6)
