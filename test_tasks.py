"""Tests for tasks.py (the registry; the Boolean, arithmetic, vision and language tasks; the data readers they
feed from and the token cache) and augment.py (the image augmentations ImageTask draws on).
Run: python -m pytest -q test_tasks.py
"""
import collections
import itertools
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import augment
import datafetch.write
import maskprior as mp
import runfiles
import tasks
import runconfig
import train
from conftest import (LM_SMALL, SMALL, STORIES, WIKI_TEST, WIKI_TRAIN, WIKI_VALID, _Touch, _imagenet_dir, _images,
                      _py2_dumps, _py2_pickle, _write_text_corpus, make_tinystories, make_wikitext, run_train, write)


# ---------------------------------------------------------------------------------------- tasks.py: base and registry

def test_registry_and_task_constants():
    assert set(tasks.TASKS) == {
        "parity2",
        "majority3",
        "cyclic3",
        "kparity",
        "kmajority",
        "ksum",
        "addition",
        "multiplication",
        "cifar10",
        "cifar100",
        "imagenet100",
        "wikitext2",
        "tinystories",
    }
    for name, cls in tasks.TASKS.items():
        assert cls.NAME == name and cls.KIND in ("boolean", "arithmetic", "vision", "lm")
        assert cls.DEFAULT_PATTERN in cls.PATTERNS and cls.HEADLINE and set(cls.inits()) <= set(runconfig.INITS)
        assert {"small", "paper"} <= set(cls.presets()) <= {"small", "paper", "paper32"}
    with pytest.raises(tasks.TaskError, match="unknown task"):
        tasks.make_task("nosuch")
    with pytest.raises(tasks.TaskError, match="takes no option data_frac"):
        tasks.make_task("parity2", data_frac=0.1)
    with pytest.raises(ValueError, match="registered twice"):
        tasks.register("parity2")(type("Again", (tasks.Task,), {}))


# ---------------------------------------------------------------------------------------- tasks.py: boolean

@pytest.mark.parametrize("name,size,frac_unseen", [("parity2", 24576, 0.25), ("majority3", 32768, 0.25),
                                                    ("cyclic3", 28672, 0.125)])
def test_gotu_splits(name, size, frac_unseen):
    task = tasks.make_task(name).setup()
    assert task.n_train == size and len(task.x_test) == 2 ** 15
    assert float(task.unseen_mask.float().mean()) == frac_unseen
    x = task.x_train * 2 - 1
    assert not task.in_unseen(x.numpy()).any()
    if name != "majority3":     # every seen point exactly once
        assert len(torch.unique(task.x_train, dim=0)) == size
    xb, yb = task.train_batch(0, 256)
    assert xb.shape == (256, 15) and yb.shape == (256,)


def test_gotu_targets():
    task = tasks.make_task("cyclic3").setup()
    x = task.x_test * 2 - 1
    y = sum(x[:, i] * x[:, (i + 1) % 15] * x[:, (i + 2) % 15] for i in range(15)).float()
    assert torch.equal(task.y_test, y)
    maj = tasks.make_task("majority3").setup()
    assert set(maj.y_test.unique().tolist()) == {-1.0, 1.0}


def test_epoch_batches_cover_train_set_once():
    task = tasks.make_task("parity2", seed=3).setup()
    spe = task.steps_per_epoch(1000)
    seen = torch.cat([task.train_batch(s, 1000)[0] for s in range(spe)])
    assert len(seen) == task.n_train and len(torch.unique(seen, dim=0)) == task.n_train
    assert not torch.equal(task.train_batch(0, 64)[0], task.train_batch(spe, 64)[0])   # reshuffled


@pytest.mark.slow
@pytest.mark.parametrize("name,acc,extra", [("parity2", 0.75, {}), ("majority3", 0.875, {}),
                                            ("cyclic3", 0.875, {"sign_acc": 0.928253173828125})])
def test_mdi_accuracies(interpolator_once, name, acc, extra):
    mdi = tasks.make_task(name).mdi()
    assert mdi["acc"] == acc and mdi["acc_seen"] == 1.0 and mdi["mse_seen"] == pytest.approx(0, abs=1e-9)
    for k, v in extra.items():
        assert mdi[k] == pytest.approx(v)
    if name == "parity2":
        assert mdi["coefficients"] == pytest.approx({"1": -1.0, "x0": 1.0, "x1": 1.0})


def test_mdi_prefers_low_degree():
    # on data that a degree-1 function fits, the MDI is that function, not the degree-2 truth
    x = tasks.cube(3)
    seen = ~((x[:, 0] == -1) & (x[:, 1] == -1))
    pred, degree, coefs = tasks.min_degree_interpolator(x[seen], (x[seen, 0] * x[seen, 1]).astype(float), x)
    assert degree == 1 and coefs == pytest.approx({(): -1.0, (0,): 1.0, (1,): 1.0})


def test_mdi_needs_no_setup():
    task = tasks.make_task("parity2")
    assert task.mdi()["acc"] == pytest.approx(0.75)
    assert not hasattr(task, "x_train")               # computing the MDI did not set the task up


def test_custom_boolean_tasks():
    task = tasks.make_task("kparity", bits="2,5,9", unseen="2,5").setup()
    assert task.n_train == 3 * 2 ** 13 and task.mdi()["acc"] == 0.75
    p = task.pattern()
    assert p[0, 3] and p[3, 6] and p[6, 10] and not p[1, 2]
    maj = tasks.make_task("kmajority", bits="0,1,2,3,4", unseen="0,1", train_size=1000).setup()
    assert maj.n_train == 1000
    with pytest.raises(tasks.TaskError):
        tasks.make_task("kmajority", bits="0,1")
    with pytest.raises(tasks.TaskError):
        tasks.make_task("kparity", bits="0,99")


def test_patterns_of_the_gotu_tasks():
    p = tasks.make_task("parity2").pattern()
    assert p.shape == (16, 16) and p[0, 1] and p[0, 2] and p[1, 2] and p[2, 1] and not p[0, 3]
    assert p.diagonal().all() and not p[1, 3]
    c = tasks.make_task("cyclic3").pattern()
    assert c[0].all() and c[1, 15] and c[1, 14] and c[1, 3] and not c[1, 4]   # bit 0 ~ bits 13, 14, 1, 2


@pytest.mark.parametrize("task, options", [("parity2", {}), ("majority3", {}), ("cyclic3", {}),
                                           ("parity2", {"readout": "mean"}), ("majority3", {"readout": "mean"}),
                                           ("kparity", {"bits": "random:3", "unseen": "bits:2", "seed": 4}),
                                           ("kmajority", {"bits": "random:3", "unseen": "bits:2", "seed": 9})])
def test_walsh_sets_of_the_training_data_find_the_hand_pattern(task, options):
    """--pattern discovered from the training set alone (its Walsh coefficients up to degree 3, the sets above a
    quarter of the largest, each a clique, CLS -> their bits) is exactly the hand pattern, in either layout and
    for bits drawn by the seed; the target function is never read (it is replaced by a stand-in here)."""
    t = tasks.make_task(task, **options).setup()
    oracle = t.pattern()
    t.target = lambda x: pytest.fail("the discovery read the target function")
    assert torch.equal(t.pattern("discovered"), oracle)
    assert t.pattern_name("discovered") == "discovered"
    if task == "parity2" and not options:
        assert t.discovered_sets()[0] == (0, 1)
        coefs = tasks.walsh_coefficients(2 * t.x_train.numpy() - 1, t.y_train.numpy())
        assert coefs[(0, 1)] == pytest.approx(0.889, abs=1e-3) and max(abs(v) for s, v in coefs.items()
                                                                        if not set(s) <= {0, 1}) < 1e-9
    if task == "kparity":
        assert t.name == "kparity[11,13,14|U:11,13]"


def test_the_walsh_cut_stands_above_sampling_noise_so_a_small_training_set_gives_fewer_sets_or_none():
    """--pattern discovered keeps a Walsh set only above the noise level of the training set's size (z std(y) /
    sqrt(P), Bonferroni over the sets tested): on targets independent of the bits at most about alpha of the draws
    let any set through; kmajority on 5 bits keeps only sets of its own bits at every size (precision 1), more of
    them as the size grows (sizes 100, 250, 500: 4, 7, 9 sets), the hand pattern with every seen point; too few
    points for any set is one line."""
    rng = np.random.default_rng(0)
    passed = sum(bool(tasks.walsh_sets(rng.choice([-1, 1], (150, 15)), rng.choice([-1.0, 1.0], 150), 3, 1e-9, 0.05)[0])
                 for _ in range(60))
    assert passed <= 8                                            # 60 draws at alpha 0.05: 3 expected
    kept, noise = [], []
    for size in (100, 250, 500, 2000, None):
        t = tasks.make_task("kmajority", bits="1,4,8,10,13", unseen="1,4", train_size=size).setup()
        sets, report = t.discovered_sets(), t.discovery()["walsh"]
        assert all(set(s) <= {1, 4, 8, 10, 13} for s in sets) and report["sets_kept"] == len(sets)
        kept.append(len(sets))
        noise.append(report["noise_level"])
    assert kept[:3] == sorted(kept[:3]) and kept[0] < kept[-1] and noise == sorted(noise, reverse=True)
    assert torch.equal(t.pattern("discovered"), t.pattern())
    with pytest.raises(tasks.TaskError,
                       match="no Walsh set of up to 3 bits stands above the sampling noise of the 12 "):
        tasks.make_task("kmajority", bits="1,4,8,10,13", unseen="1,4", train_size=12).setup().pattern("discovered")


@pytest.mark.slow
def test_the_forward_selection_keeps_no_pair_of_digits_that_tells_nothing():
    """Digit pairs independent of the answer digit pass the permutation test at most about alpha of the time."""
    rng = np.random.default_rng(1)
    kept = 0
    for trial in range(30):
        pairs = {(i, j): rng.integers(0, 100, 400) for i in range(3) for j in range(3)}
        kept += tasks.forward_selection(rng.integers(0, 10, 400), pairs, 0.05, rng)[0][-1]
    assert kept <= 5                                              # 30 draws at alpha 0.05: 1.5 expected


def test_ksum_states_a_target_that_mixes_structures_on_the_command_line():
    """--task ksum --terms 0,1:m2,3,4 is x0 x1 + maj(x2, x3, x4): integer-valued, each term a clique of the hand
    pattern (CLS reading every bit of them), its exact MDI solved; the data route finds the same pattern."""
    t = tasks.make_task("ksum", terms="0,1:m2,3,4").setup()
    x = 2 * t.x_test[:64].numpy() - 1
    assert np.array_equal(t.y_test[:64].numpy(), x[:, 0] * x[:, 1] + np.sign(x[:, 2] + x[:, 3] + x[:, 4]))
    assert t.exact and t.degree == 3 and t.name == "ksum[0,1:m2,3,4|U:0,1]"
    p = t.pattern()
    assert p[1, 2] and p[3, 5] and not p[1, 3] and p[0, 1:6].all() and not p[0, 6:].any()
    assert torch.equal(t.pattern("discovered"), p)
    mdi = t.mdi()
    assert mdi["acc_unseen"] == 0.0 and mdi["acc"] == 0.75            # the MDI misses all of U
    assert tasks.parse_terms("3:m0,1,2", 15) == [("parity", (3,)), ("majority", (0, 1, 2))]


def _bit_pattern(name: str) -> torch.Tensor:
    """What each task's default pattern allows among the 15 bit tokens (bit i -> bit j)."""
    if name == "cyclic3":
        d = (torch.arange(15)[:, None] - torch.arange(15)[None, :]).abs()
        return torch.minimum(d, 15 - d) <= 2
    bits = {"parity2": [0, 1], "majority3": [0, 1, 2]}[name]
    p = torch.eye(15, dtype=torch.bool)
    for i in bits:
        for j in bits:
            p[i, j] = True
    return p


@pytest.mark.parametrize("readout", ["cls", "mean"])
@pytest.mark.parametrize("name", ["parity2", "majority3", "cyclic3"])
def test_mask_follows_the_token_layout(name, readout):
    """The pattern is built for the model's own layout (a CLS token first or none), and M after
    init_mask_ equals it at the bit positions: x0 <-> x1 for parity2 and nothing else among the bits."""
    task = tasks.make_task(name, readout=readout)
    cfg = mp.TransformerConfig(**task.arch(), n_layers=2, n_heads=2, dim=16, mlp_dim=16, learnable_mask=True)
    model = mp.Transformer(cfg)
    pat = task.pattern()
    off = 1 if readout == "cls" else 0
    assert pat.shape == (15 + off, 15 + off) == (cfg.n_positions, cfg.n_positions)
    mp.init_mask_(model, pat)
    for block in model.blocks:
        for h in range(2):
            assert torch.equal(block.attn.prior.bias[h, off:, off:] > 0, _bit_pattern(name))
    if off:   # the CLS row reads the target's bits (cyclic3: every bit); every bit row ignores the CLS
        m = model.blocks[0].attn.prior.bias[0]
        assert (m[0, 1:] > 0).sum() == {"parity2": 2, "majority3": 3, "cyclic3": 15}[name] and (m[1:, 0] < 0).all()
    task.setup()      # the probe sees the same pattern the model was given
    assert len(mp.prior_mass(model, task.probe_inputs(8), pat)) == 2


@pytest.mark.parametrize("readout", ["mean", "cls"])
def test_parity2_mask_ties_the_unseen_corner_to_seen_points(readout):
    """The mechanism behind parity2 (README): with no CLS token, position-blind tokens (positional
    embedding 0) and the x0 <-> x1 mask made hard, x0 and x1 at (-1, -1) carry exactly the state of any
    other bit at -1 (each sees only copies of itself), so for ANY weights the output at x0 = x1 depends
    only on how many bits are -1: the unseen corner is tied to seen points with x0 = x1 = +1. A CLS
    token reads x0, x1 through a state nothing ties down, and the outputs differ."""
    task = tasks.make_task("parity2", readout=readout)
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(**task.arch(), n_layers=2, n_heads=2, dim=16, mlp_dim=32, learnable_mask=True,
                               pos_init_std=0.0)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, task.pattern(), m_on=30.0, m_off=30.0)
    g = torch.Generator().manual_seed(1)
    rest = torch.randint(0, 2, (64, 13), generator=g)
    rest[:, :2] = 1                                         # two more +1 bits to turn into -1
    unseen = torch.cat([torch.zeros(64, 2, dtype=torch.long), rest], 1)     # token 0 = -1, token 1 = +1
    seen = torch.cat([torch.ones(64, 2, dtype=torch.long), rest.clone()], 1)
    seen[:, 2:4] = 0                                        # the same number of -1 bits, x0 = x1 = +1
    with torch.no_grad():
        gap = (model(unseen) - model(seen)).abs().max()
    if readout == "mean":
        assert gap < 1e-5
    else:
        assert gap > 1e-2


def test_mean_readout_run_trains_the_right_pattern(tmp_path):
    """The regression of --readout mean: the saved M is parity2's pattern over the 15 bit tokens."""
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "mask", "--readout", "mean", "--steps", "2", *SMALL)
    assert rc == 0
    m = train.read_checkpoint(str(os.path.join(out, "ckpt.pt")), "test")["model"]["blocks.0.attn.prior.bias"]
    assert m.shape == (2, 15, 15) and torch.equal(m[0] > 0, _bit_pattern("parity2"))
    assert json.load(open(os.path.join(out, "result.json")))["config"]["readout"] == "mean"


def test_cli_pattern_that_does_not_fit_the_model_exits_2(tmp_path, capsys, monkeypatch):
    """A task whose pattern is built for another layout than the model's: one line, exit 2, nothing written."""
    monkeypatch.setattr(tasks.BooleanTask, "pattern", lambda self, variant=None: torch.eye(16, dtype=torch.bool))
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "mask", "--readout", "mean", *SMALL)
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "(16, 16)" in err and "15 positions" in err
    assert not os.path.exists(out)


def test_pattern_of_the_other_layout_is_refused():
    with pytest.raises(tasks.TaskError, match="needs --readout cls"):
        tasks.make_task("parity2", readout="mean").pattern("cls")
    with pytest.raises(tasks.TaskError, match="needs --readout cls"):
        tasks.make_task("cyclic3", readout="mean").pattern("band-only")
    with pytest.raises(tasks.TaskError, match="--readout for majority3 must be one of cls, mean"):
        tasks.make_task("majority3", readout="tokens")


def test_eval_points_sample_the_cube_in_proportion():
    task = tasks.make_task("parity2").setup()
    idx = task.eval_points(4096)
    assert len(idx) == len(set(idx.tolist())) == 4096 and torch.equal(idx, task.eval_points(4096))
    assert int(task.unseen_mask[idx].sum()) == 1024                      # U is a quarter of the cube
    torch.manual_seed(0)
    model = mp.Transformer(mp.TransformerConfig(**task.arch(), n_layers=1, n_heads=2, dim=16, mlp_dim=16))
    full, part = task.evaluate(model), task.evaluate(model, points=4096)
    assert full["eval_points"] == 0 and part["eval_points"] == 4096
    pred = task.predict(model)
    assert part["mse_unseen"] == pytest.approx(float(((pred - task.y_test)[idx][task.unseen_mask[idx]] ** 2).mean()))
    assert full["mse"] == pytest.approx(float(((pred - task.y_test) ** 2).mean()))


@pytest.mark.parametrize("text, words", [
    ("0,1_0", "'1_0' is not an integer in 0..14"), ("\u0660,\u0661", "is not an integer in 0..14"),
    ("\uff10,\uff11", "is not an integer in 0..14"), ("-1,2", "'-1' is not"), ("0,15", "'15' is not"),
    ("9" * 5000, "... (5,000 characters) is not"), ("0,0", "distinct bits"), ("", "distinct bits"),
])
def test_every_index_list_goes_through_one_parser(text, words):
    """--bits, --unseen and --terms take ASCII digits in range alone, through `tasks.parse_count`; the token that is
    not is named, cut to 40 characters; a term repeated as another kind (x1 as a parity and a majority) is caught."""
    for parse in (lambda s: tasks._parse_bits(s, "bits", 15), lambda s: tasks.parse_terms(s, 15)):
        with pytest.raises(tasks.TaskError, match=re.escape(words)) as err:
            parse(text)
        assert len(str(err.value)) < 200
    assert tasks._parse_bits(" 0, 1 ", "bits", 15) == (0, 1) and tasks._count("random:3", "random:", "bits", 15) == 3
    with pytest.raises(tasks.TaskError, match="given twice"):
        tasks.parse_terms("1:m1", 15)


@pytest.mark.parametrize("task, options, stored", [
    ("ksum", [{"terms": t} for t in ("0,1:2,3,4", " 0,1:2,3,4", "0,1:2,3,4,", "2,3,4:0,1", "4,3,2:1,0")],
     {"terms": "0,1:2,3,4", "unseen": "0,1"}),
    ("ksum", [{"terms": "m4,2,3:1,0"}, {"terms": "0,1:m2,3,4", "unseen": "1,0"}],
     {"terms": "0,1:m2,3,4", "unseen": "0,1"}),
    ("ksum", [{"terms": "1:m2"}, {"terms": "m2:1"}], {"terms": "1:2", "unseen": "0,1"}),
    ("ksum", [{"terms": "2,3:0,1", "unseen": "bits:2"}, {"terms": "0,1:2,3", "unseen": "3,2"}],
     {"terms": "0,1:2,3", "unseen": "2,3"}),
    ("kparity", [{"bits": "7,4,0", "unseen": "bits:2"}, {"bits": "0,4,7", "unseen": "7,4"}],
     {"bits": "0,4,7", "unseen": "4,7"}),
    ("kparity", [{"bits": "random:3", "unseen": "bits:2"}], {"bits": "random:3", "unseen": "bits:2"}),
])
def test_one_target_is_one_spelling(task, options, stored):
    """Every spelling of a target (terms in any order, bits in any order, spaces, a trailing comma, 'bits:J' for the
    bits it names) is stored in one (`Task.normal_options`), so one target is one configuration and one report
    row; drawn bits keep 'random:K' and 'bits:J' (the seed names them)."""
    for given in options:
        assert tasks.make_task(task, **given).normal_options() == stored, given


# ---------------------------------------------------------------------------------------- tasks.py: arithmetic

@pytest.mark.parametrize("name,order", [("addition", "msb"), ("addition", "lsb"), ("multiplication", "msb"),
                                        ("multiplication", "lsb")])
def test_arithmetic_tokenisation_round_trip(name, order):
    task = tasks.make_task(name, data_frac=0.001, answer_order=order)
    rng = np.random.default_rng(0)
    a, b = rng.integers(0, 1000, 500), rng.integers(0, 1000, 500)
    a[:3], b[:3] = [0, 999, 7], [0, 999, 40]
    seq = task.encode(a, b)
    assert seq.shape == (500, task.length) and seq.max() < len(tasks.ARITH_VOCAB)
    for s, x, y in zip(seq, a, b):
        assert task.decode(s) == (x, y, x * y if name == "multiplication" else x + y)
    text = "".join(tasks.ARITH_VOCAB[i] for i in seq[1])
    msb = "999+999=1998" if name == "addition" else "999*999=998001"
    lsb = "999+999=8991" if name == "addition" else "999*999=100899"      # the answer digits reversed
    assert text == (msb if order == "msb" else lsb)


@pytest.mark.parametrize("name,frac,n", [("addition", None, 4000), ("multiplication", None, 30000),
                                         ("addition", 0.0123, 12300)])
def test_arithmetic_split_sizes_and_disjoint(name, frac, n):
    task = tasks.make_task(name, data_frac=frac, seed=3).setup()
    assert len(task.train_seq) == n and len(task.test_seq) == 10_000
    pairs = lambda s: {(int(r[:3].dot([100, 10, 1])), int(r[4:7].dot([100, 10, 1]))) for r in s.numpy()}  # noqa
    train_pairs, test_pairs = pairs(task.train_seq), pairs(task.test_seq)
    assert len(train_pairs) == n and len(test_pairs) == 10_000 and not train_pairs & test_pairs
    assert task.train_batch(0, 64).shape == (64, task.length)


@pytest.mark.parametrize("frac,n_train,n_test", [(0.03, 300, 9_700), (0.3, 3_000, 7_000), (0.9, 9_000, 1_000)])
def test_two_digit_multiplication_tests_on_every_pair_it_does_not_train_on(frac, n_train, n_test):
    """--digits 2: 10^4 pairs; the test set is every pair not trained on (the universe allows no 10,000)."""
    task = tasks.make_task("multiplication", digits=2, data_frac=frac, answer_order="lsb", seed=1).setup()
    assert task.length == 10 and task.n_answer == 4 and task.universe == 10_000
    rows = lambda s: {tuple(r) for r in s.numpy().tolist()}                                    # noqa: E731
    train, test = rows(task.train_seq), rows(task.test_seq)
    assert len(train) == n_train and len(test) == n_test and not train & test
    assert len({task.decode(r)[:2] for r in train | test}) == n_train + n_test
    assert all(x * y == c for x, y, c in map(task.decode, task.test_seq[:200]))
    assert (
        "".join(tasks.ARITH_VOCAB[i] for i in task.encode(np.array([99]), np.array([7]))[0]) == "99*07=3960"
    )  # 693 reversed
    p = task.pattern()
    assert p.shape == (9, 9) and torch.nonzero(p[8]).flatten().tolist() == [0, 1, 3, 4, 8]   # c3 (lsb: last): all
    assert torch.nonzero(p[5]).flatten().tolist() == [1, 4, 5]                               # '=' predicts c0: a0, b0
    with pytest.raises(tasks.TaskError,
                       match="leaves 500 of the 10,000 pairs for the disjoint test set; use at most 0.9"):
        tasks.make_task("multiplication", digits=2, data_frac=0.95)
    with pytest.raises(tasks.TaskError, match="--digits must be an integer in 1..4"):
        tasks.make_task("multiplication", digits=5)
    assert len(tasks.make_task("addition", digits=3).setup().test_seq) == 10_000                # 3 digits: as before


@pytest.mark.slow
def test_digit_selection_sees_the_aligned_pair_then_the_carry_from_the_pair_below():
    """Addition's answer digit c_k depends on a_k and b_k together (either alone says nothing, so digit pairs are
    the candidates) and, once they are known, on the pair below (the carry): the forward selection by conditional
    mutual information keeps both for c1, c2 and the carry-out c3, and stops at the pair two columns down (a
    carry through a middle column that sums to 9, one case in ten, is within the noise of 4,000 pairs). The rows
    see what was kept; the prompt rows stay causal; result.json's report lists each step."""
    t = tasks.make_task("addition").setup()
    kept = {k: [(i, j) for i, j, _, _, ok in steps if ok] for k, steps in t.digit_selection().items()}
    assert kept == {0: [(0, 0)], 1: [(1, 1), (0, 0)], 2: [(2, 2), (1, 1)], 3: [(2, 2), (1, 1)]}
    p, rows = t.pattern("discovered"), t.answer_rows()             # msb first: rows of c3, c2, c1, c0
    assert [p[q].nonzero().flatten().tolist() for q in rows] == [[0, 1, 4, 5, 7], [0, 1, 4, 5, 8], [1, 2, 5, 6, 9],
                                                                 [2, 6, 10]]
    assert torch.equal(p[:t.eq_pos], mp.causal_pattern(t.length - 1)[:t.eq_pos])
    report = t.discovery()["pairs"]
    assert report["tested"] == 9 and report["kept"] == 7 and report["steps"]["c2"][-1][0] == "a0b0"
    assert runfiles.prior_evidence(t.prior("discovered", 5.0, 5.0).source) == "found in the training data: 7 (answer " \
        "digit, operand digit pair) dependences pass the permutation test (9 pairs tried per answer digit, alpha " \
        "0.05): 14 pairs"
    assert runfiles.prior_evidence(t.prior(None, 5.0, 5.0).source) is None  # a hand pattern rests on no data
    x, y = np.arange(1000) % 10, np.arange(1000) % 7
    assert tasks.conditional_mi(y, x, np.zeros(1000, dtype=np.int64)) < 0.05 < tasks.conditional_mi(x, x, 0 * x)
    assert tasks.conditional_mi(x, x, x) == pytest.approx(0.0, abs=1e-12)          # nothing left once x is known


def test_partial_product_pattern_gives_each_head_one_product():
    """--pattern partial (multiplication): head i sees a_i and b_(k-i) for the answer digit of significance k,
    head d the answer written so far, the rest the carry pattern; 2 digits, answers reversed: a1 a0 * b1 b0 = c0.."""
    task = tasks.make_task("multiplication", digits=2, data_frac=0.3, answer_order="lsb", heads=4)
    p = task.pattern("partial")
    rows = lambda h, q: torch.nonzero(p[h, q]).flatten().tolist()                          # noqa: E731
    assert p.shape == (4, 9, 9) and all(p[h, :5].equal(mp.causal_pattern(9)[:5]) for h in range(4))
    assert rows(0, 5) == [1, 4, 5] and rows(1, 5) == [5]               # '=' predicts c0 = a0 b0: head 0 only
    assert rows(0, 6) == [1, 3, 6] and rows(1, 6) == [0, 4, 6]         # c1: a0 b1 in head 0, a1 b0 in head 1
    assert rows(0, 7) == [7] and rows(1, 7) == [0, 3, 7]               # c2: a1 b1 in head 1
    assert rows(2, 8) == [6, 7, 8] and rows(2, 5) == [5]               # head 2: the answer digits so far
    assert p[3].equal(task.pattern("carry"))                           # a fourth head: the carry pattern
    logits = task.mask_logits("partial", 5.0, 10.0)
    assert logits.shape == (4, 9, 9) and logits[1, 6, 0] == 5 and logits[1, 6, 1] == -10
    msb = tasks.make_task("multiplication", digits=2, data_frac=0.3, heads=4).pattern("partial")
    assert torch.nonzero(msb[1, 5]).flatten().tolist() == [5]         # msb: '=' predicts c3, a carry alone
    assert torch.nonzero(msb[1, 6]).flatten().tolist() == [0, 3, 6]   # c2: a1 b1 in head 1
    with pytest.raises(tasks.TaskError, match="needs --heads >= 4, got 3"):
        tasks.make_task("multiplication", digits=3, heads=3).pattern("partial")
    with pytest.raises(tasks.TaskError, match="has no pattern 'partial'"):
        tasks.make_task("addition").pattern("partial")


def test_columns_pattern_gives_each_head_one_column():
    """--pattern columns (multiplication): for answer digit c_k, head 0 sees the pairs of column k (i + j = k), head
    1 column k - 1, head 2 column k - 2, head 3 the answer so far, further heads the carry pattern; 2 digits,
    answers reversed: a1 a0 * b1 b0 = c0.. (positions 0 1 * 3 4 = 5, answers 6..)."""
    task = tasks.make_task("multiplication", digits=2, data_frac=0.3, answer_order="lsb", heads=5)
    p = task.pattern("columns")
    rows = lambda h, q: torch.nonzero(p[h, q]).flatten().tolist()                          # noqa: E731
    assert p.shape == (5, 9, 9) and all(p[h, :5].equal(mp.causal_pattern(9)[:5]) for h in range(5))
    assert rows(0, 5) == [1, 4, 5] and rows(1, 5) == [5] and rows(2, 5) == [5]     # c0 = a0 b0: column 0 only
    assert rows(0, 6) == [0, 1, 3, 4, 6] and rows(1, 6) == [1, 4, 6]               # c1: column 1, column 0 below
    assert rows(0, 7) == [0, 3, 7] and rows(2, 7) == [1, 4, 7]                     # c2: a1 b1; column 0 two below
    assert rows(3, 8) == [6, 7, 8] and rows(3, 5) == [5]                           # head 3: the answer so far
    assert p[4].equal(task.pattern("carry"))
    assert task.mask_logits("columns", 5.0, 10.0).shape == (5, 9, 9)
    with pytest.raises(tasks.TaskError, match="needs --heads >= 4, got 3"):
        tasks.make_task("multiplication", heads=3).pattern("columns")


def test_arithmetic_pattern_for_known_positions():
    add = tasks.make_task("addition")
    p = add.pattern()
    assert p.shape == (11, 11)
    # row 8 holds c3 and predicts c2 (significance 2): a2 a1 a0 b2 b1 b0 allowed, '+' and '=' not
    assert p[8].tolist() == [True, True, True, False, True, True, True, False, True, False, False]
    # row 10 predicts c0: only a0 (2), b0 (6) and itself
    assert torch.nonzero(p[10]).flatten().tolist() == [2, 6, 10]
    assert p[:7].equal(mp.causal_pattern(11)[:7])          # prompt rows keep the plain causal pattern
    logits = add.mask_logits(None, 5.0, 5.0)
    assert logits[8, 0] == 5 and logits[8, 1] == 5 and logits[8, 2] == 0 and logits[8, 3] == -5
    aligned = add.pattern("aligned")
    assert torch.nonzero(aligned[10]).flatten().tolist() == [2, 6, 10]
    mul = tasks.make_task("multiplication")
    m = mul.pattern()
    assert m.shape == (13, 13) and torch.nonzero(m[12]).flatten().tolist() == [2, 6, 12]   # c0: a0, b0
    assert m[9, :7].tolist() == [True, True, True, False, True, True, True]                # c3: all digits
    assert not (m & ~mp.causal_pattern(13)).any()           # the prior never reaches into the future
    lsb = tasks.make_task("addition", answer_order="lsb").pattern()
    assert torch.nonzero(lsb[7]).flatten().tolist() == [2, 6, 7]      # '=' predicts c0 first


def test_an_arithmetic_operation_is_one_subclass(monkeypatch):
    """Adding an operation touches one place: a subclass with its symbol, its answer, the answer's length and which
    operand digits its carry pattern holds strong; a symbol new to the vocabulary goes at the end of its own, so the
    registered operations keep their token ids (and their checkpoints)."""
    class Maximum(tasks.ArithmeticTask):
        SYMBOL = "^"
        answer, answer_digits = staticmethod(np.maximum), staticmethod(lambda d: d)
        strong = staticmethod(lambda j, k: j == k)

    monkeypatch.setitem(tasks.TASKS, "maximum", Maximum)
    task = Maximum(data_frac=0.01).setup()
    assert task.vocab == "0123456789+*=^" and task.arch()["vocab_size"] == 14
    assert task.encode(np.array([123]), np.array([405])).tolist() == [[1, 2, 3, 13, 4, 0, 5, 12, 4, 0, 5]]
    assert task.decode(task.encode(np.array([7]), np.array([30]))[0]) == (7, 30, 30)
    logits = task.mask_logits("carry", 5.0, 5.0)            # row 8 predicts c1: a1, b1 strong; a0, b0 allowed
    assert logits[8, [1, 5]].tolist() == [5.0, 5.0] and logits[8, [2, 6]].tolist() == [0.0, 0.0]
    assert [tasks.make_task(n).vocab for n in ("addition", "multiplication")] == ["0123456789+*="] * 2
    model = mp.Transformer(mp.TransformerConfig(**task.arch(), n_layers=1, dim=16, n_heads=2, mlp_dim=16))
    assert model(task.train_seq[:4, :-1]).shape == (4, 10, 14)

@pytest.mark.slow
def test_arithmetic_short_run_improves_digit_accuracy(tmp_path):
    rc, out = run_train(tmp_path, "--task", "addition", "--init", "mask", "--steps", "250", "--log-every", "250",
                        "--layers", "2", "--dim", "64", "--heads", "4", "--mlp-dim", "128", "--probe-size", "64")
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    first, last = lines[0]["metrics"], lines[-1]["metrics"]
    assert last["digit_acc"] > first["digit_acc"] + 0.15 and 0 <= last["seq_acc"] <= 1
    res = json.load(open(os.path.join(out, "result.json")))
    assert {"seq_acc", "digit_acc", "prior_mass_start", "prior_mass_end"} <= set(res["metrics"])
    assert first["eval_points"] == 2000 and last["eval_points"] == res["metrics"]["eval_points"] == 0


def test_arithmetic_eval_points_are_the_first_test_pairs():
    task = tasks.make_task("addition").setup()
    torch.manual_seed(0)
    model = mp.Transformer(mp.TransformerConfig(**task.arch(), n_layers=1, n_heads=2, dim=16, mlp_dim=16))
    part, full = task.evaluate(model, points=100), task.evaluate(model)
    assert part["eval_points"] == 100 and full["eval_points"] == 0
    preds = task.generate(model, task.test_seq[:100, :task.eq_pos + 1])
    assert part["digit_acc"] == pytest.approx(float((preds == task.test_seq[:100, task.eq_pos + 1:]).float().mean()))


@pytest.mark.parametrize("frac,needle", [("0", "must be in (0, 1]"), ("1.5", "must be in (0, 1]"),
                                         ("-0.1", "must be in (0, 1]"), ("1e-7", "gives no training pair"),
                                         ("1", "disjoint test set")])
def test_arithmetic_bad_data_frac(tmp_path, capsys, frac, needle):
    rc, out = run_train(tmp_path, "--task", "addition", "--data-frac", frac)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(out)


def _lee_pair(text: str) -> tuple:
    a, b = re.match(r"\$?(\d+)\*(\d+)=", text).groups()
    return int(a), int(b)


@pytest.mark.slow
def test_lee_samples_are_lee_et_al_s_construction():
    """--lee-samples N (--digits 2): the 100 one-digit pairs, then N - 100 drawn with replacement from
    0..99 x 0..99 by the seed; unpadded a*b=c (lsb: $a*b=rev(c)$); tested on every pair not trained on."""
    every = set(itertools.product(range(100), repeat=2))
    made = {}
    for order in ("msb", "lsb"):
        task = tasks.make_task("multiplication", digits=2, lee_samples=3000, answer_order=order, seed=5).setup()
        train_text = [task.lee_decode(r) for r in task.train_seq]
        test_text = [task.lee_decode(r) for r in task.test_seq]
        tr, te = [_lee_pair(x) for x in train_text], [_lee_pair(x) for x in test_text]
        assert len(tr) == task.n_train == 3000 and set(itertools.product(range(10), repeat=2)) <= set(tr)
        assert collections.Counter(tr) == collections.Counter(map(tuple, tasks.lee_pairs(3000, 5).tolist()))
        assert tasks.lee_pairs(3000, 5)[:100].tolist() == [[a, b] for a in range(10) for b in range(10)]
        assert len(set(tr)) == task.n_pairs_trained < 3000 and len(te) == len(set(te)) == task.test_size
        assert not set(tr) & set(te) and set(tr) | set(te) == every              # every pair not trained on
        assert all(x == tasks.lee_text(a, b, order) for x, (a, b) in zip(train_text + test_text, tr + te))
        assert (
            task.train_seq.shape == (3000, tasks.LEE_ROW[order]) and task.arch()["seq_len"] == tasks.LEE_ROW[order] - 1
        )
        made[order] = tr
    assert made["msb"] == made["lsb"]                                      # one draw for both formats
    assert tasks.lee_text(7, 12, "msb") == "7*12=84\n" and tasks.lee_text(7, 12, "lsb") == "$7*12=48$"
    assert tasks.lee_text(0, 0, "msb") == "0*0=0\n" and tasks.lee_text(99, 99, "lsb") == "$99*99=1089$"
    again, other, twin = (
        tasks.make_task("multiplication", digits=2, lee_samples=3000, seed=s).setup() for s in (5, 6, 5)
    )
    assert torch.equal(again.train_seq, twin.train_seq) and not torch.equal(again.train_seq, other.train_seq)
    small = tasks.make_task("multiplication", digits=2, lee_samples=100).setup()      # the one-digit pairs alone
    assert small.n_pairs_trained == 100 and small.test_size == 9_900
    row = again.lee_encode(np.array([[7, 3]]))[0]
    assert again.lee_decode(row) == "7*3=21\n" and "".join(tasks.LEE_VOCAB[i] for i in row) == "7*3=21\n____"


def _lee_expected(text: str, order: str) -> torch.Tensor:
    """The pattern of one example, written from its text: prompt rows see every earlier character; the row
    that predicts answer character t sees '=', the answer so far and the operand digits of significance <=
    k (lsb: k = t; msb: k = len(a) + len(b) - 1 - t); past the last digit of the longest answer, every digit."""
    a, b = text.lstrip("$").split("=")[0].split("*")
    pre, n = int(text[0] == "$"), len(text) - 1
    eq = text.index("=")
    sig = {pre + i: len(a) - 1 - i for i in range(len(a))}
    sig.update({pre + len(a) + 1 + j: len(b) - 1 - j for j in range(len(b))})
    full = 4 if order == "lsb" else len(a) + len(b)
    pat = mp.causal_pattern(n).clone()
    for r in range(eq, n):
        t = r - eq
        k = 9 if t >= full else (t if order == "lsb" else len(a) + len(b) - 1 - t)
        pat[r] = False
        pat[r, eq:r + 1] = True
        for pos, s in sig.items():
            pat[r, pos] = s <= k
    return pat


@pytest.mark.parametrize("order", ["msb", "lsb"])
def test_lee_pattern_aligns_digits_by_significance_for_every_operand_length(order):
    """One M on the roles of the longest layout; each example's positions map to the roles of the same
    significance (1x1, 1x2, 2x1, 2x2 operands, full and short answers), the model's bias follows."""
    task = tasks.make_task("multiplication", digits=2, lee_samples=3000, answer_order=order, heads=2)
    pairs = [(7, 3), (3, 3), (7, 15), (15, 7), (12, 34), (99, 99)]        # 1x1 (and short), 1x2, 2x1, 2x2
    rows = task.lee_encode(np.array(pairs))
    x = rows[:, :-1]
    r_role, c_role = task.lee_roles(x)
    seen = task.pattern()[r_role[:, :, None], c_role[:, None, :]] & mp.causal_pattern(x.shape[1])
    for i, (a, b) in enumerate(pairs):
        text = tasks.lee_text(a, b, order)
        n = len(text) - 1                                                 # the rows that predict a character
        assert torch.equal(seen[i, :n, :n], _lee_expected(text, order)), text
    eq = 4 if order == "msb" else 5                                       # 7*15=105: '=' at position 4 (msb)
    keys = lambda i, q: torch.nonzero(seen[i, q, :q + 1]).flatten().tolist()        # noqa: E731
    if order == "msb":
        assert keys(2, eq) == [0, 2, 3, 4]            # '=' predicts 1 (c2): a0=7, b1=1, b0=5 and '='
        assert keys(2, eq + 2) == [0, 3, 4, 5, 6]     # '0' predicts 5 (c0): a0, b0, '=', the answer so far
        assert keys(3, eq + 2) == [1, 3, 4, 5, 6]     # 15*7=105: a0=5 (position 1), b0=7 (3)
        assert torch.equal(r_role[4], torch.arange(10)) and torch.equal(c_role[4], torch.arange(10))  # 2x2: positions
    else:
        assert keys(2, eq) == [1, 4, 5]               # '=' predicts c0 = 5: a0=7 (1), b0=5 (4), '='
        assert keys(0, 4) == [1, 3, 4]                # 7*3: '=' at 4 predicts c0: a0 (1), b0 (3)
    torch.manual_seed(0)
    cfg = mp.TransformerConfig(**task.arch(), n_layers=1, n_heads=2, dim=16, mlp_dim=16, learnable_mask=True)
    model = mp.Transformer(cfg)
    mp.init_mask_(model, logits=task.mask_logits(None, 5.0, 5.0))
    with mp.prior_roles(model, r_role, c_role):
        bias = model.blocks[0].attn.attn_bias(x.shape[1], torch.float32)
    assert bias.shape == (6, 2) + seen.shape[1:] and torch.equal(bias[:, 0] > -1, seen)
    assert model.blocks[0].attn.prior.roles is None                       # the block's end clears the roles
    assert torch.equal(bias[4], model.blocks[0].attn.attn_bias(x.shape[1], torch.float32))


class _LeeOracle(nn.Module):
    """Writes the right next character of every row (or, `early`, the end one character early)."""

    def __init__(self, task, early=False):
        super().__init__()
        self.task, self.early = task, early

    def forward(self, x, return_attn=False):
        out = torch.zeros(*x.shape, len(tasks.LEE_VOCAB))
        for i, row in enumerate(x.tolist()):
            text = "".join(tasks.LEE_VOCAB[c] for c in row)
            answer = tasks.lee_text(*_lee_pair(text), self.task.answer_order)
            answer = answer[answer.index("=") + 1:]
            if self.early:
                answer = answer[:-2] + answer[-1]
            for t in range(text.index("="), len(row)):
                written = t - text.index("=")
                out[i, t, tasks.LEE_TOKENS[answer[written] if written < len(answer) else "_"]] = 1
        return out


@pytest.mark.parametrize("order", ["msb", "lsb"])
def test_lee_scoring_reads_each_answer_to_its_end_and_the_loss_only_the_answer(order):
    task = tasks.make_task("multiplication", digits=2, lee_samples=3000, answer_order=order).setup()
    right = task.evaluate(_LeeOracle(task), points=150)
    assert right["seq_acc"] == right["train_seq_acc"] == right["digit_acc"] == right["train_digit_acc"] == 1.0
    assert right["eval_points"] == 150 and right["n_train"] == 3000 and right["n_test"] == task.test_size
    early = task.evaluate(_LeeOracle(task, early=True), points=150)
    assert early["seq_acc"] == early["train_seq_acc"] == 0.0 and 0.4 < early["digit_acc"] < 1.0
    class Unsure(_LeeOracle):                        # the right character, by a margin sampling at 0.8 misses
        def forward(self, x, return_attn=False):
            return 2 * super().forward(x)
    sure, sampled = task.evaluate(Unsure(task), points=150), task.evaluate(Unsure(task), points=150, temperature=0.8)
    assert sure["seq_acc"] == 1.0 and 0 < sampled["seq_acc"] < 0.9 and sampled["train_seq_acc"] < 0.9
    assert sampled == task.evaluate(Unsure(task), points=150, temperature=0.8)         # seeded
    rows = task.lee_encode(np.array([[7, 15], [3, 3]]))
    targets = task.lee_targets(rows)
    want = ["105\n", "9\n"] if order == "msb" else ["501$", "9$"]
    assert ["".join(tasks.LEE_VOCAB[t] for t in r if t >= 0) for r in targets.tolist()] == want
    assert float(task.loss(_LeeOracle(task), rows)) < float(task.loss(_LeeOracle(task, early=True), rows))


@pytest.mark.slow
def test_lee_run_logs_train_and_test_accuracy(tmp_path):
    rc, out = run_train(tmp_path, "--task", "multiplication", "--digits", "2", "--lee-samples", "200", "--init", "mask",
                        "--answer-order", "lsb", "--steps", "2", "--log-every", "1", "--layers", "1", "--dim", "16",
                        "--heads", "2", "--mlp-dim", "16", "--batch-size", "8", "--probe-size", "8",
                        "--eval-points", "20")
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert all({"seq_acc", "train_seq_acc"} <= set(r["metrics"]) for r in lines)
    assert lines[1]["metrics"]["eval_points"] == 20
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["metrics"]["eval_points"] == 0 and res["metrics"]["n_pairs_trained"] < 200 + 1
    assert res["metrics"]["prior_mass_start"] > 0.9


# ---------------------------------------------------------------------------------------- tasks.py: vision readers

def test_cifar10_python_pickles_with_bytes_keys(tmp_path):
    root = tmp_path / "cifar-10-batches-py"
    root.mkdir()
    xs, ys = [], []
    for i in range(1, 6):
        x, y = _images(4, i), [(i + j) % 10 for j in range(4)]
        _py2_pickle(root / f"data_batch_{i}", {b"batch_label": b"training batch", b"labels": y,
                                               b"data": x.reshape(4, -1), b"filenames": [b"a.png"] * 4})
        xs.append(x)
        ys += y
    _py2_pickle(root / "test_batch", {b"labels": [3, 1], b"data": _images(2, 9).reshape(2, -1)})
    d = tasks.read_cifar(str(tmp_path), "cifar10")
    assert d["train"][0].shape == (20, 3, 32, 32) and d["train"][0].dtype == np.uint8
    assert np.array_equal(d["train"][0], np.concatenate(xs)) and d["train"][1].tolist() == ys
    assert d["test"][1].tolist() == [3, 1] and np.array_equal(d["test"][0], _images(2, 9))
    # the python-3 style (str keys) reads the same
    (root / "test_batch").write_bytes(
        pickle.dumps({"labels": [3, 1], "data": _images(2, 9).reshape(2, -1)}, protocol=4)
    )
    assert tasks.read_cifar(str(tmp_path), "cifar10")["test"][1].tolist() == [3, 1]


def test_cifar100_python_and_binary_releases(tmp_path):
    py = tmp_path / "py" / "cifar-100-python"
    py.mkdir(parents=True)
    for split, n in (("train", 5), ("test", 3)):
        _py2_pickle(py / split, {b"fine_labels": list(range(90, 90 + n)), b"coarse_labels": [1] * n,
                                 b"data": _images(n, n).reshape(n, -1)})
    d = tasks.read_cifar(str(tmp_path / "py"), "cifar100")
    assert d["train"][1].tolist() == [90, 91, 92, 93, 94] and np.array_equal(d["test"][0], _images(3, 3))
    # binary: <coarse label byte><fine label byte><3072 pixel bytes> per record
    b = tmp_path / "bin" / "cifar-100-binary"
    b.mkdir(parents=True)
    for split, n in (("train", 4), ("test", 2)):
        x = _images(n, n + 10)
        rec = np.concatenate([np.full((n, 1), 7, np.uint8), np.arange(n, dtype=np.uint8)[:, None] + 50,
                              x.reshape(n, -1)], axis=1)
        rec.tofile(b / f"{split}.bin")
    d = tasks.read_cifar(str(tmp_path / "bin"), "cifar100")
    assert d["train"][1].tolist() == [50, 51, 52, 53] and np.array_equal(d["test"][0], _images(2, 12))


def test_cifar10_binary_release(tmp_path):
    b = tmp_path / "cifar-10-batches-bin"
    b.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        x = _images(2, len(name))
        np.concatenate([np.array([[4], [9]], np.uint8), x.reshape(2, -1)], axis=1).tofile(b / f"{name}.bin")
    d = tasks.read_cifar(str(tmp_path), "cifar10")
    assert d["train"][0].shape == (10, 3, 32, 32) and d["train"][1].tolist() == [4, 9] * 5
    assert np.array_equal(d["test"][0], _images(2, len("test_batch")))


def test_malformed_and_missing_image_files(tmp_path):
    b = tmp_path / "cifar-10-batches-bin"
    b.mkdir()
    (b / "data_batch_1.bin").write_bytes(b"\0" * 3000)           # not a whole 3073-byte record
    with pytest.raises(tasks.DataError, match="not a whole number of 3073-byte records"):
        tasks.read_cifar_binary(str(b / "data_batch_1.bin"))
    py = tmp_path / "p" / "cifar-10-batches-py"
    py.mkdir(parents=True)
    good = pickle.dumps({b"labels": [1, 2], b"data": _images(2).reshape(2, -1)}, protocol=2)
    (py / "data_batch_1").write_bytes(good[: len(good) // 2])     # truncated download
    with pytest.raises(tasks.DataError, match="truncated, damaged or not a release pickle"):
        tasks.read_cifar_pickle(str(py / "data_batch_1"))
    with pytest.raises(tasks.DataError, match="data_batch_2 is missing"):  # the release's files checked before decoding
        tasks.read_cifar(str(tmp_path / "p"), "cifar10")
    _py2_pickle(py / "data_batch_1", {b"labels": [1, 2, 3], b"data": _images(2).reshape(2, -1)})
    with pytest.raises(tasks.DataError, match="2 images but 3 labels"):
        tasks.read_cifar_pickle(str(py / "data_batch_1"))
    _py2_pickle(py / "data_batch_1", {b"labels": [1, 2], b"data": _images(2).reshape(2, -1)})
    with pytest.raises(tasks.DataError, match="data_batch_2 is missing"):
        tasks.read_cifar(str(tmp_path / "p"), "cifar10")
    with pytest.raises(tasks.DataError, match="CIFAR-100 not found.*cifar.html"):
        tasks.read_cifar(str(tmp_path / "empty"), "cifar100")


@pytest.mark.parametrize("suffix", ["", ".npz"])
def test_imagenet100_downsampled_keeps_the_100_classes_in_wnid_order(tmp_path, suffix):
    assert len(tasks.IMAGENET100_WNIDS) == 100 and list(tasks.IMAGENET100_WNIDS) == sorted(set(tasks.IMAGENET100_WNIDS))
    root = _imagenet_dir(tmp_path, suffix)
    d = tasks.read_imagenet100_downsampled(str(root))
    assert d["train"][0].shape == (20, 3, 32, 32) and d["train"][1].tolist() == [0, 99] * 10
    assert d["test"][1].tolist() == [0, 99, 0, 99]
    assert np.array_equal(d["test"][0][:2], _images(6, 2)[:2])
    os.remove(root / "map_clsloc.txt")
    with pytest.raises(tasks.DataError, match="map_clsloc.txt is missing"):
        tasks.read_imagenet100_downsampled(str(root))


def test_imagenet_labels_must_be_one_based(tmp_path):
    root = _imagenet_dir(tmp_path)
    _py2_pickle(root / "val_data", {b"data": _images(1).reshape(1, -1), b"labels": [0]})
    with pytest.raises(tasks.DataError, match="1-based"):
        tasks.read_imagenet100_downsampled(str(root))


def test_image_folder_reader(tmp_path):
    try:
        from PIL import Image
    except ImportError:
        with pytest.raises(tasks.DataError, match="needs Pillow: pip install pillow"):
            tasks.read_image_folder(str(tmp_path), 32)
        return
    for label in (0, 99):
        folder = tmp_path / tasks.IMAGENET100_WNIDS[label]
        folder.mkdir()
        Image.fromarray(_images(1, label)[0].transpose(1, 2, 0)).save(folder / "a.png")
    for w in tasks.IMAGENET100_WNIDS[1:99]:
        (tmp_path / w).mkdir()
    x, y = tasks.read_image_folder(str(tmp_path), 16)
    assert x.shape == (2, 3, 16, 16) and y.tolist() == [0, 99]
    (tmp_path / tasks.IMAGENET100_WNIDS[0] / "b.png").write_bytes(b"not an image")
    with pytest.raises(tasks.DataError, match="not a readable image"):
        tasks.read_image_folder(str(tmp_path), 16)


_U8 = np.zeros((4, 3072), np.uint8)


@pytest.mark.parametrize("data,labels,needle", [
    (np.full((4, 3072), 0.5), [1, 2, 3, 4], "pixels must be integers 0..255 (uint8, as in the release), "
                                            "found float64 values in 0.5..0.5"),           # 0-1 floats
    (np.full((4, 3072), 200.0), [1, 2, 3, 4], "found float64 values in 200..200"),        # 0-255 floats
    (np.full((4, 3072), np.nan), [1, 2, 3, 4], "found float64 values with NaN"),
    (np.full((4, 3072), 300), [1, 2, 3, 4], "pixels must be integers 0..255, found 300..300"),
    (np.full((4, 3072), -1), [1, 2, 3, 4], "found -1..-1"),
    (_U8, ["a", "b", "c", "d"], "labels must be integers, found |S1 values (e.g. b'a')"),     # Python 2's str
    (_U8, [[1], [2], [3], [4]], "labels must be a flat list of integers, found a list of lists"),
    (_U8, np.ones((4, 1), np.int64), "labels must be a flat list of integers, found an array of shape (4, 1)"),
    (_U8, [1, 2, 3, 10], "labels must lie in 0..9, found 1..10"),
    (_U8, [1, 2, 3, -1], "labels must lie in 0..9, found -1..3"),
    (np.zeros((4, 768), np.uint8), [1, 2, 3, 4], "rows of 768 bytes are 16x16 images; expected 32x32 (rows of 3072"),
    (np.zeros((0, 3072), np.uint8), [], "data_batch_2 holds no images (an empty batch)"),
])
def test_broken_cifar_data_is_refused_before_anything_is_cached(tmp_path, capsys, data, labels, needle):
    x, y = _images(4), [1, 2, 3, 4]
    datafetch.write.write_cifar10_python(str(tmp_path), np.concatenate([x] * 5), np.array(y * 5), x, np.array(y))
    _py2_pickle(tmp_path / "cifar-10-batches-py" / "data_batch_2", {b"data": data, b"labels": labels})
    rc, out = run_train(tmp_path, "--task", "cifar10", "--data-dir", tmp_path, "--steps", "1", "--layers", "1",
                        "--dim", "24", "--heads", "3", "--mlp-dim", "48", "--patch-size", "8", "--batch-size", "4")
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "data_batch_2" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(tmp_path)) == ["cifar-10-batches-py"]        # no cache, no run folder


def test_broken_binary_labels_and_imagenet_batches_are_refused(tmp_path):
    b = tmp_path / "cifar-10-batches-bin"
    b.mkdir()
    np.concatenate([np.array([[4], [12]], np.uint8), _images(2).reshape(2, -1)], axis=1).tofile(b / "x.bin")
    with pytest.raises(tasks.DataError, match=r"x.bin: labels must lie in 0..9, found 4..12"):
        tasks.read_cifar_binary(str(b / "x.bin"), n_classes=10)
    root = _imagenet_dir(tmp_path)
    _py2_pickle(root / "val_data", {b"data": np.full((1, 3072), 0.5), b"labels": [1]})
    with pytest.raises(tasks.DataError, match="val_data: pixels must be integers 0..255"):
        tasks.read_imagenet100_downsampled(str(root))
    _py2_pickle(root / "val_data", {b"data": _images(1).reshape(1, -1), b"labels": ["n01558993"]})
    with pytest.raises(tasks.DataError, match="val_data: labels must be integers"):
        tasks.read_imagenet100_downsampled(str(root))


def test_a_cifar_batch_that_is_a_folder_is_one_line(tmp_path):
    x, y = _images(10), np.arange(10) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:4], y[:4])
    os.remove(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    os.mkdir(tmp_path / "cifar-10-batches-py" / "data_batch_3")
    with pytest.raises(tasks.DataError, match="data_batch_3 is not a file"):
        tasks.read_cifar(str(tmp_path), "cifar10")
    with pytest.raises(tasks.DataError, match="cannot be read"):
        tasks.read_cifar_pickle(str(tmp_path / "cifar-10-batches-py" / "data_batch_3"))


_PAYLOADS = ["system", "eval", "subprocess"]


@pytest.mark.parametrize("how", _PAYLOADS)
@pytest.mark.parametrize("where", ["cifar10 data_batch_1", "cifar10 test_batch", "cifar100 train",
                                   "imagenet val_data", "imagenet .npz"])
def test_a_dataset_file_that_would_run_code_runs_nothing(tmp_path, capsys, where, how):
    """A dataset file crafted to run a command when unpickled (os.system, eval, subprocess; as the only
    value, inside the dict, in a Python 2 or a Python 3 pickle) is one line and exit 2, and the command
    never runs: the batches are read by `tasks.ReleaseUnpickler`, which admits only numbers and arrays."""
    marker = tmp_path / "ran"
    evil = {b"data": _Touch(marker, how), b"labels": [1]}
    if where.startswith("cifar10 "):
        data = tmp_path / "data"
        datafetch.write.write_cifar10_python(str(data), _images(10), np.arange(10), _images(2), np.arange(2))
        target = data / "cifar-10-batches-py" / where.split()[1]
        target.write_bytes(pickle.dumps(evil if "test" in where else _Touch(marker, how), protocol=2))
        argv = ["--task", "cifar10", "--data-dir", data]
    elif where == "cifar100 train":
        data = tmp_path / "data" / "cifar-100-python"
        data.mkdir(parents=True)
        (data / "train").write_bytes(pickle.dumps(evil, protocol=4))
        _py2_pickle(data / "test", {b"fine_labels": [1], b"data": _images(1).reshape(1, -1)})
        argv = ["--task", "cifar100", "--data-dir", data.parent]
    else:
        data = _imagenet_dir(tmp_path)
        if where.endswith(".npz"):
            os.remove(data / "val_data")
            np.savez(data / "val_data.npz", data=np.array([_Touch(marker, how)], dtype=object), labels=np.array([1]))
        else:
            (data / "val_data").write_bytes(pickle.dumps(evil, protocol=2))
        argv = ["--task", "imagenet100", "--data-dir", data]
    before = sorted(os.listdir(tmp_path))
    rc, _ = run_train(tmp_path, *argv, "--steps", "1", "--layers", "1", "--dim", "24", "--heads", "3", "--mlp-dim",
                      "24", "--patch-size", "8", "--batch-size", "2")
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and not marker.exists(), err
    assert ("no release file holds" in err and "nothing was run" in err) or "not an Imagenet32/64 .npz" in err, err
    assert sorted(os.listdir(tmp_path)) == before                       # no run folder


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_python_3_pickles_of_a_batch_read_the_same(tmp_path, protocol):
    """A batch re-saved by Python 3 (bytes through _codecs.encode at protocol 2, numpy._core names, protocol 5's
    _frombuffer), with str or bytes keys, reads as the Python 2 original."""
    x, y = _images(3, 7).reshape(3, -1), [4, 5, 6]
    for keys in (bytes, str):
        k = (lambda s: s.encode()) if keys is bytes else (lambda s: s)
        (tmp_path / "b").write_bytes(pickle.dumps({k("data"): x, k("labels"): y, k("batch_label"): k("b")},
                                                  protocol=protocol))
        got = tasks.read_cifar_pickle(str(tmp_path / "b"), n_classes=10)
        assert np.array_equal(got[0].reshape(3, -1), x) and got[1].tolist() == y


def test_damaged_copies_of_a_release_batch_are_one_data_error_each(tmp_path):
    """600 damaged copies of a Python 2 data_batch (bits flipped, bytes changed, cut, inserted or deleted, most
    in its structure): each reads or is one DataError, never another exception; and a damaged memo index that
    makes C's unpickler allocate gigabytes costs the pure-Python one nothing (ReleaseUnpickler)."""
    import random
    import tracemalloc
    x = _images(6, 3).reshape(6, -1)
    good = _py2_dumps({b"batch_label": b"training batch 1 of 5", b"labels": [1, 2, 3, 4, 5, 6], b"data": x,
                       b"filenames": [b"img_%d.png" % i for i in range(6)]})
    body = good.index(x.tobytes()[:64])
    rng, path, read, refused = random.Random(0), tmp_path / "data_batch_1", 0, 0
    for _ in range(600):
        b = bytearray(good)
        p = rng.choice([rng.randrange(body), rng.randrange(body + x.nbytes, len(b)), rng.randrange(len(b))])
        kind = rng.randrange(5)
        if kind == 0:
            b[p] ^= 1 << rng.randrange(8)
        elif kind == 1:
            b[p] = rng.randrange(256)
        elif kind == 2:
            b = b[:p]
        elif kind == 3:
            b[p:p] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 6)))
        else:
            del b[p:p + rng.randint(1, 6)]
        path.write_bytes(bytes(b))
        try:
            tasks.read_cifar_pickle(str(path), n_classes=10)
            read += 1
        except tasks.DataError:
            refused += 1
    assert read + refused == 600 and refused > 300
    reduce_at = good.index(b"R", good.index(b"numpy\nndarray"))        # REDUCE -> LONG_BINPUT with a huge index
    path.write_bytes(good[:reduce_at] + b"r" + good[reduce_at + 1:])
    tracemalloc.start()
    with pytest.raises(tasks.DataError):
        tasks.read_cifar_pickle(str(path))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 50e6, peak
    for labels, needle in (([10 ** 5000], "64-bit integers"), ([[1], [2]] * 3, "a flat list of integers"),
                           (b"\x01" * 6, "labels must be a list of integers, found bytes")):
        _py2_pickle(path, {b"data": x, b"labels": labels})
        with pytest.raises(tasks.DataError, match=needle):
            tasks.read_cifar_pickle(str(path))
    _py2_pickle(path, {b"data": x.tolist(), b"labels": [1] * 6})
    with pytest.raises(tasks.DataError, match="pixels must be a numpy array of uint8 rows"):
        tasks.read_cifar_pickle(str(path))


def test_image_cache_is_written_reused_and_rebuilt_when_a_source_changes(tmp_path, monkeypatch):
    x, y = _images(10), np.arange(10) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:4], y[:4])
    first = tasks.load_image_dataset("cifar10", str(tmp_path))
    cache = tmp_path / "maskprior-cache" / "cifar10-32.npz"
    assert cache.exists()
    with monkeypatch.context() as m:                               # the second run reads only the cache
        m.setattr(tasks, "read_cifar", lambda *a: pytest.fail("the cache was not used"))
        again = tasks.load_image_dataset("cifar10", str(tmp_path))
    assert np.array_equal(first["train"][0], again["train"][0]) and np.array_equal(again["test"][1], y[:4])
    # the batches replaced in place (other images, other labels): the cache is rebuilt, not trusted
    x2 = 255 - x
    datafetch.write.write_cifar10_python(str(tmp_path / "new"), x2, y, x2[:4], (y[:4] + 1) % 10)
    for f in os.listdir(tmp_path / "new" / "cifar-10-batches-py"):
        shutil.copyfile(tmp_path / "new" / "cifar-10-batches-py" / f, tmp_path / "cifar-10-batches-py" / f)
    os.utime(tmp_path / "cifar-10-batches-py" / "test_batch", ns=(1, 1))      # even with an older mtime
    fresh = tasks.load_image_dataset("cifar10", str(tmp_path))
    assert np.array_equal(fresh["train"][0], x2) and fresh["test"][1].tolist() == ((y[:4] + 1) % 10).tolist()
    shutil.rmtree(tmp_path / "cifar-10-batches-py")               # sources gone: the cache is not trusted either
    with pytest.raises(tasks.DataError, match="CIFAR-10 not found"):
        tasks.load_image_dataset("cifar10", str(tmp_path))


# ---------------------------------------------------------------------------------------- augment.py

def test_augmentation_shapes_and_determinism():
    x = torch.as_tensor(_images(8))
    a = augment.random_crop_flip(x, 4, torch.Generator().manual_seed(1))
    b = augment.random_crop_flip(x, 4, torch.Generator().manual_seed(1))
    c = augment.random_crop_flip(x, 4, torch.Generator().manual_seed(2))
    assert a.shape == x.shape and a.dtype == torch.uint8 and a.equal(b) and not a.equal(c)
    assert augment.random_crop_flip(x, 0, torch.Generator(), flip=False).equal(x)
    # a crop is a shifted window of the zero-padded image
    one = torch.arange(16, dtype=torch.uint8).view(1, 1, 4, 4)
    out = augment.random_crop_flip(one, 1, torch.Generator().manual_seed(0), flip=False)
    padded = F.pad(one, (1, 1, 1, 1))
    assert any(out.equal(padded[..., i:i + 4, j:j + 4]) for i in range(3) for j in range(3))


def _aug_images(n=6, h=9, w=11, seed=0):
    x = np.random.default_rng(seed).integers(0, 256, (n, 3, h, w), dtype=np.uint8)
    x[1] = x[1] // 4 + 100                                   # a low-contrast image
    x[2] = x[2] // 8 + 3                                     # a dark one
    return torch.as_tensor(x)


@pytest.mark.parametrize("name", list(augment.RANDAUG_OPS))
def test_randaugment_op_shapes_range_determinism_and_identity(name):
    fn, arg = augment.RANDAUG_OPS[name]
    x = _aug_images()
    m = torch.full((6,), 7.0)
    sign = torch.tensor([1.0, -1, 1, -1, 1, -1])
    out = fn(x, None if arg is None else arg(m, sign))
    assert out.shape == x.shape and out.dtype == torch.uint8
    again = fn(x, None if arg is None else arg(m, sign))
    assert torch.equal(out, again)
    if arg is not None:                                      # magnitude 0 leaves every image as it is
        assert torch.equal(fn(x, arg(torch.zeros(6), sign)), x), name
        assert name == "identity" or not torch.equal(out, x), name


PIL_EQUIVALENT = {  # op: (argument, Pillow's function of a PIL image and that argument)
    "brightness": (1.7, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Brightness(im).enhance(a)),
    "color": (0.3, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Color(im).enhance(a)),
    "contrast": (1.6, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Contrast(im).enhance(a)),
    "sharpness": (0.2, lambda im, a: __import__("PIL.ImageEnhance").ImageEnhance.Sharpness(im).enhance(a)),
    "posterize": (3, lambda im, a: __import__("PIL.ImageOps").ImageOps.posterize(im, a)),
    "solarize": (100, lambda im, a: __import__("PIL.ImageOps").ImageOps.solarize(im, a)),
    "autocontrast": (None, lambda im, a: __import__("PIL.ImageOps").ImageOps.autocontrast(im)),
    "equalize": (None, lambda im, a: __import__("PIL.ImageOps").ImageOps.equalize(im)),
}


@pytest.mark.parametrize("name", list(PIL_EQUIVALENT))
def test_randaugment_photometric_ops_equal_pillows(name):
    """Each photometric op equals Pillow's on every pixel (Pillow 13 measured; a hand value without Pillow)."""
    fn = augment.RANDAUG_OPS[name][0]
    a, ref = PIL_EQUIVALENT[name]
    x = _aug_images()
    ours = fn(x, a).numpy()
    try:
        from PIL import Image
    except ImportError:
        hand = {"brightness": lambda v: min(255, int(v * 1.7)), "posterize": lambda v: v & 0b11100000,
                "solarize": lambda v: 255 - v if v >= 100 else v}
        if name in hand:
            assert all(ours.flat[i] == hand[name](int(x.numpy().flat[i])) for i in range(0, ours.size, 7))
        return
    want = np.stack([np.asarray(ref(Image.fromarray(img.transpose(1, 2, 0)), a)).transpose(2, 0, 1)
                     for img in x.numpy()])
    assert np.array_equal(ours, want), (ours != want).sum()


def test_geometric_ops_by_hand():
    x = _aug_images(4, 9, 9)
    assert torch.equal(augment.aug_rotate(x, 90.0), torch.rot90(x, 1, (2, 3)))           # counter-clockwise
    assert torch.equal(augment.aug_rotate(x, -90.0), torch.rot90(x, -1, (2, 3)))
    t = augment.aug_translate_x(x, 2 / 9)                                                # two pixels to the left
    assert torch.equal(t[..., :7], x[..., 2:]) and t[0, :, 0, 8].tolist() == list(augment.AUG_FILL)
    t = augment.aug_translate_y(x, -3 / 9)                                               # three pixels down
    assert torch.equal(t[..., 3:, :], x[..., :6, :])
    s = augment.aug_shear_x(x, 1.0)                                                      # row i reads columns j + i
    assert torch.equal(s[:, :, 2, :7], x[:, :, 2, 2:]) and torch.equal(s[:, :, 0], x[:, :, 0])
    s = augment.aug_shear_y(x, 1.0)
    assert torch.equal(s[:, :, :7, 2], x[:, :, 2:, 2])


def test_rand_augment_is_seeded_and_mixes_ops():
    x = _aug_images(64, 16, 16)
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    a, b = augment.rand_augment(x, g(), 9.0, 0.5), augment.rand_augment(x, g(), 9.0, 0.5)
    assert torch.equal(a, b) and a.dtype == torch.uint8 and a.shape == x.shape
    changed = (a != x).flatten(1).any(1).float().mean()
    assert 0.5 < changed < 1.0                              # each of 2 ops applied with p 0.5: ~75% change
    zero = augment.rand_augment(x, g(), 0.0, 0.0, prob=1.0)           # magnitude 0: only autocontrast / equalize act
    unchanged = (zero == x).flatten(1).all(1).float().mean()
    assert 0.5 < unchanged < 1.0


def test_random_resized_crop_erasing_and_eval_view():
    x = _aug_images(8, 32, 32)
    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    out = augment.random_resized_crop(x, 224, g())
    assert (
        out.shape == (8, 3, 224, 224)
        and out.dtype == torch.uint8
        and torch.equal(out, augment.random_resized_crop(x, 224, g()))
    )
    whole = augment.random_resized_crop(x, 64, g(), scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    up = tasks.F.interpolate(x.float(), size=64, mode="bilinear", align_corners=False)
    assert (whole.float() - up).abs().max() <= 1                                    # the whole image, upsampled
    view = augment.resize_center_crop(x, 224, 0.875)
    assert view.shape == (8, 3, 224, 224)
    xf = torch.randn(64, 3, 16, 16)
    e = augment.random_erasing(xf, 0.5, g())
    erased = (e != xf).flatten(1).any(1)
    assert 0.25 < erased.float().mean() < 0.75 and torch.equal(e, augment.random_erasing(xf, 0.5, g()))
    frac = (e != xf)[erased].float().mean()                                      # a box of 2% to 33% of the image
    assert 0.02 <= frac <= 0.34
    assert torch.equal(augment.random_erasing(xf, 0.0, g()), xf)


def test_mixup_and_cutmix_mix_images_and_targets_by_what_each_keeps():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 3, 8, 8), torch.eye(4)
    perm = torch.tensor([1, 0, 3, 2])
    mx, my = augment.mixup(x, y, perm, 0.7)
    assert torch.allclose(mx, 0.7 * x + 0.3 * x[perm]) and torch.allclose(my[0], torch.tensor([0.7, 0.3, 0, 0]))
    cx, cy = augment.cutmix(x, y, perm, 0.75, g)
    pasted = (cx != x).any(1)                                  # (B, S, S): where the partner's pixels went
    assert torch.equal(cx[:, :, pasted[0]], x[perm][:, :, pasted[0]]) and torch.equal(
        cx[~pasted.unsqueeze(1).expand_as(x)], x[~pasted.unsqueeze(1).expand_as(x)]
    )
    kept = 1 - pasted[0].float().mean()
    assert 0 < kept < 1 and torch.allclose(cy[0], torch.tensor([kept, 1 - kept, 0, 0]))
    assert torch.equal(augment.cutmix(x, y, perm, 1.0, g)[0], x)     # lam 1: nothing pasted
    rng = np.random.default_rng(0)
    assert augment.mix_batch(x, y, 0.0, 0.0, g, rng) == (x, y)
    for mix, cut in ((0.8, 0.0), (0.0, 1.0), (0.8, 1.0)):
        bx, by = augment.mix_batch(x, y, mix, cut, torch.Generator().manual_seed(1), np.random.default_rng(1))
        assert bx.shape == x.shape and torch.allclose(by.sum(-1), torch.ones(4)) and not torch.equal(bx, x)


# ---------------------------------------------------------------------------------------- tasks.py: ImageTask

def test_image_task_batches_mixup_and_cutmix(tmp_path):
    x, y = _images(40), np.arange(40) % 10
    datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:8], y[:8])
    for mix in ({}, {"mixup": 0.8}, {"cutmix": 1.0}):
        task = tasks.make_task("cifar10", data_dir=str(tmp_path), **mix).setup()
        xb, yb = task.train_batch(3, 16)
        assert xb.shape == (16, 3, 32, 32) and yb.shape == (16, 10)
        torch.testing.assert_close(yb.sum(-1), torch.ones(16))
        x2, y2 = task.train_batch(3, 16)
        assert xb.equal(x2) and yb.equal(y2)
    assert task.pattern().shape == (3, 64, 64)


def test_vision_patterns_and_their_probe_patterns(image_dir):
    task = tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, heads=3, soft_alpha=1.0)      # 4 x 4 grid
    imp, soft = task.pattern("impulse"), task.pattern("soft")
    # alpha 1: only the offset itself is above -1 (e^-1 at distance 1), and where it leaves the grid the row's
    # likeliest key, itself: the impulse pattern, so a QK init reads the same prior from either (CLS or not)
    assert soft.equal(imp) and (soft.sum(-1) == 1).all()
    cls = tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, pool="cls")
    assert cls.pattern("soft").equal(cls.pattern("impulse"))
    assert tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, soft_alpha=3.0).pattern("soft").equal(imp)
    assert (
        tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, soft_alpha=0.5).pattern("soft").sum() > imp.sum()
    )
    graded = task.mask_logits("graded", 5.0, 10.0)
    assert (graded[imp] == 5).all() and (graded[task.pattern("graded") & ~imp] == 0).all()
    assert (graded[~task.pattern("graded")] == -10).all()
    local = tasks.make_task("cifar10", data_dir=image_dir, patch_size=8, window=5).pattern("local")
    assert local[0, 0].sum() == 9 and local[0, 5].sum() == 16           # a corner sees 3 x 3, an inner patch all
    for bad, needle in (({"window": 4}, "--window must be the local prior's side"),
                        ({"soft_alpha": 0.0}, "--soft-alpha")):
        with pytest.raises(tasks.TaskError, match=needle):
            tasks.make_task("cifar10", data_dir=image_dir, **bad)


MUST_TRIES = (-1, 0, 1, 2, 3, 4, 0.5, 1.5, 11, float("nan"), float("inf"), "msb", "x", True)   # None: the default


def test_every_declared_task_option_refuses_exactly_what_its_test_fails(tmp_path):
    """Each option a task declares (Task.MUST, of every registered task and its bases) is refused in
    one line, "--flag must be <what>, got <value>", for each tried value its test fails (a TypeError
    counts as failing), and never for a value its test passes."""
    tried, seen = 0, set()
    for name, cls in tasks.TASKS.items():
        base = {"data_dir": str(tmp_path)} if "data_dir" in cls.options() else {}
        for klass in cls.__mro__:
            for option, must in vars(klass).get("MUST", {}).items():
                if (klass, option) in seen:                       # each declaration tried on one task
                    continue
                seen.add((klass, option))
                flag = must.flag or "--" + option.replace("_", "-")
                given = flag[2:].replace("-", "_")                 # the option as make_task takes it
                assert given in cls.options(), (name, option)
                for value in MUST_TRIES:
                    try:
                        good = bool(must.test(value))
                    except TypeError:
                        good = False
                    try:
                        tasks.make_task(name, **base, **{given: value})
                        said = ""
                    except tasks.TaskError as e:
                        said = str(e)
                    assert (f"{flag} must be {must.what}, got {value!r}" == said) != good, (name, option, value, said)
                    tried += 1
    assert tried > 200


def test_impulse_pattern_is_fixed_at_construction(tmp_path, image_dir):
    """--impulse random once drew its offsets with seed 0 before setup and with the run's seed after it."""
    task = tasks.make_task("cifar10", data_dir=image_dir, impulse="random", heads=3, seed=5)
    before = task.pattern()
    task.setup()
    assert torch.equal(before, task.pattern())
    other = tasks.make_task("cifar10", data_dir=image_dir, impulse="random", heads=3, seed=6).pattern()
    assert not torch.equal(before, other)


@pytest.mark.parametrize("argv,needle", [
    (["--task", "cifar10"], "--data-dir is required"),
    (["--task", "cifar10", "--data-dir", "/nonexistent/x"], "is not a folder"),
    (["--task", "cifar100", "--data-dir", "EMPTY"], "CIFAR-100 not found"),
    (["--task", "imagenet100", "--data-dir", "EMPTY"], "ImageNet-100 not found in"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--image-size", "32", "--patch-size", "5"], "not a multiple"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--patch-size", "0"], "--patch-size must be an integer > 0"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--image-size", "0"], "--image-size must be an integer > 0"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--label-smoothing", "1"], "--label-smoothing must be a finite"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--mixup", "-1"], "--mixup must be a finite number >= 0"),
    (["--task", "cifar10", "--data-dir", "EMPTY", "--warmup-epochs", "nan"], "--warmup-epochs must be a finite"),
])
def test_vision_bad_input_exits_2(tmp_path, capsys, argv, needle):
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out = run_train(tmp_path, *[str(empty) if a == "EMPTY" else a for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert os.listdir(empty) == [] and not os.path.exists(out)       # nothing written


# ---------------------------------------------------------------------------------------- tasks.py: language readers

def test_line_words_follow_word_language_model():
    assert tasks.wikitext_line_words(" = Robert Boulter = \n") == ["=", "Robert", "Boulter", "=", "<eos>"]
    assert tasks.wikitext_line_words(" \n") == ["<eos>"]
    assert tasks.wikitext_line_words("\n") == ["<eos>"]
    assert tasks.wikitext_line_words(" 1 @,@ 000 <unk> \n") == ["1", "@,@", "000", "<unk>", "<eos>"]


# Corpus readers: small files in the real WikiText-2 / TinyStories layouts.


def test_vocab_order_specials_then_frequency_then_alphabetical(tmp_path):
    train = "b a b\n\nc a b d c\n"  # b:3, a:2, c:2, d:1, <eos>:3
    make_wikitext(tmp_path, train=train, valid="a d\n", test="c\n")
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert corpus["vocab"] == ["<unk>", "<eos>", "b", "a", "c", "d"]
    assert corpus["vocab_size"] == 6
    assert corpus["train"].tolist() == [2, 3, 2, 1, 1, 4, 3, 2, 5, 4, 1]
    assert corpus["valid"].tolist() == [3, 5, 1]
    assert corpus["test"].tolist() == [4, 1]
    assert tasks.build_vocab(["<eos>", "<unk>", "z", "y", "z"]) == ["<unk>", "<eos>", "z", "y"]


def reference_words(text: str) -> list[str]:
    return [w for line in text.splitlines() for w in line.split() + ["<eos>"]]


def test_wikitext_tokens_release_ids_and_round_trip(tmp_path):
    make_wikitext(tmp_path)
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    vocab = corpus["vocab"]
    assert vocab[:2] == ["<unk>", "<eos>"]
    assert vocab.count("<unk>") == 1  # the train <unk> is the special, not a second entry
    for split, text in (("train", WIKI_TRAIN), ("valid", WIKI_VALID), ("test", WIKI_TEST)):
        tokens = corpus[split]
        assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16 and not tokens.flags.writeable
        words = reference_words(text)
        assert [vocab[i] for i in tokens] == words  # every word of .tokens is in the train vocab
        expected = "".join(" ".join(line.split()) + "\n" for line in text.splitlines())
        assert corpus["decode"](tokens.tolist()) == expected
    # Every line, blank ones included, ends in exactly one <eos>.
    assert int((np.asarray(corpus["train"]) == 1).sum()) == WIKI_TRAIN.count("\n")
    for special in ("@,@", "@.@", "@-@", "="):
        assert special in vocab
    assert corpus["decode"]([vocab.index("="), vocab.index("Career"), vocab.index("="), 1]) == "= Career =\n"


def test_wikitext_raw_release_maps_oov_to_unk(tmp_path):
    make_wikitext(tmp_path, release="raw")
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert "raw release" in corpus["source"]
    vocab = corpus["vocab"]
    assert "unseenword" not in vocab and "actor." in vocab
    valid_words = [vocab[i] for i in corpus["valid"]]
    assert valid_words == ["<eos>", "Boulter", "is", "an", "<unk>", "actor.", "<eos>"]
    assert corpus["test"].tolist() == [vocab.index(w) for w in ("Robert", "is", "an", "actor.", "<eos>")]


def test_wikitext_data_dir_may_be_the_subfolder_and_tokens_is_preferred(tmp_path):
    sub = make_wikitext(tmp_path, release="tokens")
    make_wikitext(tmp_path, release="raw")
    from_parent = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert "tokens release" in from_parent["source"]
    from_sub = tasks.load_lm_corpus("wikitext2", sub)
    assert from_sub["train"].tolist() == from_parent["train"].tolist()
    raw = tasks.load_lm_corpus("wikitext2", tmp_path, version="raw")
    assert "raw release" in raw["source"]
    assert raw["vocab"] != from_parent["vocab"]


def test_wikitext_large_vocab_uses_uint32(tmp_path):
    words = " ".join(f"w{i}" for i in range(70_000))
    make_wikitext(tmp_path, train=words + "\n", valid="w1 w69999\n", test="w2\n")
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert corpus["vocab_size"] == 70_002
    assert corpus["train"].dtype == np.uint32
    assert [corpus["vocab"][i] for i in corpus["valid"]] == ["w1", "w69999", "<eos>"]


def test_wikitext_missing_files_error(tmp_path):
    with pytest.raises(tasks.DataError) as info:
        tasks.load_lm_corpus("wikitext2", tmp_path)
    message = str(info.value)
    assert "\n" not in message
    for needle in ("wiki.{train,valid,test}.tokens", ".raw", str(tmp_path / "wikitext-2"),
                   "wikitext-2-v1.zip", "wikitext.smerity.com", "python train.py download wikitext2 --data"):
        assert needle in message
    # An incomplete release is not used.
    write(tmp_path / "wikitext-2" / "wiki.train.tokens", WIKI_TRAIN)
    with pytest.raises(tasks.DataError, match="not found"):
        tasks.load_lm_corpus("wikitext2", tmp_path)


@pytest.mark.parametrize("split", ["train", "valid", "test"])
def test_wikitext_empty_split_error(tmp_path, split):
    make_wikitext(tmp_path, **{split: ""})
    with pytest.raises(tasks.DataError, match=rf"wiki\.{split}\.tokens is empty.*wikitext\.smerity\.com"):
        tasks.load_lm_corpus("wikitext2", tmp_path)
    assert not (tmp_path / "maskprior-cache").exists()               # no vocab, no split, no folder left


def reference_bytes(data: bytes) -> list[int]:
    """Non-streaming reference for the TinyStories byte tokenisation."""
    out, story = [], []

    def flush():
        body = b"\n".join(story).strip()
        if body:
            out.extend(body)
            out.append(256)
        story.clear()

    for line in data.split(b"\n"):
        if line.strip() == b"<|endoftext|>":
            flush()
        else:
            story.append(line)
    flush()
    return out


def test_tinystories_exact_bytes():
    data = "Hi\n<|endoftext|>\né\n <|endoftext|>\n"
    assert reference_bytes(data.encode()) == [72, 105, 256, 0xC3, 0xA9, 256]


def stream(path: Path, chunk_size: int) -> list[int]:
    arrays = list(tasks.iter_tinystories_tokens(path, chunk_size))
    return np.concatenate(arrays).tolist() if arrays else []


def test_tinystories_stream_matches_reference_for_every_chunk_size(tmp_path):
    data = STORIES.encode("utf-8")
    path = write(tmp_path / "TinyStoriesV2-GPT4-train.txt", data)
    # The fixture really exercises chunk boundaries at chunk_size=7: a separator
    # line and a 3-byte “ are both cut by a multiple of 7.
    sep = data.index(b"\n<|endoftext|>\n") + 1
    assert sep // 7 != (sep + len(b"<|endoftext|>")) // 7
    quote = data.index("“".encode())
    assert quote // 7 != (quote + 2) // 7
    e_acute = data.rindex("é".encode())
    assert e_acute // 7 != (e_acute + 1) // 7
    expected = reference_bytes(data)
    assert expected.count(256) == 4  # the empty story between two separators is skipped
    assert bytes(t for t in expected if t != 256).count("<|endoftext|>".encode()) == 1  # mid-line text kept
    for chunk_size in list(range(1, 40)) + [7, 1 << 20]:
        assert stream(path, chunk_size) == expected, chunk_size


def test_tinystories_crlf_and_whitespace_only_lines(tmp_path):
    data = b"\r\n  \r\nOne\r\n\r\n<|endoftext|>\r\n\t<|endoftext|>\t\r\nTwo\xc3\xa9 \r\n"
    path = write(tmp_path / "x.txt", data)
    expected = list(b"One") + [256] + list("Twoé".encode()) + [256]
    assert reference_bytes(data) == expected
    for chunk_size in (1, 2, 3, 7, 64):
        assert stream(path, chunk_size) == expected


def test_tinystories_load_decode_round_trip(tmp_path):
    make_tinystories(tmp_path)
    corpus = tasks.load_lm_corpus("tinystories", tmp_path, chunk_size=7)
    assert corpus["vocab_size"] == 257
    train, valid = corpus["train"], corpus["valid"]
    assert isinstance(train, np.memmap) and train.dtype == np.uint16 and not train.flags.writeable
    assert train.tolist() == reference_bytes(STORIES.encode())
    stories = [
        "Once upon a time, a “Lily” saw a café.\n\nShe said, “Hi!” He wrote <|endoftext|> on a card.",
        "Tom ran.",
        "Ben was very happy é.",
        "Last story with no separator after it.",
    ]
    assert corpus["decode"](train.tolist()) == "".join(s + "\n<|endoftext|>\n" for s in stories)
    assert corpus["decode"](valid.tolist()) == "A small dog.\n<|endoftext|>\nThe end “now”.\n<|endoftext|>\n"
    with pytest.raises(ValueError):
        corpus["decode"]([257])


def test_tinystories_version_choice(tmp_path):
    make_tinystories(tmp_path, "TinyStories", train="v one\n<|endoftext|>\n", valid="v1 valid\n")
    assert tasks.load_lm_corpus("tinystories", tmp_path)["decode"]([118, 32, 111]) == "v o"
    v1 = tasks.load_lm_corpus("tinystories", tmp_path)
    assert "TinyStories-train.txt" in v1["source"]
    assert bytes(v1["train"][:-1].tolist()) == b"v one"
    make_tinystories(tmp_path, "TinyStoriesV2-GPT4", train="v two\n", valid="v2 valid\n")
    auto = tasks.load_lm_corpus("tinystories", tmp_path)
    assert bytes(auto["train"][:-1].tolist()) == b"v two"
    chosen = tasks.load_lm_corpus("tinystories", tmp_path, version="v1")
    assert bytes(chosen["train"][:-1].tolist()) == b"v one"
    with pytest.raises(tasks.DataError, match="unknown TinyStories version"):
        tasks.load_lm_corpus("tinystories", tmp_path, version="v3")
    with pytest.raises(tasks.DataError, match="unknown corpus"):
        tasks.load_lm_corpus("ptb", tmp_path)


def test_tinystories_subfolder(tmp_path):
    make_tinystories(tmp_path / "TinyStories")
    assert tasks.load_lm_corpus("tinystories", tmp_path)["train"].tolist() == reference_bytes(STORIES.encode())


def test_tinystories_missing_files_error(tmp_path):
    write(tmp_path / "TinyStoriesV2-GPT4-train.txt", STORIES)  # valid missing
    with pytest.raises(tasks.DataError) as info:
        tasks.load_lm_corpus("tinystories", tmp_path)
    message = str(info.value)
    assert "\n" not in message
    for needle in ("TinyStoriesV2-GPT4-{train,valid}.txt", "TinyStories-{train,valid}.txt",
                   str(tmp_path), "huggingface.co/datasets/roneneldan/TinyStories"):
        assert needle in message


def test_tinystories_empty_corpus_error(tmp_path):
    make_tinystories(tmp_path, train="\n<|endoftext|>\n  \n<|endoftext|>\n\n")
    with pytest.raises(tasks.DataError, match=r"TinyStoriesV2-GPT4-train\.txt contains no stories.*roneneldan"):
        tasks.load_lm_corpus("tinystories", tmp_path)
    assert not (tmp_path / "maskprior-cache").exists()  # no half cache, no temp file, no folder


def test_random_windows_shapes_shift_and_determinism():
    tokens = np.arange(1000, 1100, dtype=np.uint16)
    x, y = tasks.random_windows(tokens, 8, 5, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (5, 8) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row_x, row_y in zip(x, y):
        start = int(row_x[0]) - 1000
        assert 0 <= start <= 100 - 9
        assert row_x.tolist() == tokens[start : start + 8].tolist()
        assert row_y.tolist() == tokens[start + 1 : start + 9].tolist()
    x2, y2 = tasks.random_windows(tokens, 8, 5, torch.Generator().manual_seed(0))
    assert torch.equal(x, x2) and torch.equal(y, y2)
    x3, _ = tasks.random_windows(tokens, 8, 5, torch.Generator().manual_seed(1))
    assert not torch.equal(x, x3)


def test_random_windows_reach_both_ends():
    tokens = np.arange(10, dtype=np.uint32)
    x, y = tasks.random_windows(tokens, 9, 64, torch.Generator().manual_seed(0))  # only one possible window
    assert (x == torch.arange(9)).all() and (y == torch.arange(1, 10)).all()
    x, _ = tasks.random_windows(tokens, 3, 2000, torch.Generator().manual_seed(0))
    assert set(x[:, 0].tolist()) == set(range(7))
    with pytest.raises(tasks.DataError, match=r"--context 10 is longer than the training split \(10 tokens\)"):
        tasks.random_windows(tokens, 10, 2, torch.Generator())


@pytest.mark.parametrize("n, context, batch_size", [(11, 5, 1), (12, 5, 1), (23, 5, 3), (6, 5, 4), (100, 7, 4)])
def test_eval_windows_cover_the_split(n, context, batch_size):
    tokens = np.arange(n, dtype=np.uint16) * 3
    batches = list(tasks.eval_windows(tokens, context, batch_size))
    xs = torch.cat([x.reshape(-1) for x, _ in batches])
    ys = torch.cat([y.reshape(-1) for _, y in batches])
    assert xs.tolist() == tokens[:-1].tolist()  # consecutive, non-overlapping, nothing dropped
    assert ys.tolist() == tokens[1:].tolist()
    for x, y in batches:
        assert x.dtype == torch.int64 and x.shape == y.shape and x.shape[0] <= batch_size
        assert x.shape[1] == context or (x.shape[0] == 1 and x is batches[-1][0])
    assert sum(y.numel() for _, y in batches) == n - 1


def test_eval_windows_context_longer_than_validation_split(tmp_path):
    make_wikitext(tmp_path)
    corpus = tasks.load_lm_corpus("wikitext2", tmp_path)
    n = len(corpus["valid"])
    with pytest.raises(tasks.DataError) as info:
        tasks.eval_windows(corpus["valid"], n)  # raised eagerly, before iterating
    assert str(info.value).startswith(f"--context {n} is longer than the validation split ({n} tokens)")
    assert len(list(tasks.eval_windows(corpus["valid"], n - 1))) == 1
    # --eval-context past the split names itself, not --context
    task = tasks.make_task("wikitext2", data_dir=str(tmp_path), context=4, positions="none", eval_context=n)
    with pytest.raises(tasks.DataError, match=f"^--eval-context {n} is longer than the validation split"):
        task.setup()


def test_wikitext_tokenize_and_layout(tmp_path):
    assert datafetch.write.wikitext_tokenize("A well-known 1,000-page book, 3.5 cm.") == \
        ["A", "well", "@-@", "known", "1", "@,@", "000", "@-@", "page", "book", ",", "3", "@.@", "5", "cm", "."]
    arts = [(f"Title {i}", ["the cat sat on the mat .", "the dog sat ."]) for i in range(12)]
    out = datafetch.write.write_wikitext_layout(arts, str(tmp_path))
    text = open(os.path.join(out, "wiki.train.tokens")).read()
    assert text.startswith(" \n = Title <unk> = \n \n the cat sat on the mat . \n \n")
    assert " = Title <unk> = " in open(os.path.join(out, "wiki.valid.tokens")).read()


# ---------------------------------------------------------------------------------------- tasks.py: token cache

def cache_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in sorted(folder.iterdir())}


def test_wikitext_cache_round_trip_and_rebuild(tmp_path, monkeypatch):
    sub = make_wikitext(tmp_path)
    first = tasks.load_lm_corpus("wikitext2", tmp_path)
    cache = tmp_path / "maskprior-cache"
    before = cache_files(cache)
    assert set(before) == {
        "wikitext2-tokens.vocab.json",
        *(f"wikitext2-tokens.{s}.{ext}" for s in ("train", "valid", "test") for ext in ("bin", "json")),
    }
    assert json.loads((cache / "wikitext2-tokens.vocab.json").read_text("utf-8")) == first["vocab"]
    meta = json.loads((cache / "wikitext2-tokens.train.json").read_text("utf-8"))
    assert meta["dtype"] == "uint16" and meta["count"] == len(first["train"])
    assert meta["vocab_size"] == len(first["vocab"])
    assert meta["sources"][0]["size"] == len(WIKI_TRAIN.encode())

    # Second load: no tokenisation at all, cache files untouched.
    def no_tokenising(*args, **kwargs):
        raise AssertionError("re-tokenised although the cache is valid")

    monkeypatch.setattr(tasks, "iter_wikitext_words", no_tokenising)
    second = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert cache_files(cache) == before
    assert second["vocab"] == first["vocab"]
    assert second["train"].tolist() == first["train"].tolist()
    monkeypatch.undo()

    # A changed train file rebuilds vocab and all splits.
    write(sub / "wiki.train.tokens", WIKI_TRAIN + " zebra" * 9 + " \n")
    third = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert third["vocab"][2] == "zebra"
    assert third["valid"].tolist() != first["valid"].tolist()

    # Same size, new mtime: rebuilt too.
    path = sub / "wiki.test.tokens"
    write(path, WIKI_TEST.replace("2000", "film"))  # same size
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    fourth = tasks.load_lm_corpus("wikitext2", tmp_path)
    assert "He starred in film ." in fourth["decode"](fourth["test"].tolist())


def test_tinystories_cache_round_trip_and_rebuild(tmp_path, monkeypatch):
    make_tinystories(tmp_path)
    first = tasks.load_lm_corpus("tinystories", tmp_path, chunk_size=5)
    cache = tmp_path / "maskprior-cache"
    before = cache_files(cache)
    assert set(before) == {f"tinystories-v2.{s}.{e}" for s in ("train", "valid") for e in ("bin", "json")}
    assert (cache / "tinystories-v2.train.bin").stat().st_size == 2 * len(first["train"])

    monkeypatch.setattr(tasks, "iter_tinystories_tokens", lambda *a, **k: pytest.fail("re-tokenised"))
    second = tasks.load_lm_corpus("tinystories", tmp_path)
    assert cache_files(cache) == before
    assert second["train"].tolist() == first["train"].tolist()
    monkeypatch.undo()

    write(tmp_path / "TinyStoriesV2-GPT4-valid.txt", "Changed.\n<|endoftext|>\n")
    third = tasks.load_lm_corpus("tinystories", tmp_path)
    assert third["valid"].tolist() == list(b"Changed.") + [256]
    after = cache_files(cache)
    assert after["tinystories-v2.train.bin"] == before["tinystories-v2.train.bin"]  # train not rebuilt
    assert after["tinystories-v2.valid.bin"] != before["tinystories-v2.valid.bin"]


def test_interrupted_build_leaves_no_cache(tmp_path, monkeypatch):
    make_tinystories(tmp_path)

    def interrupted(path, chunk_size):
        yield np.array([1, 2, 3], dtype=np.uint16)
        raise KeyboardInterrupt

    monkeypatch.setattr(tasks, "iter_tinystories_tokens", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tasks.load_lm_corpus("tinystories", tmp_path)
    assert not (tmp_path / "maskprior-cache").exists()               # no half file, no temp file, no folder
    monkeypatch.undo()
    assert tasks.load_lm_corpus("tinystories", tmp_path)["train"].tolist() == reference_bytes(STORIES.encode())


def test_fallback_cache_dir_when_data_dir_not_writable(tmp_path, monkeypatch):
    data = make_tinystories(tmp_path / "data")
    write(data / "maskprior-cache", "a file, so the cache folder cannot be created here")
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    corpus = tasks.load_lm_corpus("tinystories", data)
    folders = list((home / ".cache" / "maskprior").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith("data-") and len(folders[0].name) == 5 + 16
    assert folders[0] == tasks.default_cache_dirs(data)[1]
    assert (folders[0] / "tinystories-v2.train.bin").is_file()
    assert corpus["train"].tolist() == reference_bytes(STORIES.encode())
    # Another data_dir with the same folder name gets its own cache folder.
    other = make_tinystories(tmp_path / "elsewhere" / "data", train="Other.\n")
    write(other / "maskprior-cache", "blocked")
    assert tasks.load_lm_corpus("tinystories", other)["train"].tolist() == list(b"Other.") + [256]
    assert len(list((home / ".cache" / "maskprior").iterdir())) == 2


def test_explicit_cache_dir(tmp_path):
    make_wikitext(tmp_path / "data")
    tasks.load_lm_corpus("wikitext2", tmp_path / "data", cache_dir=tmp_path / "c")
    assert (tmp_path / "c" / "wikitext2-tokens.train.bin").is_file()
    assert not (tmp_path / "data" / "maskprior-cache").exists()


@pytest.mark.parametrize("corpus", ["cifar10", "wikitext2", "tinystories"])
def test_a_cache_sees_a_source_replaced_with_the_same_size_and_mtime(tmp_path, corpus):
    """A source file replaced by other contents of the same size, its mtime set back (what tar -x, cp -p or
    rsync -t leave): the cache is rebuilt from the new contents, not served stale. A touch alone (same bytes)
    keeps the cache."""
    if corpus == "cifar10":
        x, y = _images(10), np.arange(10) % 10
        datafetch.write.write_cifar10_python(str(tmp_path), x, y, x[:4], y[:4])
        source = tmp_path / "cifar-10-batches-py" / "test_batch"
        load = lambda: tasks.load_image_dataset("cifar10", str(tmp_path))["test"][0]   # noqa: E731
    elif corpus == "wikitext2":
        _write_text_corpus(tmp_path)
        source = tmp_path / "wikitext-2" / "wiki.valid.tokens"
        load = lambda: np.array(tasks.load_lm_corpus("wikitext2", tmp_path)["valid"])   # noqa: E731
    else:
        make_tinystories(tmp_path)
        source = next(tmp_path.rglob("*-valid.txt"))
        load = lambda: np.array(tasks.load_lm_corpus("tinystories", tmp_path)["valid"])   # noqa: E731
    first = load()
    os.utime(source, ns=(source.stat().st_atime_ns, source.stat().st_mtime_ns + 10 ** 9))    # a touch: same bytes
    assert np.array_equal(load(), first)
    st = source.stat()                                # what the cache has seen last
    data = bytearray(source.read_bytes())
    i = len(data) // 2 if corpus == "cifar10" else next(j for j, c in enumerate(data) if chr(c).islower())
    data[i] = (data[i] + 1) % 256 if corpus == "cifar10" else ord("q") if data[i] != ord("q") else ord("z")
    source.write_bytes(bytes(data))                                       # in place, as cp -p does
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert source.stat().st_size == st.st_size and source.stat().st_mtime_ns == st.st_mtime_ns
    again = load()
    assert not np.array_equal(again, first)


# ---------------------------------------------------------------------------------------- tasks.py: LMTask

def test_lm_patterns_follow_the_alibi_slopes():
    p = tasks.lm_patterns(300, 4)
    assert p.shape == (4, 300, 300) and not (p & ~mp.causal_pattern(300)).any()
    assert [int(p[h, 299].sum()) for h in range(4)] == [5, 17, 65, 257]      # windows 4, 16, 64, 256
    m = mp.causal_distance_logits(300, 4)
    bias = F.logsigmoid(m)
    assert (bias[p & ~torch.eye(300, dtype=torch.bool)] > -1.0001).all()


@pytest.mark.slow
def test_lm_short_run_lowers_validation_loss_and_samples(tmp_path, capsys):
    _write_text_corpus(tmp_path / "data")
    rc, out = run_train(tmp_path, "--task", "wikitext2", "--data-dir", tmp_path / "data", "--init", "mask",
                        "--steps", "60", "--log-every", "60", "--lr", "3e-3", *LM_SMALL)
    assert rc == 0
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert lines[-1]["metrics"]["val_loss"] < lines[0]["metrics"]["val_loss"] - 0.5
    capsys.readouterr()
    assert train.main(["--out", out, "--sample", "the cat", "--sample-tokens", "5", "--temperature", "0"]) == 0
    text = capsys.readouterr().out.strip()
    assert text.startswith("the cat") and len(text.split()) == 7


@pytest.mark.parametrize("setup,argv,needle", [
    ("none", [], "WikiText-2 not found"),
    ("empty", [], "no tokens"),
    ("small", ["--context", "2000"], "longer than the validation split"),
    ("small", ["--context", "100000"], "longer than the training split"),
    ("small", ["--context", "1"], "--context must be at least 2"),
])
def test_lm_bad_input_exits_2(tmp_path, capsys, setup, argv, needle):
    data = tmp_path / "data"
    data.mkdir()
    if setup == "small":
        _write_text_corpus(data)
    elif setup == "empty":
        (data / "wikitext-2").mkdir()
        for split in ("train", "valid", "test"):
            (data / "wikitext-2" / f"wiki.{split}.tokens").write_text("")
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    rc, out = run_train(tmp_path, "--task", "wikitext2", "--data-dir", data, "--steps", "2", *argv,
                        name="new/parents/run")
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(tmp_path / "new")                      # no run folder, no parent folder left
    after = sorted(p.relative_to(data) for p in data.rglob("*") if setup != "small" or "maskprior-cache" not in str(p))
    assert after == before                  # no cache of a refused corpus (a good corpus's cache may stay)
