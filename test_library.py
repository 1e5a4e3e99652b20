"""A fuzzer of maskprior.py's public arguments (Hypothesis): the pattern builders, causal_distance_logits and
alibi_slopes, mask_logits_from_pattern, MaskPrior and set_logits, depends_on_distance, the inits (init_mask_,
init_qk_svd_, init_qk_opt_), generate, and the model configs. Each call gets good arguments, or good ones but one
hostile (a bool as an integer, nan and inf, a level past float32, a size past any memory, another dtype, the meta
device, a list of the wrong things), or any mix, and keeps the promise: a valid result (finite tensors of the
documented shape, and what the call says of them) or one ValueError / TypeError line; never another exception, a hang
or a memory blow-up. Sizes drawn are small or past a declared maximum (so a call not refused stays small), and each
call runs with the address space capped a few GiB above what the process holds, so a blow-up fails the example
instead of swapping the machine. The cases issue 64 item 7 found are @example entries."""
import contextlib
import dataclasses
import resource

import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import maskprior as mp

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
HUGE = [10 ** 9, 2 ** 31, 10 ** 18, 2 ** 63, 10 ** 30]          # past every declared maximum
JUNK = [None, True, False, 2.0, 2.5, float("nan"), float("inf"), "3", (1,), torch.tensor(3.0)]
LEVELS = [1e308, 1e39, -1e39, 3.5e38, 10 ** 400, -1e-300, True, "5", None, float("nan"), -float("inf")]


def count(lo: int = 1, hi: int = 6) -> tuple:
    """(good, hostile) counts: small ones; below 1, past any memory, or not an integer."""
    return st.integers(lo, hi), st.one_of(st.integers(-2, lo - 1), st.sampled_from(HUGE), st.sampled_from(JUNK))


def unbounded_count(lo: int = 1, hi: int = 6) -> tuple:
    """Counts of work or width without a declared maximum: hostile ones are small or not integers, never huge."""
    return st.integers(lo, hi), st.one_of(st.integers(-2, lo - 1), st.sampled_from(JUNK))


def level(lo: float = 0.0, hi: float = 40.0) -> tuple:
    """(good, hostile) reals: ordinary ones; any float at all (nan, inf, 1e308, subnormals) or not a number."""
    return st.floats(lo, hi), st.one_of(st.floats(), st.integers(-3, 10 ** 40), st.sampled_from(LEVELS))


SWITCH = (st.booleans(), st.sampled_from([0, 1, "yes", None, 1.0]))


@st.composite
def arguments(draw, **spec):
    """A call's arguments (spec: name -> (good, hostile) strategies): all good (about half the calls), all good but
    one hostile, or a mix."""
    hostile = draw(st.sampled_from([None] * len(spec) + ["*", *spec]))
    return {name: draw(bad if name == hostile or hostile == "*" and draw(st.booleans()) else good)
            for name, (good, bad) in spec.items()}


@contextlib.contextmanager
def _capped(extra: int = 4 << 30):
    """The address space capped at what the process holds now plus `extra` (Linux; elsewhere no cap)."""
    try:
        with open("/proc/self/statm") as f:
            held = int(f.read().split()[0]) * resource.getpagesize()
    except OSError:
        yield
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = held + extra if hard == resource.RLIM_INFINITY else min(held + extra, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


REFUSED = object()


def _kept(call, valid=None):
    """The promise: `call` (under the cap) gives a result `valid` accepts, or a ValueError / TypeError of one line;
    any other exception propagates and fails the example. -> the result, or REFUSED."""
    try:
        with _capped():
            out = call()
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert msg.strip() and "\n" not in msg and len(msg) < 700, f"{type(e).__name__} is not one line: {msg!r}"
        return REFUSED
    if valid is not None:
        valid(out)
    return out


def _tensor(shape, dtype=None, finite=True):
    """A validator: a tensor of `shape` (and `dtype`), finite if floating (or, not `finite`, never nan: a bias)."""
    def valid(out):
        assert isinstance(out, torch.Tensor) and tuple(out.shape) == tuple(shape), (type(out), getattr(out, "shape", 0))
        assert dtype is None or out.dtype == dtype, out.dtype
        if out.is_floating_point() and not out.is_meta:
            assert bool(torch.isfinite(out).all()) if finite else not bool(out.isnan().any()), "not finite"
    return valid


def _f32(v) -> float:
    return float(torch.tensor(float(v), dtype=torch.float32))


# ---------------------------------------------------------------------------------------- tensors, hostile too

@st.composite
def _bools(draw, n, heads):
    shape = draw(st.sampled_from([(n, n), (heads, n, n)] if heads else [(n, n), (1, n, n), (2, n, n), (3, n, n)]))
    p = torch.rand(shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 999)))) < draw(
        st.sampled_from([0.3, 0.7, 1.0]))
    return p | torch.eye(n, dtype=torch.bool)


def patterns(n: int | None = None, heads: int | None = None) -> tuple:
    """(good, hostile) patterns of n positions (any n, 1 .. 6, where None): bool (n, n) or (heads, n, n) that
    allow a pair; or one that allows none, float, long, meta, 1-D, not square, of another size, a list."""
    sizes = st.integers(1, 6) if n is None else st.just(n)
    good = sizes.flatmap(lambda k: _bools(k, heads))
    bad = st.tuples(good, st.sampled_from(["none", "float", "long", "meta", "1d", "wide", "list", "other"])).map(
        lambda pk: {"none": pk[0] & False, "float": pk[0].float(), "long": pk[0].long(), "meta": pk[0].to("meta"),
                    "1d": pk[0].flatten(), "wide": torch.ones(*pk[0].shape[:-1], pk[0].shape[-1] + 1, dtype=torch.bool),
                    "list": pk[0].tolist(), "other": torch.eye(pk[0].shape[-1] + 1, dtype=torch.bool)}[pk[1]])
    return good, bad


@st.composite
def _floats(draw, n):
    """Float32 logits (n, n) or (2, n, n): any, by distance i - j alone (what a relative prior holds), with no
    future key allowed (M <= 0 above the diagonal: what a causal prior takes), or both."""
    shape = draw(st.sampled_from([(n, n), (2, n, n)]))
    g, scale = torch.Generator().manual_seed(draw(st.integers(0, 999))), draw(st.sampled_from([0.0, 1.0, 10.0]))
    form = draw(st.sampled_from(["any", "distance", "past", "past distance"]))
    if "distance" in form:
        i = torch.arange(n)
        line = torch.randn(2 * n - 1, generator=g) * scale
        line[:n - 1] = -line[:n - 1].abs() if "past" in form else line[:n - 1]
        return line[i[:, None] - i[None, :] + n - 1].expand(shape).clone()
    m = torch.randn(shape, generator=g) * scale
    return m.tril() - m.triu(1).abs() if form == "past" else m


def logits(n: int | None = None) -> tuple:
    """(good, hostile) logits of n positions: float32 (n, n) or (2, n, n); or float64 past float32, half, with nan
    or inf, long, bool, meta, 1-D, of another size."""
    good = (st.integers(1, 6) if n is None else st.just(n)).flatmap(_floats)

    def spoil(m, how):
        if how in ("nan", "inf"):
            m = m.clone()
            m.view(-1)[0] = float(how)
        return {"f64": m.double() * 1e300, "half": m.half(), "bf16": m.bfloat16(), "long": m.long(), "bool": m > 0,
                "meta": m.to("meta"), "1d": m.flatten(),
                "other": torch.zeros(m.shape[-1] + 1, m.shape[-1] + 1)}.get(how, m)
    hows = ["f64", "half", "bf16", "nan", "inf", "long", "bool", "meta", "1d", "other"]
    return good, st.tuples(good, st.sampled_from(hows)).map(lambda mh: spoil(*mh))


INDEX = st.one_of(st.booleans(), st.floats(allow_nan=True), st.sampled_from([10 ** 30, -1, torch.tensor(1.0),
                                                                            torch.tensor(True), "1", None]))
PAIRS = (st.one_of(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=5),
                   st.just(torch.tensor([[0, 1], [2, 3]]))),
         st.one_of(st.lists(st.one_of(st.tuples(INDEX, st.integers(0, 3)), st.tuples(st.integers(0, 3)),
                                      st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, 3))),
                            min_size=1, max_size=3),
                   st.sampled_from([None, "ab", 3, torch.tensor([[0.0, 1.0]]), torch.tensor([0, 1]), [(4, 0)],
                                    {(0, 1)}])))
OFFSETS = (st.lists(st.tuples(st.integers(-1, 1), st.integers(-1, 1)), min_size=1, max_size=4),
           st.one_of(st.lists(st.tuples(INDEX, INDEX), max_size=3),
                     st.sampled_from([None, [], "ab", [(0,)], [(5, 0)]])))


# ---------------------------------------------------------------------------------------- the pattern builders

@FUZZ
@given(kw=arguments(n=count(4, 6), pairs=PAIRS, symmetric=SWITCH, self_loops=SWITCH))
@example(kw=dict(n=4, pairs=[(True, False)], symmetric=False, self_loops=True))   # issue 64.7: bools taken as 1, 0
@example(kw=dict(n=4, pairs=[(1.0, 0.0)], symmetric=False, self_loops=True))     # issue 64.7: an IndexError
@example(kw=dict(n=10 ** 18, pairs=[], symmetric=False, self_loops=True))        # memory exhausted
def test_pattern_from_pairs_keeps_its_promise(kw):
    def valid(p):
        _tensor((kw["n"], kw["n"]), torch.bool)(p)
        for i, j in kw["pairs"]:
            assert p[int(i), int(j)] and (not kw["symmetric"] or p[int(j), int(i)])
        assert not kw["self_loops"] or bool(p.diagonal().all())
    _kept(lambda: mp.pattern_from_pairs(**kw), valid)


@FUZZ
@given(kw=arguments(n=count(), width=count(0, 7), circulant=SWITCH, causal=SWITCH))
@example(kw=dict(n=4, width=10 ** 30, circulant=False, causal=False))             # an int64 overflow
@example(kw=dict(n=10 ** 18, width=1, circulant=False, causal=True))             # memory exhausted
def test_banded_causal_and_visible_patterns_keep_their_promise(kw):
    n = kw["n"]

    def band(p):
        _tensor((n, n), torch.bool)(p)
        i = torch.arange(n)
        d = (i[:, None] - i[None, :]).abs()
        assert p.equal((torch.minimum(d, n - d) if kw["circulant"] else d) <= kw["width"])
    _kept(lambda: mp.banded_pattern(kw["n"], kw["width"], kw["circulant"]), band)
    _kept(lambda: mp.causal_pattern(n), lambda p: _tensor((n, n), torch.bool)(p) or p.equal(p.tril()))
    _kept(lambda: mp.visible_keys(n, kw["causal"]), _tensor((n, n), torch.bool))


@FUZZ
@given(kw=arguments(grid_h=count(1, 3), grid_w=count(1, 3), offsets=OFFSETS, kernel=count(1, 5), n_heads=count(1, 4),
                    n_prefix=count(0, 2), prefix_all=SWITCH, alpha=level(0, 5), m_on=level(), m_off=level()))
@example(kw=dict(grid_h=2, grid_w=2, offsets=[(0, 0)], kernel=10 ** 30, n_heads=2, n_prefix=0, prefix_all=True,
                 alpha=1e308, m_on=5.0, m_off=5.0))                            # a nan bump, an int64 overflow
@example(kw=dict(grid_h=400, grid_w=400, offsets=[(0, 1)], kernel=3, n_heads=4, n_prefix=0, prefix_all=True,
                 alpha=1.0, m_on=5.0, m_off=5.0))                              # 51e9 entries: refused, not built
@example(kw=dict(grid_h=1, grid_w=1, offsets=[(10 ** 30, 10 ** 30)], kernel=1, n_heads=1, n_prefix=0,
                 prefix_all=False, alpha=0.0, m_on=0.0, m_off=0.0))            # 0 x inf: a nan bump (found by CI)
def test_grid_patterns_keep_their_promise(kw):
    ints = all(isinstance(kw[k], int) and not isinstance(kw[k], bool) for k in ("grid_h", "grid_w", "n_prefix"))
    n = kw["n_prefix"] + kw["grid_h"] * kw["grid_w"] if ints else 0
    h = len(kw["offsets"]) if isinstance(kw["offsets"], list) else 0
    grid = {k: kw[k] for k in ("grid_h", "grid_w")}
    _kept(lambda: mp.impulse_pattern(**grid, offsets=kw["offsets"], n_prefix=kw["n_prefix"],
                                     prefix_all=kw["prefix_all"]), _tensor((h, n, n), torch.bool))
    _kept(lambda: mp.window_pattern(**grid, kernel=kw["kernel"], n_heads=kw["n_heads"], n_prefix=kw["n_prefix"]),
          _tensor((kw["n_heads"], n, n), torch.bool))

    def bumps(m):
        _tensor((h, n, n), torch.float32)(m)
        assert bool((m >= -_f32(kw["m_off"])).all()) and bool((m <= _f32(kw["m_on"])).all())
    _kept(lambda: mp.soft_offset_logits(**grid, offsets=kw["offsets"], alpha=kw["alpha"], m_on=kw["m_on"],
                                        m_off=kw["m_off"], n_prefix=kw["n_prefix"]), bumps)
    k = kw["kernel"]
    _kept(lambda: mp.random_impulse_offsets(kw["n_heads"], k, torch.Generator().manual_seed(0)),
          lambda out: len(out) == kw["n_heads"] and all(max(abs(dr), abs(dc)) <= k // 2 for dr, dc in out))


@st.composite
def embed_calls(draw):
    """embed_pattern's arguments: a pattern of K positions, an offset, n >= offset + K (or hostile ones)."""
    good = draw(patterns()[0])
    offset = draw(st.integers(0, 3))
    return draw(arguments(pattern=(st.just(good), patterns()[1]), offset=(st.just(offset), count(0)[1]),
                          n=(st.just(offset + good.shape[-1] + draw(st.integers(0, 2))), count()[1])))


@FUZZ
@given(kw=embed_calls())
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), offset=10, n=6))      # a RuntimeError: past n
def test_embed_pattern_keeps_its_promise(kw):
    p = kw["pattern"]

    def valid(out):
        _tensor((*p.shape[:-2], kw["n"], kw["n"]), torch.bool)(out)
        k, o = p.shape[-1], kw["offset"]
        assert out[..., o:o + k, o:o + k].equal(p) and int(out.sum()) == int(p.sum())
    _kept(lambda: mp.embed_pattern(**kw), valid)


# ---------------------------------------------------------------------------------------- logits and slopes

@FUZZ
@given(kw=arguments(n=count(1, 8), n_heads=count(1, 5), self_logit=level(-40, 40)))
@example(kw=dict(n=10 ** 18, n_heads=4, self_logit=10.0))                      # issue 64.7: memory exhausted
@example(kw=dict(n=4, n_heads=2, self_logit=1e39))                             # issue 64.7: a RuntimeError
@example(kw=dict(n=2 ** 20, n_heads=4, self_logit=10.0))                       # within n's bound, past MAX_ENTRIES
def test_causal_distance_logits_keeps_its_promise(kw):
    def valid(m):
        _tensor((kw["n_heads"], kw["n"], kw["n"]), torch.float32)(m)
        assert bool((m.diagonal(dim1=1, dim2=2) == _f32(kw["self_logit"])).all())
        assert mp.depends_on_distance(m, causal=True)
    _kept(lambda: mp.causal_distance_logits(**kw), valid)


@FUZZ
@given(n_heads=st.one_of(*count(1, 64)))
@example(n_heads=10 ** 9)                                                      # issue 64.7: memory exhausted
def test_alibi_slopes_keeps_its_promise(n_heads):
    def valid(s):
        _tensor((n_heads,))(s)
        assert bool(((s > 0) & (s <= 1)).all()) and bool((s[1:] < s[:-1]).all())
    _kept(lambda: mp.alibi_slopes(n_heads), valid)


@FUZZ
@given(kw=arguments(pattern=patterns(), m_on=level(), m_off=level()))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), m_on=1e308, m_off=5.0))         # issue 64.7: an infinite M
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), m_on=5.0, m_off=10 ** 400))     # an OverflowError
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool, device="meta"), m_on=5.0, m_off=5.0))
def test_mask_logits_from_pattern_keeps_its_promise(kw):
    p = kw["pattern"]

    def valid(m):
        _tensor(p.shape, torch.float32)(m)
        assert bool((m[p] == _f32(kw["m_on"])).all()) and bool((m[~p] == -_f32(kw["m_off"])).all())
    _kept(lambda: mp.mask_logits_from_pattern(**kw), valid)


@FUZZ
@given(kw=arguments(values=(st.one_of(patterns()[0], logits()[0]), st.one_of(patterns()[1], logits()[1])),
                    causal=SWITCH))
@example(kw=dict(values=torch.ones(4, 4, dtype=torch.bool, device="meta"), causal=False))  # issue 64.7: meta
def test_depends_on_distance_keeps_its_promise(kw):
    _kept(lambda: mp.depends_on_distance(**kw), lambda out: isinstance(out, bool))


# ---------------------------------------------------------------------------------------- the prior

@st.composite
def prior_calls(draw):
    """MaskPrior's arguments: all good (the source built for n), or one hostile (a source of another size too)."""
    n = draw(st.integers(1, 6))
    source = draw(st.sampled_from(["none", "pattern", "logits"]))
    heads = draw(st.integers(1, 3))
    spec = dict(n=(st.just(n), count()[1]), heads=(st.just(heads), count()[1]), m_on=level(), m_off=level(),
                causal=SWITCH,
                param=(st.sampled_from([None, "full", "relative"]), st.sampled_from(["ful", 1, ""])),
                n_keys=(st.sampled_from([None, None, n, n + 1]), count()[1]), prefix=SWITCH)
    if source != "none":
        spec[source] = patterns(n, heads) if source == "pattern" else logits(n)
    kw = draw(arguments(**spec))
    p = kw.get("pattern")
    if kw["causal"] is True and _square_bool(p, n) and draw(st.booleans()):    # a causal pattern, mostly
        kw["pattern"] = p & torch.ones(n, n, dtype=torch.bool).tril()
    return kw


def _square_bool(p, n) -> bool:
    return torch.is_tensor(p) and not p.is_meta and p.dtype == torch.bool and p.dim() >= 2 and p.shape[-1] == n


def _serves(heads, n, n_keys):
    """A validator of a prior: M finite, and its bias (heads, n, n_keys) never nan nor above 0."""
    def valid(prior):
        assert isinstance(prior, mp.MaskPrior) and bool(torch.isfinite(prior.bias).all())
        if not prior.bias.is_meta:
            bias = prior()
            _tensor((heads, n, n_keys or n), finite=False)(bias)
            assert bool((bias <= 0).all())
    return valid


@FUZZ
@given(kw=prior_calls())
@example(kw=dict(n=4, heads=2, pattern=torch.eye(4, dtype=torch.bool), m_on=1e308))      # issue 64.7: M inf
@example(kw=dict(n=10 ** 18, heads=2))                                                   # memory exhausted
@example(kw=dict(n=2 ** 20, heads=8, causal=True))                                       # a full M of 8e12 entries
@example(kw=dict(n=4, heads=2, logits=torch.zeros(4, 4, device="meta")))                 # meta logits
def test_mask_prior_keeps_its_promise(kw):
    _kept(lambda: mp.MaskPrior(**kw), _serves(kw["heads"], kw["n"], kw.get("n_keys")))


@FUZZ
@given(causal=st.booleans(), param=st.sampled_from(["full", "relative"]), new=st.one_of(*logits(4)))
@example(causal=False, param="full", new=torch.zeros(4, 4, device="meta"))      # issue 64.7: meta, a RuntimeError
@example(causal=False, param="full", new=torch.ones(4, 4, dtype=torch.bool))    # a bool taken as 0 / 1
def test_set_logits_keeps_its_promise(causal, param, new):
    prior = mp.MaskPrior(4, 2, causal=causal, param=param)
    before = prior.bias.detach().clone()
    if _kept(lambda: prior.set_logits(new)) is REFUSED:
        assert prior.bias.equal(before), "a refused set_logits changed M"
    elif param == "full" and not causal:
        assert prior.bias.equal(new.float().expand(2, 4, 4)), "M is not the logits set"
    _serves(2, 4, None)(prior)


def test_a_prior_built_under_the_meta_device_takes_a_cpu_pattern_and_the_builders_run_there():
    """issue 64.7: `with torch.device('meta')`, MaskPrior(pattern=<a CPU pattern>) was a RuntimeError: it keeps the
    pattern as M's start (set once M has memory), and every builder runs there or refuses in one line."""
    pattern = mp.banded_pattern(4, 1)
    with torch.device("meta"):
        prior = mp.MaskPrior(4, 2, pattern=pattern)
        assert prior.bias.is_meta and prior.start.equal(mp.mask_logits_from_pattern(pattern).expand(2, 4, 4))
        assert len(mp.random_impulse_offsets(3)) == 3
        for call, shape in ((lambda: mp.banded_pattern(4, 1), (4, 4)), (lambda: mp.causal_pattern(4), (4, 4)),
                            (lambda: mp.pattern_from_pairs(4, [(0, 1)]), (4, 4)),
                            (lambda: mp.causal_distance_logits(4, 2), (2, 4, 4)), (lambda: mp.alibi_slopes(4), (4,)),
                            (lambda: mp.window_pattern(2, 2, 3, 2), (2, 4, 4)),
                            (lambda: mp.mask_logits_from_pattern(pattern), (4, 4))):
            assert _kept(call, _tensor(shape)) is not REFUSED
    prior.to_empty(device="cpu").reset_parameters()
    assert prior.bias.equal(mp.mask_logits_from_pattern(pattern).expand(2, 4, 4))


# ---------------------------------------------------------------------------------------- the inits and sampling

def _small(causal: bool = False, **kw) -> mp.Transformer:
    torch.manual_seed(0)
    return mp.Transformer(mp.TransformerConfig(vocab_size=3, seq_len=3, dim=8, n_heads=2, mlp_dim=8, n_layers=1,
                                               causal=causal, readout="tokens" if causal else "cls", **kw))


def _finite_model(model):
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters()), "a weight is not finite"
    with torch.no_grad():
        assert bool(torch.isfinite(model(torch.zeros(2, 3, dtype=torch.long))).all()), "the outputs are not finite"


@st.composite
def init_mask_calls(draw):
    """init_mask_'s arguments for a small model (causal: 3 positions, a causal pattern mostly; else 4 with CLS): a
    pattern or logits (both, or neither, now and then), levels."""
    causal = draw(st.booleans())
    n = 3 if causal else 4
    kw = draw(arguments(pattern=patterns(n, 2), logits=logits(n), m_on=level(), m_off=level()))
    if causal and _square_bool(kw["pattern"], n) and draw(st.integers(0, 3)):
        kw["pattern"] = kw["pattern"] & torch.ones(n, n, dtype=torch.bool).tril()
    if torch.is_tensor(kw["logits"]) and kw["logits"].is_floating_point() and causal and draw(st.integers(0, 3)):
        kw["logits"] = kw["logits"].tril() - kw["logits"].triu(1).abs() if kw["logits"].dim() >= 2 else kw["logits"]
    source = draw(st.sampled_from(["pattern"] * 3 + ["logits"] * 3 + ["none", "both"]))
    return causal, {**kw, **{k: None for k in ("pattern", "logits") if source not in (k, "both")}}


@FUZZ
@given(call=init_mask_calls())
@example(call=(False, dict(pattern=torch.eye(4, dtype=torch.bool), logits=None, m_on=5.0, m_off=1e39)))
@example(call=(False, dict(pattern=torch.eye(4, dtype=torch.bool), logits=None, m_on=10 ** 38, m_off=5.0)))
def test_init_mask_keeps_its_promise(call):
    causal, kw = call
    model = _small(causal, learnable_mask=True)
    before = [p.bias.detach().clone() for p in mp.mask_priors(model)]
    if _kept(lambda: mp.init_mask_(model, **kw), lambda out: isinstance(out, dict)) is REFUSED:
        assert all(p.bias.equal(b) for p, b in zip(mp.mask_priors(model), before)), "a refusal changed M"
    else:
        _finite_model(model)


@FUZZ
@given(kw=arguments(pattern=patterns(4, 2), scale=level(1, 2000), noise=level(0, 10), factor_norm=level(0.1, 20),
                    pos_scale=(st.one_of(st.none(), st.floats(0.1, 30)), level()[1])))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), scale=1e39, noise=3.0, factor_norm=7.0, pos_scale=None))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), scale=1000.0, noise=3.0, factor_norm=1e20, pos_scale=1e20))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), scale=666.0, noise=7.0, factor_norm=16.0, pos_scale=9e-30))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), scale=1e6, noise=1e6, factor_norm=1e6, pos_scale=1e-6))
def test_init_qk_svd_keeps_its_promise(kw):
    model = _small()
    out = _kept(lambda: mp.init_qk_svd_(model, **kw, generator=torch.Generator().manual_seed(0)))
    if out is not REFUSED:
        assert all(0 <= m <= 1 + 1e-5 for m in out["pseudo_mass"]), out
        _finite_model(model)


@FUZZ
@given(kw=arguments(pattern=patterns(4, 2), steps=unbounded_count(1, 3), lr=level(1e-4, 1),
                    norm_every=unbounded_count(1, 3),
                    tol=level(0, 1), pos_scale=(st.one_of(st.none(), st.floats(0.1, 30)), level()[1])))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), steps=3, lr=1e38, norm_every=1, tol=0.0, pos_scale=None))
@example(kw=dict(pattern=torch.eye(4, dtype=torch.bool), steps=3, lr=1e-3, norm_every=0, tol=0.0, pos_scale=None))
def test_init_qk_opt_keeps_its_promise(kw):
    model = _small()
    out = _kept(lambda: mp.init_qk_opt_(model, **kw, generator=torch.Generator().manual_seed(0)))
    if out is not REFUSED:
        assert 1 <= out["steps"] <= kw["steps"] and all(0 <= m <= 1 + 1e-5 for m in out["pseudo_mass"]), out
        _finite_model(model)


@FUZZ
@given(kw=arguments(n_new=count(0, 3), temperature=level(0, 3), top_k=(st.one_of(st.none(), st.integers(1, 5)),
                                                                       count()[1]), cache=SWITCH))
@example(kw=dict(n_new=2, temperature=1e-45, top_k=None, cache=True))          # logits / T = inf: a RuntimeError
def test_generate_keeps_its_promise(kw):
    model = _small(True, n_outputs=3).eval()

    def valid(idx):
        _tensor((2, 2 + kw["n_new"]), torch.long)(idx)
        assert bool(((idx >= 0) & (idx < 3)).all())
    _kept(lambda: mp.generate(model, torch.zeros(2, 2, dtype=torch.long), **kw,
                              generator=torch.Generator().manual_seed(0)), valid)


# ---------------------------------------------------------------------------------------- the model configs

BASE = {mp.TransformerConfig: dict(vocab_size=3, seq_len=4, dim=8, n_heads=2, mlp_dim=8, n_layers=1),
        mp.ViTConfig: dict(image_size=8, patch_size=4, dim=8, n_heads=2, mlp_dim=8, n_layers=1)}
BOUNDED = {"n_heads", "seq_len", "mask_window"}               # a maximum is declared: huge sizes are drawn for these
WORDS = ["cls", "mean", "tokens", "learned", "none", "full", "relative"]


def field_values(f: dataclasses.Field):
    """Values of a config field by its type: good ones (small counts, fractions, levels, the words), or hostile."""
    kind = str(f.type)
    good, bad = (SWITCH if "bool" in kind else count(1, 9) if "int" in kind else level(0, 0.9) if "float" in kind
                 else (st.sampled_from(WORDS), st.sampled_from(JUNK)))
    if "int" in kind and f.name not in BOUNDED:
        bad = unbounded_count()[1]
    return st.one_of(good, good, bad)


@st.composite
def configs(draw):
    cls = draw(st.sampled_from(list(BASE)))
    changed = draw(st.lists(st.sampled_from(dataclasses.fields(cls)), min_size=1, max_size=3,
                            unique_by=lambda f: f.name))
    return cls, {**BASE[cls], **{f.name: draw(field_values(f)) for f in changed}}


def _runs(cfg):
    """A config taken builds a model (or refuses a relation its layers check, in one line) whose outputs on a small
    batch are finite, of the documented shape."""
    model = _kept(lambda: mp.build_model(cfg))
    if model is REFUSED:
        return
    model.eval()
    if isinstance(cfg, mp.ViTConfig):
        x, shape = torch.randn(2, cfg.in_chans, cfg.image_size, cfg.image_size), (2, cfg.n_classes)
    else:
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        shape = (2, cfg.seq_len, cfg.n_outputs) if cfg.readout == "tokens" else (2, cfg.n_outputs)
    with torch.no_grad():
        _kept(lambda: model(x), _tensor(shape))


T, V = mp.TransformerConfig, mp.ViTConfig


@FUZZ
@given(call=configs())
@example(call=(T, {**BASE[T], "dropout": float("nan")}))                      # issue 64.7: builds
@example(call=(T, {**BASE[T], "seq_len": True}))                               # issue 64.7: accepted
@example(call=(T, {**BASE[T], "dim": -8}))                                     # issue 64.7: a RuntimeError
@example(call=(T, {**BASE[T], "n_heads": 0}))                                  # issue 64.7: a ZeroDivisionError
@example(call=(V, {**BASE[V], "patch_size": 0}))                               # a ZeroDivisionError
@example(call=(T, {**BASE[T], "dim": 2, "n_heads": 4}))                        # heads of width 0
@example(call=(T, {**BASE[T], "drop_path": 1.0}))                              # 1 / (1 - p)
@example(call=(T, {**BASE[T], "tie_embeddings": True}))                        # vocab_size outputs, not n_outputs
def test_model_configs_keep_their_promise(call):
    cls, kw = call
    cfg = _kept(lambda: cls(**kw))
    if cfg is not REFUSED:
        _runs(cfg)
