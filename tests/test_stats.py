"""The closed-form solve against float64 references; reduced rank optimality; accumulation."""

import pytest
import torch
from torch.testing import assert_close

from shift_lightning.maps.ridge import RidgeStats, SolveError, ridge_solve


def _data(n=600, d=12, seed=0, outliers=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if outliers:  # massive-activation-like channel: large mean, large scale
        x[:, 3] = 80.0 + 30.0 * x[:, 3]
    W = 0.3 * torch.randn(d, d, generator=g, dtype=torch.float64)
    b = torch.randn(d, generator=g, dtype=torch.float64)
    delta = x @ W.T + b + 0.05 * torch.randn(n, d, generator=g, dtype=torch.float64)
    return x, delta


def _stats(x, delta, batches=5, **kw):
    s = RidgeStats(x.shape[1], **kw)
    for xb, db in zip(x.chunk(batches), delta.chunk(batches)):
        s.add_batch(xb, db)
    return s


def _ridge_reference(x, delta, damping):
    """Centred ridge with torch.linalg.solve in float64 (bias not penalised)."""
    mx, md = x.mean(0), delta.mean(0)
    xc, dc = x - mx, delta - md
    S = xc.T @ xc
    lam = damping * S.diagonal().mean()
    Wt = torch.linalg.solve(S + lam * torch.eye(x.shape[1], dtype=x.dtype), xc.T @ dc)
    W = Wt.T
    return W, md - W @ mx


def test_solve_matches_lstsq_without_damping():
    x, delta = _data()
    sol = ridge_solve(_stats(x, delta), damping=1e-12)
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    B = torch.linalg.lstsq(xa, delta, driver="gelsd").solution  # (d+1, d): [Wᵀ; bᵀ]
    assert_close(sol.W, B[:-1].T, rtol=1e-7, atol=1e-8)
    assert_close(sol.b, B[-1], rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("damping", [1e-4, 1e-2, 0.3])
def test_solve_matches_ridge_reference(damping):
    x, delta = _data(seed=1)
    sol = ridge_solve(_stats(x, delta), damping=damping)
    W, b = _ridge_reference(x, delta, damping)
    assert_close(sol.W, W, rtol=1e-9, atol=1e-10)
    assert_close(sol.b, b, rtol=1e-9, atol=1e-9)
    assert sol.lam > 0


def test_statistics_equal_direct_products_and_error_formula():
    x, delta = _data(n=300, d=7, seed=2)
    s = _stats(x, delta, batches=7)
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    assert_close(s.G, xa.T @ xa)
    assert_close(s.C, xa.T @ delta)
    assert s.num_tokens == 300
    W, b = 0.1 * torch.randn(7, 7, dtype=torch.float64), torch.randn(7, dtype=torch.float64)
    direct = ((delta - x @ W.T - b) ** 2).sum() / (delta ** 2).sum()
    assert s.relative_error(W, b) == pytest.approx(direct.item(), rel=1e-9)


def test_full_rank_equals_rank_d():
    x, delta = _data(seed=3)
    s = _stats(x, delta)
    full = ridge_solve(s, 1e-3)
    rd = ridge_solve(s, 1e-3, rank=x.shape[1])
    assert rd.U is None
    assert_close(rd.W, full.W)


def _objective(x, delta, W, b, lam):
    """The ridge objective the solve minimises (centred data ⇒ optimal b for any W)."""
    return ((delta - x @ W.T - b) ** 2).sum() + lam * (W ** 2).sum()


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_reduced_rank_is_optimal(rank):
    x, delta = _data(seed=4)
    d = x.shape[1]
    s = _stats(x, delta)
    damping = 1e-3
    sol = ridge_solve(s, damping, rank=rank)
    assert torch.linalg.matrix_rank(sol.W).item() == rank
    assert_close(sol.U @ sol.V.T, sol.W)
    f_rr = _objective(x, delta, sol.W, sol.b, sol.lam)

    def best_b(W):
        return delta.mean(0) - W @ x.mean(0)

    # the naive alternative: truncated SVD of the full-rank W
    full = ridge_solve(s, damping)
    U, S, Vh = torch.linalg.svd(full.W)
    Wt = U[:, :rank] @ torch.diag(S[:rank]) @ Vh[:rank]
    assert f_rr < _objective(x, delta, Wt, best_b(Wt), sol.lam)
    # and random rank-r competitors around the optimum never do better
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        A = sol.U + 0.05 * torch.randn(d, rank, generator=g, dtype=torch.float64)
        B = sol.V + 0.05 * torch.randn(d, rank, generator=g, dtype=torch.float64)
        Wr = A @ B.T
        assert f_rr <= _objective(x, delta, Wr, best_b(Wr), sol.lam) + 1e-9


def _joint_data(n=800, d=8, seed=11):
    """Features ``[x, m]`` (``m`` correlated with ``x``, on another scale) and targets from both."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x[:, 2] = 50.0 + 20.0 * x[:, 2]
    m = 0.01 * (torch.tanh(x @ torch.randn(d, d, generator=g, dtype=torch.float64)) +
                0.5 * torch.randn(n, d, generator=g, dtype=torch.float64))
    delta = (x @ (0.3 * torch.randn(d, d, generator=g, dtype=torch.float64)) + m @ (40 * torch.randn(d, d, generator=g,
             dtype=torch.float64)) + torch.randn(d, generator=g, dtype=torch.float64))
    return torch.cat([x, m], 1), delta + 0.05 * torch.randn(n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("rank", [1, 3, 5])
def test_rank_with_groups_is_the_exact_optimum_over_the_first_groups_rank(rank):
    """With groups ``(d, d)`` the rank constrains the first group's block ``A`` only: ``A`` equals the
    Eckart–Young optimum in the metric of the Schur complement (computed here independently, from the
    raw rows, by an SVD), the second group's block is the best given ``A``, and ``U Vᵀ = A``."""
    xm, delta = _joint_data()
    d = delta.shape[1]
    damping = 1e-3
    s = RidgeStats(2 * d, out_dim=d)
    for fb, db in zip(xm.chunk(4), delta.chunk(4)):
        s.add_batch(fb, db)
    sol = ridge_solve(s, damping, rank=rank, groups=(d, d))
    A, B = sol.W[:, :d].T, sol.W[:, d:].T
    assert torch.linalg.matrix_rank(A).item() == rank and torch.linalg.matrix_rank(B).item() == d
    assert_close(sol.U @ sol.V.T, sol.W[:, :d])
    # independently: centred rows, per-group damping, the Schur complement of the m block, Eckart–Young
    fc, dc = xm - xm.mean(0), delta - delta.mean(0)
    S = fc.T @ fc
    lams = [damping * S.diagonal()[:d].mean(), damping * S.diagonal()[d:].mean()]
    H = S + torch.diag(torch.cat([lams[0].expand(d), lams[1].expand(d)]))
    full = torch.linalg.solve(H, fc.T @ dc)
    schur = H[:d, :d] - H[:d, d:] @ torch.linalg.solve(H[d:, d:], H[d:, :d])
    ev, Q = torch.linalg.eigh(schur)
    root, iroot = Q @ torch.diag(ev.sqrt()) @ Q.T, Q @ torch.diag(ev.rsqrt()) @ Q.T
    Us, Ss, Vh = torch.linalg.svd(root @ full[:d])
    A_ey = iroot @ Us[:, :rank] @ torch.diag(Ss[:rank]) @ Vh[:rank]
    assert_close(A, A_ey, rtol=1e-7, atol=1e-9)
    assert_close(B, torch.linalg.solve(H[d:, d:], (fc.T @ dc)[d:] - H[d:, :d] @ A), rtol=1e-7, atol=1e-9)
    assert_close(sol.b, delta.mean(0) - sol.W @ xm.mean(0))

    def objective(Wt):
        return ((dc - fc @ Wt) ** 2).sum() + lams[0] * (Wt[:d] ** 2).sum() + lams[1] * (Wt[d:] ** 2).sum()

    # it beats truncating the full solution's A (with or without B refitted) and the rank-r fit on x alone
    U_, S_, Vh_ = torch.linalg.svd(full[:d])
    At = U_[:, :rank] @ torch.diag(S_[:rank]) @ Vh_[:rank]
    f = objective(torch.cat([A, B]))
    assert f < objective(torch.cat([At, full[d:]]))
    assert f < objective(torch.cat([At, torch.linalg.solve(H[d:, d:], (fc.T @ dc)[d:] - H[d:, :d] @ At)]))
    x_only = RidgeStats(d)
    x_only.add_batch(xm[:, :d], delta)
    assert f < objective(torch.cat([ridge_solve(x_only, damping, rank=rank).W.T, torch.zeros(d, d, dtype=torch.float64)]))
    # rank = the group's width is the full joint fit
    whole = ridge_solve(s, damping, rank=d, groups=(d, d))
    assert whole.U is None
    assert_close(whole.W, ridge_solve(s, damping, groups=(d, d)).W)


def test_affine_kind_fits_block_output():
    x, delta = _data(seed=5)
    s = _stats(x, delta)
    aff = ridge_solve(s, 1e-12, kind="affine")
    res = ridge_solve(s, 1e-12, kind="residual")
    eye = torch.eye(x.shape[1], dtype=torch.float64)
    assert_close(aff.W, res.W + eye, rtol=1e-6, atol=1e-6)  # without damping both are the same fit
    Wd, bd = aff.delta_map()
    assert_close(Wd, res.W, rtol=1e-6, atol=1e-6)
    # with damping they differ: affine shrinks A towards 0, residual shrinks W towards 0
    assert not torch.allclose(ridge_solve(s, 0.5, kind="affine").delta_map()[0], ridge_solve(s, 0.5).W, atol=1e-3)


def test_float32_chunked_accumulation_is_close_to_float64():
    x, delta = _data(n=20_000, d=16, seed=6)
    s64 = _stats(x, delta, batches=4)
    s32 = _stats(x.float(), delta.float(), batches=4, accum_dtype=torch.float32, chunk_tokens=2048)
    rel = ((s32.G - s64.G).norm() / s64.G.norm()).item()
    assert rel < 1e-6
    W64, W32 = ridge_solve(s64, 1e-4).W, ridge_solve(s32, 1e-4).W
    assert ((W32 - W64).norm() / W64.norm()).item() < 1e-4


def test_shared_flat_buffer_views():
    n = RidgeStats.numel(4)
    flat = torch.zeros(2 * n, dtype=torch.float64)
    a, b = RidgeStats(4, buffer=flat[:n]), RidgeStats(4, buffer=flat[n:])
    a.add_batch(torch.ones(3, 4), torch.ones(3, 4))
    assert flat[:n].abs().sum() > 0 and flat[n:].abs().sum() == 0
    assert b.num_tokens == 0 and a.num_tokens == 3


def test_errors_name_the_site_and_the_fix():
    s = RidgeStats(4, name="site 3 (blocks 7..7)")
    bad = torch.ones(2, 4)
    bad[0, 1] = float("inf")
    with pytest.raises(SolveError, match=r"site 3.*non-finite.*float32"):
        s.add_batch(bad, torch.ones(2, 4))
    with pytest.raises(SolveError, match="no calibration tokens"):
        ridge_solve(s)
    # a singular Gram with (almost) no damping: Cholesky fails -> suggest larger damping
    x = torch.randn(50, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[:, 1] = x[:, 0]
    x[:, 2] = x[:, 0]
    s.add_batch(x, x @ torch.ones(4, 4, dtype=torch.float64))
    with pytest.raises(SolveError, match=r"site 3.*Cholesky.*--calibration.damping"):
        ridge_solve(s, damping=1e-300)


def test_round_tf32_keeps_ten_mantissa_bits():
    from shift_lightning.maps.ridge import round_tf32

    x = torch.tensor([1.0 + 2 ** -10, 1.0 + 2 ** -11 + 2 ** -12, 1.0 + 2 ** -12, -3.0, 0.0])
    assert round_tf32(x).tolist() == [1.0 + 2 ** -10, 1.0 + 2 ** -10, 1.0, -3.0, 0.0]
    y = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    r = round_tf32(y)
    assert ((r - y).abs() <= y.abs() * 2 ** -11).all() and not torch.equal(r, y)


def test_resolve_accum_per_device():
    from shift_lightning.maps.ridge import resolve_accum

    assert resolve_accum("auto", "cpu", torch.bfloat16) == "float64"
    assert resolve_accum("auto", "cuda", torch.bfloat16) == "bfloat16"
    assert resolve_accum("auto", "cuda", torch.float32) == "tf32"
    assert resolve_accum(torch.float32, "cpu", torch.float32) == "float32"
    with pytest.raises(ValueError, match="accumulation scheme"):
        RidgeStats(4, accum_dtype="float16")


@pytest.mark.parametrize("scheme, w_tol", [("float32", 1e-4), ("tf32", 3e-3), ("bfloat16", 3e-2), ("auto", 1e-4)])
def test_every_accumulation_scheme_is_close_to_float64(scheme, w_tol):
    """CPU runs the reduced-precision schemes with the GPU's input rounding: their errors are checked here."""
    x, delta = _data(n=20_000, d=16, seed=7)
    s64 = _stats(x, delta, batches=4)
    s = _stats(x.float(), delta.float(), batches=4, accum_dtype=scheme, chunk_tokens=2048)
    assert s.scheme == ("float64" if scheme == "auto" else scheme)
    assert s.num_tokens == s64.num_tokens and s.yy.item() == pytest.approx(s64.yy.item(), rel=1e-6)
    W64, W = ridge_solve(s64, 1e-4).W, ridge_solve(s, 1e-4).W
    assert ((W - W64).norm() / W64.norm()).item() < w_tol
    if scheme == "bfloat16":  # = float32 products of bf16-rounded inputs (what the tensor cores compute)
        ref = _stats(x.float().bfloat16().float(), delta.float().bfloat16().float(), batches=4,
                     accum_dtype="float32", chunk_tokens=2048)
        assert_close(s.G, ref.G, rtol=1e-6, atol=0)


@pytest.mark.parametrize("scheme", ["float64", "float32", "tf32", "bfloat16"])
@pytest.mark.parametrize("p, block", [(23, 8), (23, 5), (17, 17), (40, 6)])
def test_block_triangular_products_equal_the_one_gemm(scheme, p, block):
    """``gram_products`` multiplies only the upper block triangle of the symmetric Gram block; the sums are the
    one GEMM's (to rounding), the Gram block exactly symmetric between blocks."""
    from shift_lightning.maps.ridge import chunk_products, gram_products

    g = torch.Generator().manual_seed(p + block)
    work = torch.float64 if scheme == "float64" else torch.float32
    R = torch.randn(300, p + 11, generator=g, dtype=work)
    R[:, 2] = 80.0 + 30.0 * R[:, 2]  # an outlier channel
    P, full = gram_products(R, p, scheme, block=block), chunk_products(R[:, :p], R, scheme)
    assert P.dtype == torch.float64 and P.shape == (p, p + 11)
    assert_close(P, full, rtol=1e-12 if scheme == "float64" else 1e-5, atol=1e-9 if scheme == "float64" else 1e-2)
    k = max(1, round(p / block))
    edges = [round(i * p / k) for i in range(k + 1)]
    for s, e in zip(edges[:-1], edges[1:]):  # below the diagonal blocks: exact transposes
        assert torch.equal(P[e:p, s:e], P[s:e, e:p].T)


def test_statistics_wider_than_a_row_block_equal_direct_products():
    """At d = 400 (two row blocks of the CPU's block-triangular products) the sums are the direct ones, and an
    inf in the first block's columns is still caught (from the ones row, mirrored)."""
    from shift_lightning.maps.ridge import GRAM_BLOCK

    d = 400
    assert round((d + 1) / GRAM_BLOCK) == 2
    x, delta = _data(n=500, d=d, seed=9)
    s = _stats(x, delta, batches=3)
    xa = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], 1)
    assert_close(s.G, xa.T @ xa, rtol=1e-12, atol=1e-8)
    assert_close(s.C, xa.T @ delta, rtol=1e-12, atol=1e-8)
    h = round((d + 1) / 2)  # two row blocks: the one below the diagonal is the mirror of the one above it
    assert torch.equal(s.G[h:, :h], s.G[:h, h:].T)
    bad = x[:4].clone()
    bad[1, 0] = float("inf")
    with pytest.raises(SolveError, match="non-finite"):
        s.add_batch(bad, delta[:4])


@pytest.mark.parametrize("p,q,scheme", [(401, 802, "float64"), (641, 1282, "float32"), (33, 66, "float64")])
def test_gram_products_added_block_by_block_are_the_same_sums_bit_for_bit(p, q, scheme):
    """``add_gram_products`` adds each row block into ``G``/``C`` as it is computed (no ``(p, q)`` temporary): the
    same sums as ``G += P`` with ``P = gram_products(...)``, to the bit; a non-finite input adds nothing."""
    from shift_lightning.maps.ridge import add_gram_products, gram_products

    g = torch.Generator().manual_seed(p)
    R = torch.randn(300, q, generator=g, dtype=torch.float64 if scheme == "float64" else torch.float32)
    R[:, p - 1] = 1
    G0, C0 = torch.randn(p, p, dtype=torch.float64, generator=g), torch.randn(p, q - p, dtype=torch.float64, generator=g)
    G1, C1 = G0.clone(), C0.clone()
    P = gram_products(R, p, scheme)
    G0 += P[:, :p]
    C0 += P[:, p:]
    assert add_gram_products(R, p, scheme, G1, C1)
    assert torch.equal(G0, G1) and torch.equal(C0, C1)
    R[3, 0] = float("nan")
    assert not add_gram_products(R, p, scheme, G1, C1) and torch.equal(G0, G1) and torch.equal(C0, C1)
