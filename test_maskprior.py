"""Tests for maskprior.py, tasks.py and train.py. Run: python -m pytest -q test_maskprior.py"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import maskprior as mp
import tasks as T
import train

HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_cfg(**kw):
    base = dict(vocab_size=5, seq_len=11, n_layers=2, n_heads=3, dim=24, mlp_dim=32, n_outputs=4)
    base.update(kw)
    return mp.TransformerConfig(**base)


# ---------------------------------------------------------------------------------------- attention


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_mask", [False, True])
def test_fused_and_explicit_agree(causal, with_mask):
    torch.manual_seed(0)
    attn = mp.Attention(24, 3, mask_size=10 if with_mask else None, causal=causal, qkv_bias=True)
    if with_mask:
        with torch.no_grad():
            attn.mask_logits.copy_(torch.randn(3, 10, 10) * 4)
    x = torch.randn(2, 9, 24, requires_grad=True)   # T=9 < mask size: the mask is sliced
    grads = []
    for fused in (True, False):
        attn.fused = fused
        attn.zero_grad()
        x.grad = None
        out, maps = attn(x)
        assert (maps is None) == fused
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        params = [x.grad.clone(), attn.qkv.weight.grad.clone(), attn.proj.weight.grad.clone()]
        if with_mask:
            params.append(attn.mask_logits.grad.clone())
        grads.append((out.detach(), params))
    (o1, g1), (o2, g2) = grads
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-5)
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_model_fused_and_explicit_agree():
    torch.manual_seed(0)
    model = mp.Transformer(tiny_cfg(learnable_mask=True))
    mp.init_mask_(model, mp.banded_pattern(12, 2), 5.0, 5.0)
    idx = torch.randint(0, 5, (3, 11))
    out_fused = model(idx)
    out_explicit, maps = model(idx, return_attn=True)
    torch.testing.assert_close(out_fused, out_explicit, atol=1e-5, rtol=1e-5)
    assert len(maps) == 2 and maps[0].shape == (3, 3, 12, 12)
    torch.testing.assert_close(maps[0].sum(-1), torch.ones(3, 3, 12))


def test_mask_bias_never_positive():
    m = torch.linspace(-50, 50, 1001)
    assert (mp.mask_bias(m) <= 0).all()
    pat = mp.banded_pattern(6, 1)
    logits = mp.mask_logits_from_pattern(pat, 5.0, 7.0)
    assert (logits[pat] == 5).all() and (logits[~pat] == -7).all()
    assert abs(float(mp.mask_bias(torch.tensor(5.0))) + 0.0067) < 1e-4


def test_causal_bias_hides_the_future():
    attn = mp.Attention(8, 2, mask_size=6, causal=True)
    bias = attn.attn_bias(6, torch.float32, torch.device("cpu"))
    future = torch.ones(6, 6, dtype=torch.bool).triu(1)
    assert torch.isinf(bias[:, future]).all() and torch.isfinite(bias[:, ~future]).all()


def test_mask_gradient_bound_holds():
    """|dL/dM_ij| <= sigma(-M_ij) * sum_b p_bij (max_k g_bik - min_k g_bik) (Theorem 1), and the
    bound is reasonably tight (not vacuous)."""
    torch.manual_seed(1)
    model = mp.Transformer(tiny_cfg(learnable_mask=True, fused=False, n_outputs=1, readout="cls"))
    mp.init_mask_(model, mp.banded_pattern(12, 1), 5.0, 5.0)
    idx = torch.randint(0, 5, (8, 11))
    out, maps = model(idx, return_attn=True)
    for a in maps:
        a.retain_grad()
    F.mse_loss(out.squeeze(-1), torch.randn(8)).backward()
    for block, a in zip(model.blocks, maps):
        m = block.attn.mask_logits
        bound = mp.mask_grad_bound(a.detach(), a.grad, m.detach())
        assert (m.grad.abs() <= bound + 1e-7).all()
        assert (m.grad.abs().sum() / bound.sum()) > 0.05
        # the bound is at most the attention mass times the gradient spread: sigma(-M) <= 1
        spread = a.grad.amax(-1, keepdim=True) - a.grad.amin(-1, keepdim=True)
        assert (bound <= (a.detach() * spread).sum(0) + 1e-9).all()


# ---------------------------------------------------------------------------------------- patterns


def test_pattern_builders():
    p = mp.pattern_from_pairs(4, [(0, 2)], symmetric=True, self_loops=False)
    assert p.tolist() == [[False, False, True, False], [False] * 4, [True, False, False, False], [False] * 4]
    assert mp.pattern_from_pairs(3, []).equal(torch.eye(3, dtype=torch.bool))
    b = mp.banded_pattern(6, 1, circulant=True)
    assert b[0].tolist() == [True, True, False, False, False, True]
    assert mp.banded_pattern(6, 1)[0].tolist() == [True, True, False, False, False, False]
    e = mp.embed_pattern(torch.ones(2, 2, dtype=torch.bool), 1, 4)
    assert e.sum() == 4 and e[1:3, 1:3].all()
    c = mp.causal_pattern(3)
    assert c.tolist() == [[True, False, False], [True, True, False], [True, True, True]]


def test_impulse_pattern_on_known_grid():
    # 3x3 grid, heads: self, up, right; patch 4 is the centre (row 1, col 1)
    p = mp.impulse_pattern(3, 3, mp.IMPULSE_OFFSETS[:3])
    assert p.shape == (3, 9, 9) and (p.sum(-1) == 1).all()
    assert p[0].equal(torch.eye(9, dtype=torch.bool))
    assert p[1, 4, 1] and p[2, 4, 5]
    assert p[1, 0, 0] and p[2, 2, 2]          # neighbours off the grid fall back to self
    q = mp.impulse_pattern(2, 2, [(0, 1)], n_prefix=1)
    assert q.shape == (1, 5, 5) and q[0, 0].all() and q[0, :, 0].all()
    offs = mp.random_impulse_offsets(5, 3, torch.Generator().manual_seed(0))
    assert len(offs) == 5 and all(-1 <= a <= 1 and -1 <= b <= 1 for a, b in offs)


def test_causal_distance_logits_are_alibi():
    m = mp.causal_distance_logits(6, 4)
    bias = mp.mask_bias(m)
    slopes = mp.alibi_slopes(4)
    assert slopes.tolist() == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    for h in range(4):
        for i in range(6):
            for j in range(i):
                assert abs(float(bias[h, i, j]) + float(slopes[h]) * (i - j)) < 1e-5
    assert (bias[:, range(6), range(6)] > -1e-4).all()


# ---------------------------------------------------------------------------------------- inits


def gotu_model(**kw):
    task = T.make_task("parity2")
    cfg = mp.TransformerConfig(**{**task.arch(), "n_layers": 2, "n_heads": 4, "dim": 64, **kw})
    torch.manual_seed(0)
    return task, mp.Transformer(cfg)


def test_init_mask_sets_every_layer_and_creates_missing_masks():
    task, model = gotu_model()
    pat = task.pattern()
    rep = mp.init_mask_(model, pat, 5.0, 8.0)
    assert rep["m_off"] == 8.0
    for blk in model.blocks:
        m = blk.attn.mask_logits
        assert m.shape == (4, 16, 16) and (m[:, pat] == 5).all() and (m[:, ~pat] == -8).all()


def test_qk_svd_puts_pseudo_input_mass_on_pattern():
    task, model = gotu_model()
    pat = task.pattern()
    rep = mp.init_qk_svd_(model, pat, generator=torch.Generator().manual_seed(0))
    assert len(rep["pseudo_mass"]) == 2 and min(rep["pseudo_mass"]) > 0.9
    p = mp.pseudo_input(model, model.blocks[1])
    a = mp.pseudo_attention(model.blocks[1].attn, p)
    assert float(mp.pattern_mass(a.unsqueeze(0), pat)) == pytest.approx(rep["pseudo_mass"][1], abs=1e-5)
    # uniform attention would put only the pattern's density there
    assert float(pat.float().sum(-1).mean() / 16) < 0.2


def test_qk_opt_fits_pattern_better_than_random():
    task, model = gotu_model()
    pat = task.pattern()
    before = mp.pattern_mass(mp.pseudo_attention(model.blocks[0].attn, mp.pseudo_input(model)).unsqueeze(0), pat)
    rep = mp.init_qk_opt_(model, pat, steps=300, lr=1e-2, generator=torch.Generator().manual_seed(0))
    assert rep["steps"] == 300 and rep["pseudo_mass"][0] > float(before) + 0.1
    # layer 0 is copied to every layer
    inner = 2 * 64
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight[:inner], model.blocks[1].attn.qkv.weight[:inner])


def test_mimetic_products_close_to_targets():
    cfg = mp.ViTConfig(image_size=8, patch_size=4, dim=48, n_layers=1, n_heads=1, head_dim=48)
    vit = mp.ViT(cfg)
    g = torch.Generator().manual_seed(0)
    rep = mp.init_mimetic_(vit, generator=g)
    assert rep["vo_truncation_error"][0] < 1e-5
    wq, wk = mp.qk_weights(vit.blocks[0].attn)
    qk = (wq[0] @ wk[0].T).detach()
    # a Z + b I with Z of variance 1/D: the diagonal ~ b, the rest ~ N(0, a^2 / D)
    assert float(qk.diagonal().mean()) == pytest.approx(0.7, abs=0.1)
    off = qk - torch.diag(qk.diagonal())
    assert float(off.std()) == pytest.approx(0.7 / 48 ** 0.5, rel=0.2)
    attn = vit.blocks[0].attn
    vo = (attn.qkv.weight[96:].T @ attn.proj.weight.T).detach()
    assert float(vo.diagonal().mean()) == pytest.approx(-0.4, abs=0.1)


def test_param_groups_keep_mask_out_of_weight_decay():
    _, model = gotu_model(learnable_mask=True)
    groups = mp.param_groups(model, 0.1)
    decay = {id(p) for p in groups[0]["params"]}
    masks = [b.attn.mask_logits for b in model.blocks]
    assert all(id(m) not in decay for m in masks)
    assert id(model.blocks[0].attn.qkv.weight) in decay and id(model.pos_emb) not in decay
    assert id(model.blocks[0].ln1.weight) not in decay and id(model.tok_emb.weight) not in decay
    n_all = sum(1 for _ in model.parameters())
    assert len(groups[0]["params"]) + len(groups[1]["params"]) == n_all


def test_prior_probes():
    task, model = gotu_model(learnable_mask=True)
    pat = task.pattern()
    mp.init_mask_(model, pat, 5.0, 5.0)
    task.setup(0)
    mass = mp.prior_mass(model, task.probe_inputs(64), pat)
    assert len(mass) == 2 and all(0.5 < m <= 1.0 for m in mass)
    snap = mp.prior_snapshot(model)
    assert mp.prior_drift(model, snap)["mask_drift"] == [0.0, 0.0]
    with torch.no_grad():
        model.blocks[0].attn.mask_logits.mul_(2)
    assert mp.prior_drift(model, snap)["mask_drift"][0] == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------- Boolean tasks


@pytest.mark.parametrize("name,size,frac_unseen", [("parity2", 24576, 0.25), ("majority3", 32768, 0.25),
                                                    ("cyclic3", 28672, 0.125)])
def test_gotu_splits(name, size, frac_unseen):
    task = T.make_task(name).setup(0)
    assert task.n_train == size and len(task.x_test) == 2 ** 15
    assert float(task.unseen_mask.float().mean()) == frac_unseen
    x = task.x_train * 2 - 1
    assert not task.in_unseen(x.numpy()).any()
    if name != "majority3":     # every seen point exactly once
        assert len(torch.unique(task.x_train, dim=0)) == size
    xb, yb = task.train_batch(0, 256)
    assert xb.shape == (256, 15) and yb.shape == (256,)


def test_gotu_targets():
    task = T.make_task("cyclic3").setup(0)
    x = task.x_test * 2 - 1
    y = sum(x[:, i] * x[:, (i + 1) % 15] * x[:, (i + 2) % 15] for i in range(15)).float()
    assert torch.equal(task.y_test, y)
    maj = T.make_task("majority3").setup(0)
    assert set(maj.y_test.unique().tolist()) == {-1.0, 1.0}


def test_epoch_batches_cover_train_set_once():
    task = T.make_task("parity2").setup(3)
    spe = task.steps_per_epoch(1000)
    seen = torch.cat([task.train_batch(s, 1000)[0] for s in range(spe)])
    assert len(seen) == task.n_train and len(torch.unique(seen, dim=0)) == task.n_train
    assert not torch.equal(task.train_batch(0, 64)[0], task.train_batch(spe, 64)[0])   # reshuffled


@pytest.mark.parametrize("name,acc,extra", [("parity2", 0.75, {}), ("majority3", 0.875, {}),
                                            ("cyclic3", 0.875, {"sign_acc": 0.928253173828125})])
def test_mdi_accuracies(name, acc, extra):
    mdi = T.make_task(name).mdi()
    assert mdi["acc"] == acc and mdi["acc_seen"] == 1.0 and mdi["mse_seen"] == pytest.approx(0, abs=1e-9)
    for k, v in extra.items():
        assert mdi[k] == pytest.approx(v)
    if name == "parity2":
        assert mdi["coefficients"] == pytest.approx({"1": -1.0, "x0": 1.0, "x1": 1.0})


def test_mdi_prefers_low_degree():
    # on data that a degree-1 function fits, the MDI is that function, not the degree-2 truth
    x = T.cube(3)
    seen = ~((x[:, 0] == -1) & (x[:, 1] == -1))
    pred, degree, coefs = T.min_degree_interpolator(x[seen], (x[seen, 0] * x[seen, 1]).astype(float), x)
    assert degree == 1 and coefs == pytest.approx({(): -1.0, (0,): 1.0, (1,): 1.0})


def test_custom_boolean_tasks():
    task = T.make_task("kparity", bits="2,5,9", unseen="2,5").setup(0)
    assert task.n_train == 3 * 2 ** 13 and task.mdi()["acc"] == 0.75
    p = task.pattern()
    assert p[0, 3] and p[3, 6] and p[6, 10] and not p[1, 2]
    maj = T.make_task("kmajority", bits="0,1,2,3,4", unseen="0,1", train_size=1000).setup(0)
    assert maj.n_train == 1000
    with pytest.raises(T.TaskError):
        T.make_task("kmajority", bits="0,1")
    with pytest.raises(T.TaskError):
        T.make_task("kparity", bits="0,99")


def test_patterns_of_the_gotu_tasks():
    p = T.make_task("parity2").pattern()
    assert p.shape == (16, 16) and p[0, 1] and p[0, 2] and p[1, 2] and p[2, 1] and not p[0, 3]
    assert p.diagonal().all() and not p[1, 3]
    c = T.make_task("cyclic3").pattern()
    assert c[0].all() and c[1, 15] and c[1, 14] and c[1, 3] and not c[1, 4]   # bit 0 ~ bits 13, 14, 1, 2


# ---------------------------------------------------------------------------------------- train.py


def run_train(tmp_path, *args, name="run"):
    out = os.path.join(tmp_path, name)
    return train.main(["--out", out, *map(str, args)]), out


SMALL = ["--layers", "1", "--dim", "32", "--heads", "2", "--mlp-dim", "32", "--batch-size", "32", "--probe-size", "32"]


def test_run_directory_and_result(tmp_path):
    rc, out = run_train(tmp_path, "--task", "parity2", "--init", "mask", "--steps", "20", "--log-every", "10", *SMALL)
    assert rc == 0
    assert sorted(os.listdir(out)) == ["args.json", "ckpt.pt", "metrics.jsonl", "result.json"]
    res = json.load(open(os.path.join(out, "result.json")))
    for key in ("task", "init", "seed", "steps", "seconds"):
        assert key in res
    for key in ("acc", "acc_unseen", "mse", "mse_unseen", "mdi_acc", "prior_mass_start", "prior_mass_end"):
        assert isinstance(res["metrics"][key], float)
    assert res["metrics"]["mdi_acc"] == 0.75 and res["steps"] == 20
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    assert [x["step"] for x in lines] == [0, 10, 20] and "mask_drift" in lines[-1]


@pytest.mark.parametrize("init", ["qk-svd", "qk-opt"])
def test_qk_inits_run(tmp_path, init):
    rc, out = run_train(tmp_path, "--task", "majority3", "--init", init, "--steps", "4", "--qk-opt-steps", "200",
                        *SMALL)
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert len(res["init_report"]["pseudo_mass"]) == 1 and "qk_drift" in res


def test_mask_beats_default_on_unseen_majority3(tmp_path):
    """The paper's claim in miniature: on majority3 the mask generalises to the unseen quarter,
    default stays at the min-degree interpolator (50% on U, 87.5% on the cube)."""
    common = ["--task", "majority3", "--layers", "3", "--dim", "32", "--heads", "2", "--mlp-dim", "64",
              "--steps", "800", "--log-every", "800", "--warmup", "50", "--seed", "0", "--probe-size", "64"]
    rc1, d = run_train(tmp_path, *common, "--init", "default", name="d")
    rc2, m = run_train(tmp_path, *common, "--init", "mask", name="m")
    assert rc1 == rc2 == 0
    rd = json.load(open(os.path.join(d, "result.json")))["metrics"]
    rm = json.load(open(os.path.join(m, "result.json")))["metrics"]
    assert rd["acc"] == pytest.approx(rd["mdi_acc"], abs=0.01) and rd["acc_unseen"] < 0.55
    assert rm["acc_unseen"] > rd["acc_unseen"] + 0.2
    assert rm["mse_unseen"] < 0.5 * rd["mse_unseen"]
    assert rm["prior_mass_end"] > 0.8 > 0.3 > rd["prior_mass_end"]


def test_resume_is_exact(tmp_path):
    args = ["--task", "parity2", "--init", "mask", "--steps", "30", "--log-every", "10", *SMALL]
    rc, full = run_train(tmp_path, *args, name="full")
    assert rc == 0
    rc, part = run_train(tmp_path, *args, "--halt-after", "10", name="part")
    assert rc == 0 and not os.path.exists(os.path.join(part, "result.json"))
    assert torch.load(os.path.join(part, "ckpt.pt"), weights_only=False)["step"] == 10
    rc = train.main(["--out", part, "--resume"])
    assert rc == 0
    a = torch.load(os.path.join(full, "ckpt.pt"), weights_only=False)
    b = torch.load(os.path.join(part, "ckpt.pt"), weights_only=False)
    assert a["step"] == b["step"] == 30
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    la = [json.loads(x)["loss"] for x in open(os.path.join(full, "metrics.jsonl"))]
    lb = [json.loads(x)["loss"] for x in open(os.path.join(part, "metrics.jsonl"))]
    assert la == lb


@pytest.mark.parametrize("argv,needle", [
    (["--task", "nosuch"], "unknown task"),
    (["--init", "nosuch"], "unknown init"),
    (["--steps", "0"], "--steps must be a positive"),
    (["--steps", "-5"], "--steps must be a positive"),
    (["--batch-size", "0"], "--batch-size must be a positive"),
    (["--epochs", "0"], "--epochs must be positive"),
    (["--steps", "ten"], "invalid int value"),
    (["--init", "mimetic"], "does not apply"),
    (["--task", "kparity", "--bits", "0,40"], "--bits must list distinct bits"),
    (["--pattern", "nosuch"], "has no pattern"),
])
def test_bad_input_exits_2(tmp_path, capsys, argv, needle):
    rc, out = run_train(tmp_path, *argv)
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not os.path.exists(out) or not os.listdir(out)


def test_out_dir_holding_another_run_is_refused(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--steps", "2", *SMALL)
    assert rc == 0
    before = {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)}
    rc, _ = run_train(tmp_path, "--steps", "2", "--init", "mask", *SMALL)
    assert rc == 2 and "already holds a run" in capsys.readouterr().err
    assert {f: open(os.path.join(out, f), "rb").read() for f in os.listdir(out)} == before


def test_resume_with_other_architecture_is_refused(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--steps", "4", "--halt-after", "2", *SMALL)
    assert rc == 0
    rc = train.main(["--out", out, "--resume", "--layers", "3"])
    err = capsys.readouterr().err
    assert rc == 2 and "architecture" in err and "layers" in err
    assert train.main(["--out", os.path.join(tmp_path, "nothing"), "--resume"]) == 2


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, capsys):
    rc, out = run_train(tmp_path, "--steps", "200", "--lr", "1e30", "--log-every", "1", *SMALL)
    err = capsys.readouterr().err
    assert rc == 1 and "loss became" in err
    ckpt = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert not os.path.exists(os.path.join(out, "result.json"))


def test_ctrl_c_leaves_a_checkpoint_that_resumes(tmp_path):
    out = os.path.join(tmp_path, "int")
    cmd = [sys.executable, os.path.join(HERE, "train.py"), "--out", out, "--steps", "100000", "--log-every", "5",
           *SMALL]
    proc = subprocess.Popen(cmd, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = os.path.join(out, "metrics.jsonl")
    deadline = time.time() + 60
    while time.time() < deadline and not (os.path.exists(log) and len(open(log).readlines()) >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, text
    step = torch.load(os.path.join(out, "ckpt.pt"), weights_only=False)["step"]
    assert step >= 5
    rc = train.main(["--out", out, "--resume", "--steps", str(step + 5)])
    assert rc == 0 and json.load(open(os.path.join(out, "result.json")))["steps"] == step + 5


def test_epochs_flag_sets_steps(tmp_path):
    rc, out = run_train(tmp_path, "--task", "kparity", "--bits", "0,1", "--unseen", "0,1", "--n-bits", "6",
                        "--epochs", "2", "--batch-size", "16", *SMALL[:-4])
    assert rc == 0
    assert json.load(open(os.path.join(out, "result.json")))["steps"] == 2 * 3     # 48 seen points / 16


def test_maskprior_copied_alone_runs(tmp_path):
    shutil.copy(os.path.join(HERE, "maskprior.py"), tmp_path)
    code = ("import maskprior as mp, torch\n"
            "cfg = mp.TransformerConfig(vocab_size=2, seq_len=7, n_layers=2, n_heads=2, dim=16, mlp_dim=16)\n"
            "m = mp.Transformer(cfg)\n"
            "mp.init_mask_(m, mp.banded_pattern(8, 1))\n"
            "y = m(torch.randint(0, 2, (4, 7)))\n"
            "y.sum().backward()\n"
            "assert m.blocks[0].attn.mask_logits.grad is not None\n"
            "v = mp.ViT(mp.ViTConfig(image_size=8, patch_size=4, n_layers=1))\n"
            "v(torch.randn(2, 3, 8, 8)).sum().backward()\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    src = open(os.path.join(HERE, "maskprior.py")).read()
    assert "import tasks" not in src and "import train" not in src


# ---------------------------------------------------------------------------------------- CUDA (skipped without a GPU)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("causal", [False, True])
def test_cuda_bf16_fused_matches_explicit_with_mask(causal):
    torch.manual_seed(0)
    attn = mp.Attention(128, 2, mask_size=70, causal=causal).cuda()     # N not a multiple of 8 on purpose
    with torch.no_grad():
        attn.mask_logits.copy_(torch.randn(2, 70, 70, device="cuda") * 4)
    x = torch.randn(4, 67, 128, device="cuda", requires_grad=True)
    res = []
    for fused in (True, False):
        attn.fused = fused
        attn.zero_grad()
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out, _ = attn(x)
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        res.append((out.float().detach(), x.grad.clone(), attn.mask_logits.grad.clone()))
    (o1, gx1, gm1), (o2, gx2, gm2) = res
    assert torch.isfinite(gm1).all() and gm1.abs().sum() > 0
    torch.testing.assert_close(o1, o2, atol=3e-2, rtol=3e-2)
    assert float((gx1 - gx2).norm() / gx2.norm()) < 3e-2
    assert float((gm1 - gm2).norm() / gm2.norm()) < 3e-2


@cuda
def test_cuda_training_run(tmp_path):
    rc, out = run_train(tmp_path, "--task", "majority3", "--init", "mask", "--steps", "20", "--device", "cuda",
                        *SMALL)
    assert rc == 0
    res = json.load(open(os.path.join(out, "result.json")))
    assert res["device"].startswith("cuda") and res["metrics"]["mse"] < 10


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(HERE, "README.md")).read()
    ci = open(os.path.join(HERE, ".ci", "run")).read().strip().splitlines()[-1]
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].strip().splitlines()
    assert first_block[0] == ci and len(first_block) == 2
    assert first_block[1].startswith("python train.py --task")
