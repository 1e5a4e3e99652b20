"""Tests for maskprior_fast.py: each speed path equals the explicit softmax in outputs and every gradient.

The band and far part of a windowed relative prior (`_prior_band`, `_BandPrior`), the hand backward of the fused CPU
kernel (`_backward`: its blocks, its diagonal sums, a full M's gradient block by block), the bias a full M reads
(`_bias`, `_log_sigmoid`), and which path `prior_attention` takes. Small sizes: seconds in all.
Run: python -m pytest -q test_fast.py
"""
import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

import maskprior as mp
import maskprior_fast as fast


def _reference(q, k, v, prior, r):
    """The explicit softmax in float32 with the prior's own bias (M by functional_call): its output and the gradients
    of q, k, v and M of the loss sum(out * r)."""
    t, s = q.shape[-2], k.shape[-2]
    qf, kf, vf = (x.detach().float().requires_grad_() for x in (q, k, v))
    m = prior.bias.detach().clone().requires_grad_()
    bias = torch.func.functional_call(prior, {"bias": m}, (t,), {"k_len": s})
    want = ((qf @ kf.transpose(-2, -1)) * q.shape[-1] ** -0.5 + bias).softmax(-1) @ vf
    return (want, *torch.autograd.grad((want * r).sum(), (qf, kf, vf, m)))


def _inputs(prior, b, t, s, d, dtype, seed=0):
    """M drawn wide (N(0, 3)), q (B, H, T, d), k, v (B, H, S, d) in `dtype`, and the loss weights r."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        prior.bias.normal_(0, 3, generator=gen)
    q = torch.randn(b, prior.heads, t, d, generator=gen).to(dtype).requires_grad_()
    k, v = (torch.randn(b, prior.heads, s, d, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    return q, k, v, torch.randn(b, prior.heads, t, d, generator=gen)


def _close(got, want, dtype, what):
    """Each of got equals want to 1e-5 of its largest entry in float32, to bf16's rounding (2e-2) in bfloat16."""
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for name, a, b in zip(("out", "dq", "dk", "dv", "dM"), got, want):
        a, b = a.detach().float(), b.detach()
        err = float((a - b).abs().max())
        assert err <= tol * max(float(b.abs().max()), 1.0), (what, name, err)


# (W distances, batch, queries T, keys S): the band alone and with the far part, the kernel's square causal call and
# its masked one (a cache of more than W keys), blocks that do not divide T
BAND_LAYOUTS = {
    "T < W": (16, 2, 9, 9),
    "T = W": (16, 1, 16, 16),
    "T >> W": (8, 2, 150, 150),
    "T not a multiple of any block": (40, 2, 203, 203),
    "W past one block": (70, 1, 190, 190),
    "a table of one": (1, 2, 40, 40),
    "after a cache of fewer than W keys": (16, 2, 30, 40),
    "after a cache of more than W keys": (16, 2, 7, 150),
    "one query after a cache": (16, 3, 1, 99),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", list(BAND_LAYOUTS))
def test_the_band_and_far_part_equal_the_explicit_softmax_in_outputs_and_every_gradient(layout, dtype):
    """A causal relative prior of W distances by its band (distances 0 .. W - 1, by hand) and far part (the kernel's
    causal attention of the queries shifted by W, one logit a head), merged by log-sum-exp: the explicit softmax's
    output and the gradients of q, k, v and M (measured <= 1.5e-6 of the largest entry in float32, <= 5e-3 in bf16),
    for T < W, T = W, T >> W, ragged blocks, batch and heads, and queries after a KV cache."""
    w, b, t, s = BAND_LAYOUTS[layout]
    prior = mp.MaskPrior(w, 3, causal=True, param="relative")
    q, k, v, r = _inputs(prior, b, t, s, 8, dtype)
    got = fast._prior_band(q, k, v, prior)
    assert got.dtype == dtype and got.shape == q.shape
    grads = torch.autograd.grad((got.float() * r).sum(), (q, k, v, prior.bias))
    _close((got, *grads), _reference(q, k, v, prior, r), dtype, layout)


def test_the_band_route_serves_generation_and_an_m_alone_learning():
    """Under no_grad (generation) the band route gives the output alone; with only M learning, M's gradient alone,
    the same as with q, k, v learning too."""
    prior = mp.MaskPrior(8, 2, causal=True, param="relative")
    q, k, v, r = _inputs(prior, 2, 60, 60, 8, torch.float32)
    with torch.no_grad():
        out = fast._prior_band(q, k, v, prior)
    torch.testing.assert_close(out, _reference(q, k, v, prior, r)[0], atol=1e-6, rtol=1e-5)
    alone = torch.autograd.grad((fast._prior_band(q.detach(), k.detach(), v.detach(), prior) * r).sum(), prior.bias)
    both = torch.autograd.grad((fast._prior_band(q, k, v, prior) * r).sum(), (q, prior.bias))
    torch.testing.assert_close(alone[0], both[1], atol=1e-6, rtol=1e-5)


def test_prior_attention_takes_the_band_route_for_a_long_causal_relative_prior(monkeypatch):
    """prior_attention sends a causal relative prior of W distances over at least max(BAND_FROM, 8 W) keys to the
    band route and anything else to the fused kernel with the hand backward; a model with `mask_window` then trains
    as the explicit path does (outputs and every parameter's gradient)."""
    taken, band, fused = [], fast._prior_band, fast._FusedPrior
    monkeypatch.setattr(fast, "_prior_band", lambda *a: taken.append("_prior_band") or band(*a))
    monkeypatch.setattr(fast, "_FusedPrior", types.SimpleNamespace(
        apply=lambda *a: taken.append("_FusedPrior") or fused.apply(*a)))
    monkeypatch.setattr(fast, "BAND_FROM", 32)
    q = k = v = torch.randn(1, 2, 40, 8)
    for prior, path in ((mp.MaskPrior(4, 2, causal=True, param="relative"), "_prior_band"),
                        (mp.MaskPrior(6, 2, causal=True, param="relative"), "_FusedPrior"),     # 40 < 8 x 6
                        (mp.MaskPrior(4, 2, param="relative"), "_FusedPrior"),                  # not causal
                        (mp.MaskPrior(40, 2, causal=True, param="full"), "_FusedPrior")):
        taken.clear()
        fast.prior_attention(q, k, v, prior)
        assert taken == [path], (prior, taken)
    cfg = mp.TransformerConfig(vocab_size=11, seq_len=48, n_outputs=11, readout="tokens", causal=True, n_layers=2,
                               n_heads=2, dim=16, mlp_dim=32, learnable_mask=True, mask_param="relative",
                               mask_window=4)
    torch.manual_seed(0)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, logits=mp.causal_distance_logits(4, 2))
    explicit = mp.Transformer(dataclasses.replace(cfg, fused=False))
    explicit.load_state_dict(model.state_dict())
    x = torch.randint(0, 11, (3, 48))
    taken.clear()
    outs = [m(x) for m in (model, explicit)]
    assert taken == ["_prior_band"] * 2
    for m, out in zip((model, explicit), outs):
        out.square().sum().backward()
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(model.parameters(), explicit.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------- the hand backward


@pytest.mark.parametrize("block", [1, 7, 16, 64])
@pytest.mark.parametrize("param", ["full", "relative"])
def test_the_hand_backward_gives_the_same_gradients_whatever_its_block(param, block):
    """`_backward` in blocks of 1, 7, 16 or 64 query rows (T = 50: ragged) gives the explicit softmax's gradients of
    q, k, v and M, a full M's by (query, key) times sigmoid(-M) block by block, a relative one's by diagonal."""
    prior = mp.MaskPrior(50, 2, causal=True, param=param)
    q, k, v, r = _inputs(prior, 2, 50, 50, 8, torch.float32)
    bias = prior(50).detach()
    out, lse = fast._cpu_kernel()(q.detach(), k.detach(), v.detach(), 0.0, True, attn_mask=bias[None])
    got = fast._backward(prior, q.detach(), k.detach(), v.detach(), out, lse, r, bias, True, block)
    _close((out, *got), _reference(q, k, v, prior, r), torch.float32, f"{param}, block {block}")


@pytest.mark.parametrize("shape", [(2, 5, 3), (2, 5, 5), (3, 4, 19), (1, 1, 6), (2, 64, 300)])
def test_diagonal_sums_read_ds_in_place_and_equal_the_skewed_copy(shape):
    """`_diagonal_sums` (the diagonals every row crosses as a strided view of ds, the corners padded) equals the sums
    along each diagonal taken one by one: entry e holds j - i = e - R."""
    ds = torch.randn(*shape, dtype=torch.float64)
    h, r, c = shape
    want = torch.stack([torch.stack([ds[g].diagonal(e - r).sum() if -r < e - r < c else torch.zeros((), dtype=ds.dtype)
                                     for e in range(r + c)]) for g in range(h)])
    torch.testing.assert_close(fast._diagonal_sums(ds), want, atol=1e-12, rtol=0)


def test_log_sigmoid_equals_torch_s_to_rounding_everywhere():
    """`_log_sigmoid` (log of sigmoid down to -80, M itself below) equals F.logsigmoid to float32's rounding of
    a logit (<= 1e-6 absolute, and relative past |M| = 1) from -1e6 to 1e6, in float32 and float64."""
    m = torch.cat([torch.linspace(-200, 200, 40001), torch.tensor([-1e6, -1e3, -80.0, -79.99, 0.0, 30.0, 1e3, 1e6])])
    for dtype, tol in ((torch.float32, 1e-6), (torch.float64, 1e-12)):
        got, want = fast._log_sigmoid(m.to(dtype)), F.logsigmoid(m.to(dtype))
        assert got.dtype == dtype and bool(((got - want).abs() <= tol * want.abs().clamp(min=1)).all()), dtype


@pytest.mark.parametrize("layout", ["full", "full causal", "a prefix", "a KV cache", "cross-attention"])
def test_a_full_m_s_bias_equals_the_prior_s_own(layout):
    """`_bias`, a full M's bias computed by the speed path, equals prior(t, dtype, k_len=s) to rounding (-inf on
    the same future keys) for every layout a full M serves, in float32 and bf16."""
    kw, t, s = {"full": (dict(param="full"), 12, 12), "full causal": (dict(param="full", causal=True), 12, 12),
                "a prefix": (dict(param="full", causal=True), 7, 7),
                "a KV cache": (dict(param="full", causal=True), 4, 9),
                "cross-attention": (dict(n_keys=5), 12, 5)}[layout]
    prior = mp.MaskPrior(12, 3, **kw)
    with torch.no_grad():
        prior.bias.normal_(0, 30, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.float32, torch.bfloat16):
        got, want = fast._bias(prior, t, s, dtype), prior(t, dtype, k_len=s)
        assert got.dtype == want.dtype and torch.equal(got.isinf(), want.isinf())
        torch.testing.assert_close(got[~got.isinf()].float(), want[~want.isinf()].float(), atol=1e-6, rtol=4e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["T >> W", "T not a multiple of any block", "after a cache of more than W keys"])
def test_cuda_band_route_equals_the_explicit_softmax(layout, dtype):
    """On CUDA the band route's far part is the memory-efficient kernel (its log-sum-exp padded to 32 rows, a mask
    after a long cache): outputs and every gradient are the explicit softmax's, as on the CPU."""
    w, b, t, s = BAND_LAYOUTS[layout]
    prior = mp.MaskPrior(w, 3, causal=True, param="relative")
    q, k, v, r = _inputs(prior, b, t, s, 8, dtype)
    prior.cuda()
    q, k, v = (x.detach().cuda().requires_grad_() for x in (q, k, v))
    got = fast._prior_band(q, k, v, prior)
    grads = torch.autograd.grad((got.float() * r.cuda()).sum(), (q, k, v, prior.bias))
    want = _reference(q, k, v, prior, r.cuda())
    _close((got, *grads), want, dtype, layout)
