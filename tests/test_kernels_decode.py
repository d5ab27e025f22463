"""Decode attention: Triton kernel against the float32 reference, and the reference against the paper's equations."""

import pytest
import torch
from kernels_helpers import DEVICE, TOL, exact_rows, filled_layer, rel, same_inf

from quantmla import kernels
from quantmla.cache import protected_set
from quantmla.kernels import PagedLayer, PageFormat
from quantmla.kernels import reference as ref
from quantmla.quant import qdq

CASES = [
    # content bits, RoPE bits, heads, lengths (ragged, shorter than the 132 protected rows, not page multiples)
    (4, 4, 16, [300, 70, 1, 131]),
    (2, 4, 16, [200, 133]),
    (8, 8, 16, [97, 5]),
    (4, 8, 20, [150, 64]),  # a head count that is not a multiple of 16
    (3, 4, 16, [140]),
    (16, 16, 16, [300, 70, 1]),
    (16, 4, 16, [180]),
    (4, 4, 128, [140, 33]),
    (16, 16, 128, [90]),
    (4, 4, 9, [150, 20], 384),  # a latent width that is not a power of two (the embedded model's)
    (2, 4, 9, [70], 384),
]


def _queries(B, H, gen, d_c=512):
    q = torch.randn(B, H, d_c, generator=gen) * 0.5
    qp = torch.randn(B, H, 64, generator=gen)
    return q.to(DEVICE), qp.to(DEVICE)


def _poisoned(B, H, d_c=512):
    return (
        torch.full((B, H, d_c), float("nan"), device=DEVICE),
        torch.full((B, H), float("nan"), device=DEVICE),
    )


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda v: str(v))
def test_decode_kernel_matches_reference(case):
    cb, rb, H, lengths, d_c = case if len(case) == 5 else (*case, 512)
    gen = torch.Generator().manual_seed(H + cb * 7 + rb + len(lengths))
    fmt = PageFormat(cb, rb, d_c)
    layer, bt, lens, _, _ = filled_layer(fmt, lengths, gen)
    q, qp = _queries(len(lengths), H, gen, d_c)
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    # the content path whole and in 2 or 4 column chunks (chunks() falls back to 1 where a format
    # cannot be cut so, the 384-wide latent); the GPU default is 4, the interpreter's 1
    configs = [None, dict(num_splits=1, chunks=4), dict(num_splits=3, block_n=16, chunks=1)]
    if H > 16:  # the default there rounds P to BF16 once (1e-2); the hi/lo pair keeps float32 accuracy
        configs = [None, dict(pv_split=True, chunks=2)]
    for cfg in configs if (H == 16 and cb == 4) or H > 16 else configs[:1] + [dict(chunks=2)]:
        out = _poisoned(len(lengths), H, d_c)
        o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, out=out)
        assert o is out[0] and not torch.isnan(o).any() and not torch.isnan(lse).any()
        tol = 1e-2 if H > 16 and cfg is None else TOL
        assert rel(o, o_ref) < tol, (cfg, rel(o, o_ref))
        assert rel(lse, lse_ref) < TOL and same_inf(lse, lse_ref)


@pytest.mark.slow
def test_decode_splits_count_the_protected_rows_as_work_tiles():
    """Work is the page tiles up to the recent window plus the protected tiles (sink and ring, 132
    rows: 3 tiles of 64), cut into equal shares; a request's work tiles past its page tiles are its
    protected rows. With 300 and 90 tokens (3 and 1 page tiles) and 8 splits asked for, 6 splits of
    one tile run: request 0's protected rows fall to splits 3-5, request 1's to splits 1-3, and
    splits 4-5 hold nothing for it. Where the sink rides in page tile 0 the protected tiles are the
    ring's two. The split search counts the same work: 8 requests of 1K tokens (14 page tiles + 3)
    take 17 splits of one tile, as BF16 takes 16; at batch 32 and 8K the Triton kernel takes the sink
    into page tile 0 and splits 128 work tiles, as BF16 does. Every split count gives the
    reference's output."""
    from quantmla.kernels import dispatch
    from quantmla.kernels.splits import Case, split_work

    c4r4 = PagedLayer(PageFormat(4, 4), 1, "cpu", batch=1, sink=4, recent=128)
    bf16 = PagedLayer(PageFormat(16, 16), 1, "cpu", batch=1, sink=4, recent=128)
    assert split_work(c4r4, 300, 64, 8) == (6, 1, False)
    assert split_work(c4r4, 300, 64, 8, sink_in_tile0=True) == (5, 1, True)  # the Gluon kernel's count
    assert split_work(c4r4, 8192, 64, 2) == (2, 65, False)  # 126 page tiles + 3 protected
    assert split_work(c4r4, 8192, 64, 2, sink_in_tile0=True) == (2, 64, True)  # 126 + 2: BF16's 128 tiles
    assert split_work(bf16, 8192, 64, 2) == (2, 64, False) and bf16.prot is None
    # the split search on an H200's 132 SMs (the compiled path's, which the interpreter skips)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dispatch, "INTERPRET", False)
        dispatch._config.cache_clear()
        try:
            dev = torch.device("cpu")
            for layer, tiles in ((c4r4, 17), (bf16, 16)):
                cfg = dispatch.default_config(8, 16, 1024, layer, dev)
                assert cfg["num_splits"] == tiles and split_work(layer, 1024, 64, tiles)[:2] == (tiles, 1)
                p = dispatch.plan(Case(layer, 16, 1024, dev, False, cfg))
                assert p.name == "triton" and p.split == (tiles, 1, False)
            # at batch 32 shares are longer than a tile: the sink rides in page tile 0, 126 + 2 tiles
            cfg = dispatch.default_config(32, 16, 8192, c4r4, dev)
            p = dispatch.plan(Case(c4r4, 16, 8192, dev, False, cfg))
            assert cfg["num_splits"] == 8 and p.name == "triton" and p.split == (8, 16, True)
        finally:
            dispatch._config.cache_clear()
    gen = torch.Generator().manual_seed(5)
    layer, bt, lens, _, _ = filled_layer(PageFormat(4, 4), [300, 90], gen)
    q, qp = _queries(2, 16, gen)
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    for splits in (2, 4, 8):
        out = _poisoned(2, 16)
        o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", dict(block_n=64, num_splits=splits), out)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert rel(o, o_ref) < TOL and rel(lse, lse_ref) < TOL, splits


@pytest.mark.parametrize("sink, recent", [(4, 128), (4, 16), (0, 128), (64, 64)], ids=str)
def test_exact_kernel_splits_weigh_the_protected_tiles(sink, recent):
    """The exact kernel's splits (front_split_work, front_ranges: what the kernel computes from its
    program id): for any weight, split count and request length up to max_len, every page tile and
    every protected tile is attended to by exactly one split, no split holds more than ``per`` units
    (a protected tile counting min(weight, per)), at most the splits asked for run, and a protected
    tile never shares a split with another one when it weighs a split or more. Weight 1 cuts the
    request into the same splits as split_work (page and protected tiles alike)."""
    from quantmla.kernels.splits import front_ranges, front_split_work, split_work

    layer = PagedLayer(PageFormat(4, 4), 1, "cpu", batch=1, sink=sink, recent=recent)
    k = -(-(sink + recent) // 64)
    for max_len in (0, 1, 70, 131, 133, 300, 4000, 8192, 131072):
        n_max = -(-min(max(max_len - recent, sink), max_len) // 64)
        for ns in (1, 2, 3, 8, 40, 264):
            for w in (1, 2, 5, 20):
                splits, per, _ = front_split_work(layer, max_len, ns, w)
                assert 1 <= splits <= ns
                if w == 1:
                    assert (splits, per) == split_work(layer, max_len, 64, ns)[:2]
                for n in {0, min(1, n_max), n_max // 2, n_max}:
                    pages, prot = [], []
                    for s in range(splits):
                        pr, kr = front_ranges(s, per, w, k, n)
                        assert len(pr) + min(w, per) * len(kr) <= per, (max_len, ns, w, s)
                        assert w < per or len(kr) <= 1
                        pages += list(pr)
                        prot += list(kr)
                    assert sorted(pages) == list(range(n)) and sorted(prot) == list(range(k)), (max_len, ns, w, n)


@pytest.mark.slow
@pytest.mark.parametrize("sink, block_n", [(4, 16), (16, 16), (17, 16), (0, 32), (40, 32)], ids=str)
def test_decode_sink_in_page_tile_zero_or_among_the_protected_tiles(sink, block_n):
    """Sink rows that fit in one tile ride in page tile 0, swapped in from the protection buffer; a
    larger sink is attended to as protected rows of its own. With the protection buffer unrelated
    to the pages (reading a page's sink row instead moves the output), ragged requests, some
    shorter than the sink or than the recent window, and 1 to 64 splits: the reference's
    output either way, every output written."""
    from quantmla.kernels.dispatch import default_config, plan
    from quantmla.kernels.splits import Case, split_work
    from quantmla.kernels.triton_decode import swaps_sink

    assert swaps_sink(sink, block_n) == (0 < sink <= block_n)
    gen = torch.Generator().manual_seed(31 + sink + block_n)
    lengths = [300, 70, 3, 45, 20]
    layer, bt, lens, _, _ = filled_layer(PageFormat(4, 4), lengths, gen, sink=sink, recent=24)
    layer.prot.copy_((torch.randn(layer.prot.shape, generator=gen) * 3 - 1).to(layer.prot.device, layer.prot.dtype))
    q, qp = _queries(len(lengths), 16, gen)
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    for splits in (1, 3, 7, 64):  # the sink in page tile 0 where it fits, except with one tile per split
        out = _poisoned(len(lengths), 16)
        cfg = dict(block_n=block_n, num_splits=splits)
        p = plan(Case(layer, 16, 300, q.device, False, default_config(len(lengths), 16, 300, layer, q.device, cfg)))
        three = split_work(layer, 300, block_n, splits).per  # tiles per split with the sink a protected tile
        assert p.split.sink_in_tile0 == (swaps_sink(sink, block_n) and three > 1), (splits, p)
        o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, out=out)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert rel(o, o_ref) < TOL and rel(lse, lse_ref) < TOL and same_inf(lse, lse_ref), splits


@pytest.mark.slow
@pytest.mark.parametrize(
    "cb, H, lengths",
    [
        (4, 16, [300, 70, 3, 200]),
        (2, 16, [133, 260]),
        pytest.param(4, 128, [4000, 300, 70, 3], marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="GPU: Gluon")),
        pytest.param(2, 128, [2500, 133], marks=pytest.mark.skipif(DEVICE.type == "cpu", reason="GPU: Gluon")),
    ],
    ids=str,
)
def test_decode_reads_protected_rows_from_the_protection_buffer(cb, H, lengths):
    """The sink and the recent ring are attended to from the BF16 protection buffer, never from the
    pages: with those rows replaced by unrelated values (so that reading a page instead moves the
    output by O(1)), the kernel still matches the reference, one split and several. Above 16 heads
    on a Hopper GPU this is the Gluon kernel, whose sink rows ride in page tile 0."""
    gen = torch.Generator().manual_seed(11 + cb + H)
    layer, bt, lens, _, _ = filled_layer(PageFormat(cb, 4), lengths, gen)
    q, qp = _queries(len(lengths), H, gen)
    o_pages, _ = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    layer.prot.copy_((torch.randn(layer.prot.shape, generator=gen) * 3 - 1).to(layer.prot.device, layer.prot.dtype))
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    assert all(rel(o_pages[b], o_ref[b]) > 0.1 for b in range(len(lengths)))  # they weigh in every request
    tol = 1e-2 if H > 16 else TOL  # P as one BF16 tile above 16 heads
    for cfg in (dict(num_splits=1), dict(num_splits=3)):
        out = _poisoned(len(lengths), H)
        o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, out=out)
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert rel(o, o_ref) < tol and rel(lse, lse_ref) < TOL and same_inf(lse, lse_ref), cfg


@pytest.mark.slow
def test_decode_of_an_empty_request():
    gen = torch.Generator().manual_seed(0)
    layer, bt, lens, _, _ = filled_layer(PageFormat(4, 4), [40, 0], gen)
    q, qp = _queries(2, 16, gen)
    o, lse = kernels.decode(layer, bt, lens, q, qp, 0.1, "triton")
    assert torch.isinf(lse[1]).all() and (o[1] == 0).all() and torch.isfinite(lse[0]).all()


@pytest.mark.parametrize("splits", [3, 700])  # 700: more splits than one block of the merge holds
def test_merge_of_splits_is_their_lse_weighted_mean(splits):
    from quantmla.kernels.splits import merge

    gen = torch.Generator().manual_seed(splits)
    B, H, d_c = 2, 3, 96
    op = torch.randn(B, H, splits, d_c, generator=gen).to(DEVICE)
    lsep = (torch.randn(B, H, splits, generator=gen) * 20).to(DEVICE)
    lsep[0, 0, ::2] = float("-inf")  # splits that held no token
    lsep[0, 0, -1] = 60.0  # one split far above the others (the running maximum moves late)
    lsep[1, 2] = float("-inf")  # a row with no token at all
    o, lse = _poisoned(B, H, d_c)
    merge(op, lsep, o, lse)
    lp = lsep.double().cpu()
    want_lse = torch.logsumexp(lp, dim=-1)
    w = torch.exp(lp - torch.where(torch.isinf(want_lse), 0.0, want_lse)[..., None])
    want_o = (w[..., None] * op.double().cpu()).sum(2)
    assert same_inf(lse.cpu(), want_lse) and (o[1, 2] == 0).all()
    ok = torch.isfinite(want_lse)
    assert (lse.cpu().double() - want_lse)[ok].abs().max() < 1e-4
    assert rel(o.cpu().double()[ok], want_o[ok]) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("cb", [16, 4, 2])
def test_decode_with_p_as_one_bf16_tile(cb):
    """``pv_split=False`` (P·V with P rounded to BF16 once, FlashMLA's precision) on 64-head tiles:
    the same function up to that rounding, so within 1e-2 of the float32 reference, and every
    output written."""
    gen = torch.Generator().manual_seed(21 + cb)
    fmt = PageFormat(cb, 16 if cb == 16 else 4)
    layer, bt, lens, _, _ = filled_layer(fmt, [300, 70], gen)
    q, qp = _queries(2, 128, gen)
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    out = _poisoned(2, 128)
    cfg = dict(block_h=64, block_n=32, pv_split=False)
    o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, out=out)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < 1e-2 and rel(lse, lse_ref) < TOL


@pytest.mark.parametrize("cb, rb", [(4, 4), (2, 4), (16, 16)])
def test_reference_decode_is_the_spec(cb, rb):
    """Float64 from the skeleton's quantizer (quant.qdq) and the paper's protected set P_L."""
    gen = torch.Generator().manual_seed(11)
    fmt = PageFormat(cb, rb)
    sink, recent = 4, 16
    lengths = [90, 10]
    layer, bt, lens, C, K = filled_layer(fmt, lengths, gen, sink=sink, recent=recent)
    q, qp = _queries(2, 8, gen)
    tau = 0.07
    o, lse = ref.decode(layer, bt, lens, q, qp, tau)
    for b, L in enumerate(lengths):
        Cb, Kb = C[b, :L].cpu(), K[b, :L].cpu()
        Ch = qdq(Cb, cb, 64, scale_dtype=torch.bfloat16).double()
        Kh = qdq(Kb, rb, 64, scale_dtype=torch.float32).double()
        keep = torch.zeros(L, dtype=torch.bool)
        keep[protected_set(L, sink, recent)] = fmt.quantized
        Ck = torch.where(keep[:, None], Cb.double(), Ch)
        Kk = torch.where(keep[:, None], Kb.double(), Kh)
        qb, qpb = q[b].cpu().to(fmt.dtype).double(), qp[b].cpu().to(fmt.dtype).double()
        s = tau * (qb @ Ck.T + qpb @ Kk.T)
        assert rel(o[b], torch.softmax(s, -1) @ Ck) < 1e-5
        assert rel(lse[b], torch.logsumexp(s, -1)) < 1e-6


def test_bad_decode_inputs_raise_before_launch():
    gen = torch.Generator().manual_seed(2)
    layer, bt, lens, _, _ = filled_layer(PageFormat(4, 4), [70], gen)
    q, qp = _queries(1, 16, gen)
    out = _poisoned(1, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        kernels.decode(layer, bt + layer.num_pages, lens, q, qp, 0.1, out=out)
    with pytest.raises(TypeError, match="must be floating point"):
        kernels.decode(layer, bt, lens, q, qp.to(torch.int32), 0.1, out=out)
    with pytest.raises(ValueError, match="latent widths"):
        kernels.decode(layer, bt, lens, q[..., :256], qp, 0.1, out=out)
    with pytest.raises(ValueError, match="needs 3 pages"):
        kernels.decode(layer, bt, lens + 100, q, qp, 0.1, out=out)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        kernels.decode(layer, bt, lens, q, qp, 0.1, backend="cuda", out=out)
    with pytest.raises(ValueError, match="protection buffers hold 1"):
        kernels.decode(layer, bt.repeat(2, 1), lens.repeat(2), q.repeat(2, 1, 1), qp.repeat(2, 1, 1), 0.1)
    with pytest.raises(ValueError, match=r"unknown decode config keys \['block_m'\]; known: block_h"):
        kernels.decode(layer, bt, lens, q, qp, 0.1, "triton", dict(block_m=32), out=out)
    assert torch.isnan(out[0]).all() and torch.isnan(out[1]).all()  # nothing ran
    assert isinstance(layer, PagedLayer)


def test_split_count_assumes_the_programs_a_register_cap_lets_an_sm_hold():
    """65,536 registers per SM: a cap of 168 per thread fits three 4-warp programs, 128 four;
    without one the compiler takes 255 (two 4-warp programs, one of 8 warps)."""
    from quantmla.kernels.splits import programs_per_sm

    assert programs_per_sm(dict(num_warps=4, maxnreg=168)) == 3
    assert programs_per_sm(dict(num_warps=4, maxnreg=128)) == 4
    assert programs_per_sm(dict(num_warps=8, maxnreg=255)) == 1
    assert programs_per_sm(dict(num_warps=4)) == 2 and programs_per_sm(dict(num_warps=8)) == 1


@pytest.mark.slow
def test_a_register_cap_is_a_known_decode_config_key():
    gen = torch.Generator().manual_seed(3)
    layer, bt, lens, _, _ = filled_layer(PageFormat(4, 4), [70], gen)
    q, qp = _queries(1, 16, gen)
    want = kernels.decode(layer, bt, lens, q, qp, 0.1, "reference")
    got = kernels.decode(layer, bt, lens, q, qp, 0.1, "triton", dict(maxnreg=168))
    assert rel(got[0], want[0]) < TOL


def test_content_chunks_are_whole_groups_or_none():
    """The kernel cuts d_c into 2 or 4 chunks only where each is whole 64-channel groups of a
    power-of-two latent; otherwise it reads the content path whole. Other counts are refused."""
    from quantmla.kernels.triton_decode import chunks

    assert chunks(PageFormat(4, 4), 4) == 4 and chunks(PageFormat(2, 4), 2) == 2
    assert chunks(PageFormat(16, 16), 4) == 4
    assert chunks(PageFormat(4, 4, 384), 4) == 1  # not a power of two
    assert chunks(PageFormat(4, 4, 128), 4) == 1 and chunks(PageFormat(4, 4, 128), 2) == 2  # 32 < one group
    with pytest.raises(ValueError, match="chunks must be 1, 2 or 4"):
        chunks(PageFormat(4, 4), 3)
    gen = torch.Generator().manual_seed(4)
    layer, bt, lens, _, _ = filled_layer(PageFormat(4, 4), [70], gen)
    q, qp = _queries(1, 16, gen)
    with pytest.raises(ValueError, match="chunks must be 1, 2 or 4"):
        kernels.decode(layer, bt, lens, q, qp, 0.1, "triton", dict(chunks=8))


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernels need a Hopper GPU (Gluon has no interpreter)")
@pytest.mark.parametrize(
    "cb, H, splits",
    [(4, 128, None), (4, 128, 1), (4, 100, 3), (2, 128, None), (2, 100, 3)],
    ids=str,
)
def test_gluon_decode_matches_reference(cb, H, splits):
    """C4R4 and C2R4 above 16 heads run the 64-head Gluon kernel by default. Ragged requests
    (shorter than the protected rows, not page multiples, empty), one to three or the default
    number of splits; every output written, within P's BF16 rounding of the float32 reference,
    LSE to 1e-3."""
    from quantmla.kernels.dispatch import default_config, plan
    from quantmla.kernels.splits import Case

    gen = torch.Generator().manual_seed(H + 7 * cb)
    lengths = [4000, 300, 70, 1, 0]
    layer, bt, lens, _, _ = filled_layer(PageFormat(cb, 4), lengths, gen)
    q, qp = _queries(len(lengths), H, gen)
    cfg = {} if splits is None else dict(num_splits=splits)
    full = default_config(len(lengths), H, 4000, layer, q.device, cfg)
    assert plan(Case(layer, H, 4000, q.device, False, full)).name == "gluon"
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5)
    out = _poisoned(len(lengths), H)
    o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, out=out)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < 1e-2 and rel(lse, lse_ref) < TOL and same_inf(lse, lse_ref)


def test_gluon_kernel_takes_only_the_cases_it_was_written_for():
    """The Gluon path takes C4R4 and C2R4 in BF16 with protection, above 16 heads, P as one BF16
    tile, 64-token tiles and at least MIN_TILES tiles per split on a Hopper GPU; for anything
    else (the interpreter, C4R8, a sink longer than page tile 0, 16 heads, the hi/lo P, other tiles,
    ``gluon=False``, short splits, the exact decode) it says why not, and the Triton kernel runs
    (at 16 heads, by default, at any length)."""
    from quantmla.kernels import gluon_decode
    from quantmla.kernels.dispatch import default_config, plan
    from quantmla.kernels.splits import Case

    gen = torch.Generator().manual_seed(8)
    layer, _, _, _, _ = filled_layer(PageFormat(4, 4), [70], gen)
    c2, _, _, _, _ = filled_layer(PageFormat(2, 4), [70], gen)
    c4r8, _, _, _, _ = filled_layer(PageFormat(4, 8), [70], gen)
    long_sink, _, _, _, _ = filled_layer(PageFormat(4, 4), [70], gen, sink=65)  # more than page tile 0 holds
    dev = torch.device(DEVICE)
    # one split: 256 tokens are 2 page tiles + the ring's 2 (MIN_TILES), 192 one fewer
    cfg = default_config(1, 128, 256, layer, dev, dict(num_splits=1, pv_split=False, block_n=64, gluon=True))

    def takes(lay, H=128, max_len=256, exact=False, **override):
        why = gluon_decode.supports(Case(lay, H, max_len, dev, exact, dict(cfg, **override)))
        assert why is None or (isinstance(why, str) and why), why
        return why is None

    assert gluon_decode.MIN_TILES == 4
    assert takes(layer) == _hopper() and takes(c2) == _hopper()
    assert not takes(layer, max_len=192)
    assert not takes(long_sink) and not takes(c4r8) and not takes(layer, H=16)
    assert not takes(layer, exact=True)
    for override in (dict(pv_split=True), dict(block_n=32), dict(gluon=False)):
        assert not takes(layer, **override), override
    full = default_config(1, 16, 1 << 20, layer, dev, {})
    assert plan(Case(layer, 16, 1 << 20, dev, False, full)).name == "triton"
    if not _hopper():  # the interpreter, or a GPU that is not sm_90
        assert plan(Case(layer, 128, 256, dev, False, cfg)).name == "triton"


@pytest.mark.parametrize("cb", [4, 2])
def test_reference_exact_decode_is_attention_over_the_unrounded_dequantized_cache(cb):
    """``exact=True``: float64 attention over s·(q − z) of the quantizer's own codes, scales and
    zero-points (quant.quantize, independent of the pages), the protected rows in BF16; and it is
    not the paper's function, whose reconstructed rows are rounded to BF16 first (on these
    latents that rounding moves the output by more than 1e-5)."""
    gen = torch.Generator().manual_seed(13 + cb)
    fmt = PageFormat(cb, 4)
    sink, recent = 4, 16
    lengths = [150, 9]
    layer, bt, lens, C, K = filled_layer(fmt, lengths, gen, sink=sink, recent=recent)
    q, qp = _queries(2, 8, gen)
    tau = 0.07
    o, lse = ref.decode(layer, bt, lens, q, qp, tau, exact=True)
    o_paper, _ = ref.decode(layer, bt, lens, q, qp, tau)
    o_api, _ = kernels.decode(layer, bt, lens, q, qp, tau, "reference", exact=True)  # the core's argument
    assert torch.equal(o_api, o)
    with pytest.raises(ValueError, match=r"unknown decode config keys \['exact'\]"):  # what, not how: no tuning key
        kernels.decode(layer, bt, lens, q, qp, tau, "reference", dict(exact=True))
    for b, L in enumerate(lengths):
        rows = []
        for x, bits, sd in ((C[b, :L].cpu(), cb, torch.bfloat16), (K[b, :L].cpu(), 4, torch.float32)):
            keep = torch.zeros(L, dtype=torch.bool)
            keep[protected_set(L, sink, recent)] = True
            rows.append(torch.where(keep[:, None], x.double(), exact_rows(x, bits, sd)))
        Ck, Kk = rows
        qb, qpb = q[b].cpu().to(fmt.dtype).double(), qp[b].cpu().to(fmt.dtype).double()
        s = tau * (qb @ Ck.T + qpb @ Kk.T)
        assert rel(o[b], torch.softmax(s, -1) @ Ck) < 1e-6
        assert rel(lse[b], torch.logsumexp(s, -1)) < 1e-7
    assert rel(o_paper[0], o[0]) > 1e-5


def test_exact_decode_falls_back_to_the_exact_reference_where_its_kernel_does_not_run(caplog):
    """Config ``exact`` is honoured by the exact-dequantization kernel for C4R4 or C2R4 in BF16 with
    protection at up to 16 heads on a Hopper GPU. Elsewhere (the interpreter, C3R4, 17 heads) the
    call computes the same function on the torch reference, says why once in the log, and never
    returns the rounded attention instead."""
    gen = torch.Generator().manual_seed(3)
    c4, bt, lens, _, _ = filled_layer(PageFormat(4, 4), [300], gen)
    c3, bt3, lens3, _, _ = filled_layer(PageFormat(3, 4), [300], gen)
    q, qp = _queries(1, 17, gen)
    cases = [(c3, bt3, lens3, q[:, :16], qp[:, :16]), (c4, bt, lens, q, qp)]
    if not _hopper():
        cases.append((c4, bt, lens, q[:, :16], qp[:, :16]))
    for layer, t, n, qq, qqp in cases:
        caplog.clear()
        with caplog.at_level("WARNING", logger="quantmla.kernels"):
            o, lse = kernels.decode(layer, t, n, qq, qqp, 0.1, "triton", exact=True)
            kernels.decode(layer, t, n, qq, qqp, 0.1, "triton", exact=True)
        o_ref, lse_ref = ref.decode(layer, t, n, qq, qqp, 0.1, exact=True)
        assert torch.equal(o.cpu(), o_ref.cpu()) and torch.equal(lse.cpu(), lse_ref.cpu())
        o_round, _ = ref.decode(layer, t, n, qq, qqp, 0.1)
        assert rel(o, o_round) > 1e-6  # the exact function, not the rounded one
        said = [r.getMessage() for r in caplog.records if "exact decode" in r.getMessage()]
        assert len(said) <= 1 and all("exact=True" in m and "torch reference" in m for m in said)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernels need a Hopper GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("cb", [4, 2])
@pytest.mark.parametrize(
    "H, splits, weight",
    [
        (16, None, None),
        (16, 1, None),
        (16, 3, None),
        (16, 3, 1),
        (16, 8, 2),
        (16, 40, 20),
        (9, 2, None),
        (1, None, None),
    ],
    ids=str,
)
def test_exact_decode_matches_the_exact_reference(H, splits, weight, cb):
    """The exact-dequantization kernel against float64 attention over s·(q − z) (reference.decode
    with exact=True): ragged requests (shorter than the protected rows, not page multiples, empty),
    one to forty or the default splits, protected tiles weighing 1 to 20 page tiles (at 20, each
    protected tile a split of its own); every output written; within P's FP16 rounding (1e-3; the
    BF16-rounded rows of the default kernels alone sit ~1e-3 away on such latents), LSE to 1e-5."""
    from quantmla.kernels.dispatch import default_config, plan
    from quantmla.kernels.splits import Case

    gen = torch.Generator().manual_seed(31 + H + cb)
    lengths = [4000, 300, 70, 1, 0]
    layer, bt, lens, _, _ = filled_layer(PageFormat(cb, 4), lengths, gen)
    q, qp = _queries(len(lengths), H, gen)
    cfg = {} if splits is None else dict(num_splits=splits)
    cfg |= {} if weight is None else dict(prot_weight=weight)
    full = default_config(len(lengths), H, 4000, layer, q.device, cfg)
    assert plan(Case(layer, H, 4000, q.device, True, full)).name == "exact"
    assert plan(Case(layer, H, 4000, q.device, False, full)).name == "triton"  # the exact kernel computes only that
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5, exact=True)
    out = _poisoned(len(lengths), H)
    o, lse = kernels.decode(layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, out=out, exact=True)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert rel(o, o_ref) < 1e-3 and rel(lse, lse_ref) < 1e-5 and same_inf(lse, lse_ref)


@pytest.mark.skipif(not _hopper(), reason="the Gluon kernels need a Hopper GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("cb", [4, 2])
def test_exact_decode_reads_protected_rows_from_the_protection_buffer(cb):
    """As for the other kernels: with the sink and ring rows of the protection buffer replaced by
    unrelated values, the exact kernel follows them (one split and three) and not the pages."""
    gen = torch.Generator().manual_seed(5 + cb)
    lengths = [300, 70, 3, 200]
    layer, bt, lens, _, _ = filled_layer(PageFormat(cb, 4), lengths, gen)
    q, qp = _queries(len(lengths), 16, gen)
    o_pages, _ = ref.decode(layer, bt, lens, q, qp, 576**-0.5, exact=True)
    layer.prot.copy_((torch.randn(layer.prot.shape, generator=gen) * 3 - 1).to(layer.prot.device, layer.prot.dtype))
    o_ref, lse_ref = ref.decode(layer, bt, lens, q, qp, 576**-0.5, exact=True)
    assert all(rel(o_pages[b], o_ref[b]) > 0.1 for b in range(len(lengths)))
    for cfg in (dict(num_splits=1), dict(num_splits=3)):
        o, lse = kernels.decode(
            layer, bt, lens, q, qp, 576**-0.5, "triton", cfg, _poisoned(len(lengths), 16), exact=True
        )
        assert not torch.isnan(o).any() and not torch.isnan(lse).any()
        assert rel(o, o_ref) < 1e-3 and rel(lse, lse_ref) < 1e-5 and same_inf(lse, lse_ref), cfg
