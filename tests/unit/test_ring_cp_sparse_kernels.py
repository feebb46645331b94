"""ring_cp: the Triton sparse top-k kernels under TRITON_INTERPRET=1 against torch references (CPU, tiny shapes)."""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from triton_interpret import run_interpreted  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import math, torch
    from kllm_plugins.plugins.ring_cp.core.sparse_topk import bucket_topk_torch, select_sparse_kernel
    from kllm_plugins.plugins.ring_cp.kernels.sparse_lse import bucket_topk, sparse_latent_attention
    assert select_sparse_kernel("triton", "cpu") == "triton"
    g = torch.Generator().manual_seed(0)

    def reference(q, lat, idx, scale, dv):
        # float64, one query at a time, duplicates counted as often as they are selected
        out = torch.zeros(q.shape[0], q.shape[1], dv, dtype=torch.float64)
        lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), dtype=torch.float64)
        for t in range(q.shape[0]):
            sel = idx[t][idx[t] >= 0].long()
            if sel.numel() == 0:
                continue
            kk = lat[sel, 0].double()
            s = q[t].double() @ kk.T * scale
            lse[t] = torch.logsumexp(s, -1)
            out[t] = torch.softmax(s, -1) @ kk[:, :dv]
        return out, lse

    def close(a, b, tol):
        fin = torch.isfinite(b)
        assert torch.equal(fin, torch.isfinite(a)), "empty rows differ"
        return (a.double()[fin] - b[fin]).abs().max().item() <= tol if fin.any() else True

    # Buckets: same offsets and starts as the sort-based reference, rows with empty groups, -1 slots.
    for sq, k, total, ngroups in ((9, 7, 40, 3), (6, 33, 50, 5), (4, 5, 10, 1)):
        idx = torch.randint(-1, total, (sq, k), generator=g)
        idx[0] = -1
        group_of = torch.randint(0, ngroups, (total,), generator=g, dtype=torch.int32)
        local_of = torch.randint(0, 100, (total,), generator=g, dtype=torch.int32)
        r1, s1 = bucket_topk_torch(idx, group_of, local_of, ngroups)
        r2, s2 = bucket_topk(idx, group_of, local_of, ngroups)
        assert torch.equal(s1, s2), (s1, s2)
        assert s2[0, -1].item() == 0
        for t in range(sq):
            n = int(s1[t, -1])
            assert torch.equal(r1[t, :n], r2[t, :n]), t

    # Attention: dv < d and dv == d (v read from the key tile), heads and top-k not powers of two.
    n_cases = 0
    for sq, h, d, dv, k, sk in ((7, 4, 16, 12, 9, 30), (5, 3, 24, 24, 20, 40), (4, 16, 32, 32, 33, 50)):
        q = torch.randn(sq, h, d, generator=g)
        lat = torch.randn(sk, 1, d, generator=g)
        idx = torch.randint(-1, sk, (sq, k), generator=g)
        idx[0] = -1  # a query with no selection: lse -inf, out 0
        scale = 1 / math.sqrt(d)
        ref_o, ref_l = reference(q, lat, idx, scale, dv)
        o, l = sparse_latent_attention(q, lat, idx, scale=scale, v_dim=dv)
        assert close(o, ref_o, 1e-4) and close(l, ref_l, 1e-4), (sq, h, d, dv)
        assert (o[0] == 0).all() and torch.isinf(l[0]).all()
        # Groups merged in place equal the whole; a group a row has nothing in leaves it untouched.
        group_of = torch.randint(0, 3, (sk,), generator=g, dtype=torch.int32)
        local_of = torch.arange(sk, dtype=torch.int32)
        rows, starts = bucket_topk(idx, group_of, local_of, 3)
        ao, al = sparse_latent_attention(q, lat, rows, scale=scale, v_dim=dv, starts=starts, group=0)
        for grp in (1, 2):
            sparse_latent_attention(q, lat, rows, scale=scale, v_dim=dv, starts=starts, group=grp,
                                    acc_out=ao, acc_lse=al)
        assert close(ao, ref_o, 1e-4) and close(al, ref_l, 1e-4), ("merged", sq, h, d, dv)
        n_cases += 1
    print("SPARSE_KERNELS_OK", n_cases)
    """
)


def test_sparse_kernels_match_reference_interpreted() -> None:
    assert "SPARSE_KERNELS_OK 3" in run_interpreted(SCRIPT)
