"""Tests for maskprior_retrofit.py: the prior in other libraries' models (torch, timm, Hugging Face, PEFT, your
own attention), the peers' own behaviours as a generated matrix (add_mask_prior's bad arguments are refused in
test_maskprior.py, generated with the library's). Run: python -m pytest -q test_retrofit.py (the README's
test command runs it with the others; the helpers they share are in conftest.py)."""
import copy
import dataclasses
import importlib.util
import inspect
import json
import math
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import maskprior as mp
import maskprior_retrofit as retrofit
import tasks
from conftest import HERE, _bench, _extra, _one_line, _past, cuda


@pytest.mark.slow
def test_a_causal_distance_prior_is_small_by_default_and_a_large_full_m_is_one_line():
    """A causal prior whose logits depend on i - j alone (causal_distance_logits, relative_from_attention) is stored per
    distance unless param='full' is asked: at GPT-2 small's shape (12 layers, 12 heads, 1,024 positions) the prior adds
    147,456 parameters, 0.12% of the model's 124M, not the full M's 151M; a full M over 10% of a model's parameters is
    one line naming its size, and the model is left unchanged; param='full' takes it."""
    tf = _extra("transformers")
    with torch.device("meta"):
        gpt2 = tf.GPT2LMHeadModel(tf.GPT2Config())
    own = sum(p.numel() for p in gpt2.parameters())
    priors = retrofit.add_mask_prior(gpt2, logits=mp.causal_distance_logits(1024, 12))
    added = sum(p.bias.numel() for p in priors.values())
    assert all(p.param == "relative" for p in priors.values()) and added == 12 * 12 * 1024
    assert added / own < 0.01, (added, own)
    model, x, n = _hf("gpt2")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    logits = _past(torch.randn(4, n, n))
    with pytest.raises(ValueError, match=r"^add_mask_prior: a full M on 2 layers would add 4,608 parameters to the "
                                         r"model's .* \(1\d%\); param='full' takes it anyway .*no layer was changed$"):
        retrofit.add_mask_prior(model, logits=logits)
    assert not mp.mask_priors(model) and model.state_dict().keys() == before.keys()
    assert all(p.param == "full" for p in retrofit.add_mask_prior(model, logits=logits, param="full").values())
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"it depends on i - j alone: param='relative' holds it"):
        retrofit.add_mask_prior(enc, mp.banded_pattern(64, 2))                 # a non-causal band: full unless asked
    assert mp.MaskPrior(16, 2, logits=mp.causal_distance_logits(16, 2), causal=True).param == "relative"
    assert mp.MaskPrior(16, 2, mp.banded_pattern(16, 2)).param == "full"            # a layout: by pair


def test_a_pattern_or_logits_that_allow_future_keys_on_a_causal_model_are_one_line_and_nothing_changes():
    """A causal layer never sees its future: a pattern or M > 0 there that varies from pair to pair (a band, another
    model's non-causal attention) would be dropped in silence, so add_mask_prior, init_mask_ and MaskPrior refuse it
    in one line and nothing changes. A future the same everywhere (all allowed, M = +30) says nothing and passes."""
    model, x, n = _hf("gpt2")
    plain = _out(model, x).detach()
    band = mp.banded_pattern(n, 2)
    for kw in (dict(pattern=band), dict(logits=mp.logits_from_attention(band.float().softmax(-1).expand(1, 4, n, n)))):
        with pytest.raises(ValueError, match=r"transformer.h.0.attn .*allow[s]? \d+ future keys \(e.g. query 0, key 1\)"
                                             r", which a causal layer never sees"):
            retrofit.add_mask_prior(model, **kw)
        assert not mp.mask_priors(model) and torch.equal(_out(model, x), plain)
    retrofit.add_mask_prior(model, logits=torch.full((n, n), 30.0), param="full")      # a neutral prior: accepted
    torch.testing.assert_close(_out(model, x), plain, atol=2e-5, rtol=1e-5)
    ours = mp.Transformer(mp.TransformerConfig(vocab_size=5, seq_len=8, readout="tokens", n_outputs=5, causal=True,
                                               n_layers=2, n_heads=2, dim=8, learnable_mask=True))
    before = [p.bias.detach().clone() for p in mp.mask_priors(ours)]
    with pytest.raises(ValueError, match=r"^init_mask_: the prior allows 13 future keys .* never sees"):
        mp.init_mask_(ours, mp.banded_pattern(8, 2))
    assert all(torch.equal(p.bias, b) for p, b in zip(mp.mask_priors(ours), before))
    with pytest.raises(ValueError, match="the pattern allows 7 future keys"):
        mp.MaskPrior(8, 2, mp.banded_pattern(8, 1), causal=True)
    mp.init_mask_(ours, torch.ones(8, 8, dtype=torch.bool))                       # every pair allowed: nothing lost


def _one_step(make_optimizer, model, x, weight_decay: float):
    """A copy of `model` after one step of the optimizer `make_optimizer(model, weight_decay)` on a fixed loss."""
    model = copy.deepcopy(model)
    opt = make_optimizer(model, weight_decay)
    _out(model, x).float().pow(2).mean().backward()
    opt.step()
    return model


@pytest.mark.slow
def test_a_plain_trainer_timm_s_factory_and_param_groups_leave_m_undecayed(tmp_path):
    """M is named `bias`, which the usual optimiser builders never decay: a plain transformers.Trainer (no subclass),
    timm's create_optimizer_v2 and torch's AdamW over mp.param_groups, run with weight decay 0.1, move M exactly as
    with no decay (it moves by its gradient alone) while the weight matrices are decayed."""
    tf, timm_optim = _extra("transformers"), _extra("timm.optim")
    gpt2, ids, n = _hf("gpt2")
    retrofit.add_mask_prior(gpt2, logits=mp.causal_distance_logits(n, 4))

    def trainer(model, wd):
        args = tf.TrainingArguments(output_dir=str(tmp_path / "hf"), weight_decay=wd, learning_rate=1e-2,
                                    report_to=[], use_cpu=True)
        t = tf.Trainer(model=model, args=args)
        t.create_optimizer()
        return t.optimizer
    vit, pixels, m = _timm()
    retrofit.add_mask_prior(vit, mp.banded_pattern(m, 1))
    builders = [(trainer, gpt2, ids), (lambda model, wd: timm_optim.create_optimizer_v2(model, "adamw", lr=1e-2,
                                                                                        weight_decay=wd), vit, pixels),
                (lambda model, wd: torch.optim.AdamW(mp.param_groups(model, wd), lr=1e-2), gpt2, ids)]
    for make, model, x in builders:
        decayed, plain = _one_step(make, model, x, 0.1), _one_step(make, model, x, 0.0)
        for a, b, start in zip(mp.mask_priors(decayed), mp.mask_priors(plain), mp.mask_priors(model)):
            assert torch.equal(a.bias, b.bias) and not torch.equal(a.bias, start.bias)    # moved, by its gradient
        weights = [name for name, p in model.named_parameters() if p.dim() == 2 and "weight" in name]
        assert not torch.equal(decayed.get_parameter(weights[-1]), plain.get_parameter(weights[-1]))


@pytest.mark.slow
def test_the_trainer_callback_logs_the_priors_mass_and_drift_at_each_logging_step(tmp_path):
    """Issue 75: MaskPriorCallback puts the prior's mass on its pattern, content margin and M's drift (train.py's
    measures, averaged over layers) into a plain Trainer's log history: drift 0 at the step training starts from, the
    same mass as mp.prior_mass there, and every step's values finite, the drift grown after three steps."""
    tf = _extra("transformers")
    model, ids, n = _hf("gpt2")
    pattern = mp.banded_pattern(n, 2) & mp.causal_pattern(n)
    retrofit.add_mask_prior(model, pattern)
    mass = mp.prior_mass(model, ids, pattern)
    args = tf.TrainingArguments(output_dir=str(tmp_path), max_steps=3, logging_steps=1, learning_rate=1e-2,
                                per_device_train_batch_size=2, report_to=[], use_cpu=True, save_strategy="no")
    trainer = tf.Trainer(model=model.train(), args=args, train_dataset=[{"input_ids": x, "labels": x} for x in ids],
                         callbacks=[retrofit.MaskPriorCallback(ids, pattern)])
    trainer.train()
    keys = ("prior_mass", "content_margin", "mask_drift")
    first, *steps = [rec for rec in trainer.state.log_history if "prior_mass" in rec]
    assert first["step"] == 0 and first["mask_drift"] == 0 and first["prior_mass"] == pytest.approx(sum(mass) / 2)
    assert [rec["step"] for rec in steps if "loss" in rec] == [1, 2, 3]
    assert all(math.isfinite(rec[k]) for rec in [first, *steps] for k in keys) and steps[-1]["mask_drift"] > 0


def test_a_plain_adamw_over_a_retrofitted_model_is_refused_before_it_decays_m():
    """Issue 65's case: `AdamW(model.parameters(), weight_decay=0.1)` on a retrofitted nn.TransformerEncoder (and
    on a deepcopy of it, whose priors were never built) is one line on its first step, M as it was."""
    enc = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                      enable_nested_tensor=False)
    retrofit.add_mask_prior(enc, mp.banded_pattern(5, 1))
    for model in (enc, copy.deepcopy(enc)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        model(torch.randn(3, 5, 8)).sum().backward()
        start = [p.bias.detach().clone() for p in mp.mask_priors(model)]
        with pytest.raises(ValueError, match=r"^AdamW: param group 0 decays M of 2 prior\(s\) \(layers.0.self_attn"):
            opt.step()
        assert all(torch.equal(p.bias, s) for p, s in zip(mp.mask_priors(model), start))


@pytest.mark.parametrize("name", ["encoder", "gpt2"])
def test_an_optimiser_made_before_add_mask_prior_is_told_m_will_not_train(name):
    """Issue 73: an optimiser made before add_mask_prior holds the layers' weights but never M; its first step says so
    in one warning (M as it was), and says it once; one made after (or holding M) says nothing, nor does one over
    another model's weights only."""
    if name == "gpt2":
        model, x, n = _hf("gpt2")
        attach = lambda m: retrofit.add_mask_prior(m, logits=mp.causal_distance_logits(n, 4))  # noqa: E731
    else:
        model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                           enable_nested_tensor=False)
        x = torch.randn(3, 5, 8)
        attach = lambda m: retrofit.add_mask_prior(m, mp.banded_pattern(5, 1))  # noqa: E731
    other = copy.deepcopy(model)
    before, elsewhere = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(other.parameters(), lr=1e-2)
    attach(model)
    _out(model, x).float().sum().backward()
    start = [p.bias.detach().clone() for p in mp.mask_priors(model)]
    with pytest.warns(UserWarning, match=r"^Adam holds the weights of 2 layer\(s\) but not their trainable M .* will "
                                         r"not train: make the optimiser after add_mask_prior"):
        before.step()
    assert all(torch.equal(p.bias, s) for p, s in zip(mp.mask_priors(model), start))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        before.step()                                         # said once
        torch.optim.Adam(model.parameters(), lr=1e-2).step()
        _out(other, x).float().sum().backward()
        elsewhere.step()


def test_a_whole_clip_gives_each_tower_its_own_token_count_and_both_take_a_prior():
    """Issue 75: in a whole CLIPModel the text tower's layers are read at the text model's positions and the vision
    tower's at its grid (the vision count reached the text tower, which then could take no prior); each tower takes
    its own prior, and both change their tower's outputs."""
    clip, x, _ = _clip()
    x["input_ids"] = torch.randint(1, 50, (2, 20))
    sites = {s.name.split(".")[0]: (s.tokens, s.max_tokens) for s in retrofit.find_attention(clip)}
    assert sites == {"text_model": (None, 24), "vision_model": (17, None)}
    plain = clip(**x)
    for tower, n in (("text_model", 24), ("vision_model", 17)):
        retrofit.add_mask_prior(clip, logits=_diagonal(n), param="full",
                                modules=lambda name, m, t=tower: name.startswith(t) and name.endswith("self_attn"))
    out = clip(**x)
    for tower in ("text_model_output", "vision_model_output"):
        assert (out[tower].last_hidden_state - plain[tower].last_hidden_state).abs().max() > 1e-3


def test_a_model_built_eager_reloads_with_the_dispatch_transformers_gives(tmp_path):
    """Issue 75: a model built with attn_implementation='eager' and saved with its prior reloads (retrofit's
    from_pretrained) with transformers' default dispatch, as transformers' own reload does (it was pinned to the
    saved one), the same outputs to rounding; asked for 'eager', it is eager again, bit for bit."""
    tf = _extra("transformers")
    model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_head=4, n_embd=32, vocab_size=64, n_positions=16,
                                             attn_implementation="eager")).eval()
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(16, 4))
    x = torch.randint(0, 64, (2, 12))
    model.save_pretrained(tmp_path)
    back = retrofit.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path)).eval()
    eager = retrofit.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path), attn_implementation="eager").eval()
    assert back.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    torch.testing.assert_close(_out(back, x), _out(model, x), atol=1e-5, rtol=1e-5)
    assert torch.equal(_out(eager, x), _out(model, x))


@cuda
def test_flex_attention_serves_a_retrofitted_gpt2_on_cuda_as_sdpa_does():
    """add_mask_prior(..., flex=True): a Hugging Face layer's plain self-attention calls run M inside flex_attention on
    CUDA (an attention-interface function); outputs and every gradient are the SDPA path's (float32)."""
    ref, x, n = _hf("gpt2")
    flex = copy.deepcopy(ref)
    for model, use_flex in ((ref, False), (flex, True)):
        retrofit.add_mask_prior(model.cuda(), logits=mp.causal_distance_logits(n, 4), flex=use_flex)
    x = x.cuda()
    a, b = ref(x).logits, flex(x).logits
    torch.testing.assert_close(b, a, atol=2e-4, rtol=2e-4)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(ref.named_parameters(), flex.parameters()):
        torch.testing.assert_close(q.grad, p.grad, atol=2e-3, rtol=2e-3, msg=name)


def _twin_encoder(ours: "mp.Transformer") -> nn.TransformerEncoder:
    """nn.TransformerEncoder (pre-LN, GELU, batch first) holding our Transformer's block weights."""
    cfg = ours.cfg
    layer = nn.TransformerEncoderLayer(cfg.dim, cfg.n_heads, cfg.mlp_dim, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
    enc = nn.TransformerEncoder(layer, cfg.n_layers, norm=nn.LayerNorm(cfg.dim), enable_nested_tensor=False)
    with torch.no_grad():
        for blk, lay in zip(ours.blocks, enc.layers):
            lay.self_attn.in_proj_weight.copy_(blk.attn.qkv.weight)
            lay.self_attn.in_proj_bias.copy_(blk.attn.qkv.bias)
            lay.self_attn.out_proj.load_state_dict(blk.attn.proj.state_dict())
            lay.norm1.load_state_dict(blk.ln1.state_dict())
            lay.norm2.load_state_dict(blk.ln2.state_dict())
            lay.linear1.load_state_dict(blk.mlp[0].state_dict())
            lay.linear2.load_state_dict(blk.mlp[3].state_dict())
        enc.norm.load_state_dict(ours.ln_f.state_dict())
    return enc


@pytest.mark.parametrize("fused", [True, False])
def test_transformer_encoder_with_add_mask_prior_equals_our_transformer(fused):
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=12, n_layers=2, n_heads=4, dim=32, mlp_dim=64, readout="tokens",
                               n_outputs=5, qkv_bias=True, learnable_mask=True, fused=fused)
    torch.manual_seed(0)
    ours = mp.Transformer(cfg)
    enc = _twin_encoder(ours)
    m = torch.randn(4, 12, 12)                                   # any M, the same in both
    mp.init_mask_(ours, logits=m)
    priors = list(retrofit.add_mask_prior(enc, logits=m).values())
    assert len(priors) == 2 and len(mp.mask_priors(enc)) == 2
    x = ours.embed(torch.randint(0, 5, (3, 12))).detach()
    a, b = ours.ln_f(ours.blocks[1](ours.blocks[0](x)[0])[0]), enc(x)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)      # measured: max |diff| 0 (fused), 3.6e-7 (explicit)
    r = torch.randn(a.shape, generator=torch.Generator().manual_seed(1))
    (a * r).sum().backward()
    (b * r).sum().backward()
    for blk, prior in zip(ours.blocks, priors):                  # |dL/dM| up to about 0.2; measured diff <= 4e-8
        assert prior.bias.grad.abs().max() > 0.05
        torch.testing.assert_close(blk.attn.prior.bias.grad, prior.bias.grad, atol=1e-6, rtol=1e-4)
    enc.eval()
    ours.eval()
    with torch.no_grad():                                        # PyTorch's encoder fast path would skip the mask
        torch.testing.assert_close(enc(x), ours.ln_f(ours.blocks[1](ours.blocks[0](x)[0])[0]), atol=1e-5, rtol=1e-5)
        h = ours.blocks[0].ln1(x)
        _, w = enc.layers[0].self_attn(h, h, h)                  # need_weights=True: weights with the prior
        _, ref = ours.blocks[0].attn(h, True)
        torch.testing.assert_close(w, ref.mean(1), atol=1e-5, rtol=1e-4)


def test_causal_calls_keep_the_prior():
    """nn.MultiheadAttention drops an attn_mask it takes for the causal mask when is_causal=True; the hook folds
    the -inf into the prior's bias instead, so a causal encoder equals our causal Transformer."""
    cfg = mp.TransformerConfig(vocab_size=5, seq_len=10, n_layers=2, n_heads=2, dim=16, mlp_dim=32, readout="tokens",
                               n_outputs=5, qkv_bias=True, learnable_mask=True, causal=True)
    torch.manual_seed(1)
    ours = mp.Transformer(cfg)
    enc = _twin_encoder(ours)
    m = _past(torch.randn(2, 10, 10) * 3)
    mp.init_mask_(ours, logits=m)
    retrofit.add_mask_prior(enc, logits=m)
    x = ours.embed(torch.randint(0, 5, (2, 10))).detach()
    causal = nn.Transformer.generate_square_subsequent_mask(10)
    torch.testing.assert_close(enc(x, mask=causal, is_causal=True), ours.ln_f(ours.blocks[1](ours.blocks[0](x)[0])[0]),
                               atol=1e-5, rtol=1e-5)


def test_mask_prior_bad_input_names_the_module_and_shapes():
    with pytest.raises(ValueError, match="sequence length 5 does not fit the mask size 6"):
        mp.MaskPrior(6, 2)(5)
    with pytest.raises(ValueError, match=r"shape \(3, 6, 6\) does not fit a layer with 2 heads"):
        mp.MaskPrior(6, 2, pattern=torch.ones(3, 6, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="Sequential holds no nn.MultiheadAttention"):
        retrofit.add_mask_prior(nn.Sequential(nn.Linear(4, 4)), mp.banded_pattern(4, 1))
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"layers.0.self_attn \(MultiheadAttention, 2 heads\) does not fit a pattern "
                                         r"of shape \(3, 4, 4\)"):
        retrofit.add_mask_prior(enc, torch.ones(3, 4, 4, dtype=torch.bool))
    retrofit.add_mask_prior(enc, mp.banded_pattern(4, 1))
    with pytest.raises(ValueError, match="already has a MaskPrior"):
        retrofit.add_mask_prior(enc, mp.banded_pattern(4, 1))
    with pytest.raises(ValueError, match="sequence length 5 does not fit the mask size 4"):
        enc(torch.randn(2, 5, 8))
    mha = enc.layers[0].self_attn
    with pytest.raises(ValueError, match="keys are not its queries \\(4 queries, 3 keys\\)"):
        mha(torch.randn(2, 4, 8), torch.randn(2, 3, 8), torch.randn(2, 3, 8))


def test_a_retrofitted_encoder_trains_parity2_and_moves_m():
    task = tasks.make_task("parity2", readout="mean").setup()
    torch.manual_seed(0)
    emb, pos = nn.Embedding(2, 32), nn.Parameter(torch.randn(1, 15, 32) * 0.02)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True, norm_first=True),
                                2, enable_nested_tensor=False)
    head = nn.Linear(32, 1)
    priors = list(retrofit.add_mask_prior(enc, task.pattern()).values())
    model = nn.ModuleList([emb, enc, head])
    start = mp.prior_snapshot(model)
    opt = torch.optim.Adam(mp.param_groups(model, 0.0) + [{"params": [pos]}], lr=3e-3)
    losses = []
    for step in range(40):
        x, y = task.train_batch(step, 64)
        loss = F.mse_loss(head(enc(emb(x) + pos).mean(1)).squeeze(-1), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    drift = mp.prior_drift(model, start)
    assert sum(losses[-10:]) < 0.7 * sum(losses[:10])
    assert len(drift["mask_drift"]) == 2 and all(d > 0 for d in drift["mask_drift"]) and drift["qk_drift"] == []
    assert all(p.bias.grad is not None for p in priors)


# What the retrofit tests run, by the names the builders below take; the README's table of models is made from
# these lists (test_readme_table_of_models_is_what_the_tests_run), so it lists what is tested and nothing else.
HF_MODELS = ["gpt2", "bert", "vit", "llama", "mistral", "gemma2", "clip-text", "clip-vision", "swin"]


HF_CAUSAL = ("gpt2", "llama", "mistral", "gemma2")


SEQ2SEQ = ["bart", "t5", "whisper", "marian"]


LEFT_PADDED = ["gpt2", "mistral", "gemma2"]


TIMM_MODELS = ["vit_tiny_patch16_224", "deit_tiny_distilled_patch16_224"]


UNREACHABLE = ["**kwargs", "deberta-v2", "pit", "crossvit", "swin"]


SHOWN = {
    "gpt2": "GPT-2",
    "bert": "BERT",
    "vit": "ViT",
    "llama": "Llama",
    "mistral": "Mistral",
    "gemma2": "Gemma2",
    "clip-text": "CLIP text",
    "clip-vision": "CLIP vision",
    "swin": "Swin",
    "bart": "BART",
    "t5": "T5",
    "whisper": "Whisper",
    "marian": "Marian",
    "vit_tiny_patch16_224": "ViT",
    "deit_tiny_distilled_patch16_224": "DeiT (distilled)",
    "**kwargs": "a forward that takes the mask only as `**kwargs`",
    "deberta-v2": "DeBERTa-v2 (its own softmax)",
    "pit": "timm PiT",
    "crossvit": "CrossViT (pooled stages, branches)",
}


def _hf(name: str):
    """A small Hugging Face model (random weights, nothing downloaded) and an input for it, with the prior's N."""
    tf = _extra("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=50, bos_token_id=0,
                            eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg).eval(), torch.randint(1, 50, (2, 20)), 24
    if name == "llama":
        cfg = tf.LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                             intermediate_size=64, max_position_embeddings=64, vocab_size=50, bos_token_id=0,
                             eos_token_id=0, pad_token_id=0)
        return tf.LlamaForCausalLM(cfg).eval(), torch.randint(1, 50, (2, 20)), 24
    if name == "bert":
        cfg = tf.BertConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                            max_position_embeddings=64, vocab_size=50, hidden_dropout_prob=0.0,
                            attention_probs_dropout_prob=0.0)
        return tf.BertModel(cfg).eval(), torch.randint(1, 50, (2, 20)), 20
    if name in ("mistral", "gemma2"):                   # a sliding window of 4, shorter than the input
        common = dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8,
                      intermediate_size=64, max_position_embeddings=64, vocab_size=50, sliding_window=4,
                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = tf.MistralForCausalLM(tf.MistralConfig(**common)) if name == "mistral" else \
            tf.Gemma2ForCausalLM(tf.Gemma2Config(**common))          # Gemma2: eager, logit soft-capping
        return model.eval(), torch.randint(1, 50, (2, 20)), 24
    if name == "clip-text":                             # CLIP's attention names its scale `scale`
        cfg = tf.CLIPTextConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=4, max_position_embeddings=24, attention_dropout=0.0)
        return tf.CLIPTextModel(cfg).eval(), torch.randint(1, 50, (2, 20)), 24
    if name == "clip-vision":
        cfg = tf.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  image_size=32, patch_size=8, attention_dropout=0.0)
        return tf.CLIPVisionModel(cfg).eval(), torch.randn(2, 3, 32, 32), 17           # 16 patches + CLS
    if name == "swin":                                  # 4 x 4 windows: the prior is a window's, 16 tokens
        cfg = tf.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[4, 4], window_size=4,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)
        return tf.SwinModel(cfg).eval(), torch.randn(2, 3, 32, 32), 16
    cfg = tf.ViTConfig(num_hidden_layers=2, num_attention_heads=4, hidden_size=32, intermediate_size=64,
                       image_size=32, patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tf.ViTModel(cfg).eval(), torch.randn(2, 3, 32, 32), 17                   # 16 patches + CLS


def _clip():
    """A whole CLIPModel (both towers), its input (12 tokens of the text tower's 24 positions, an image of 16 patches
    + CLS) and the N one prior serves both towers at: the vision tower's 17 tokens, the text tower's first 12."""
    tf = _extra("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = tf.CLIPConfig(text_config=dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, max_position_embeddings=24, attention_dropout=0.0),
                        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, image_size=32, patch_size=8, attention_dropout=0.0))
    x = dict(input_ids=torch.randint(1, 50, (2, 12)), pixel_values=torch.randn(2, 3, 32, 32))
    return tf.CLIPModel(cfg).eval(), x, 17


def _eager(name: str):
    """A transformers model built as a user asks for eager attention: from_config(..., attn_implementation='eager')."""
    tf = _extra("transformers")
    model, x, n = _hf(name)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval(), x, n


def _out(model, x):
    y = model(x)
    return y if isinstance(y, torch.Tensor) else y[0]


def _prior_works(model, x, n, plain, priors):
    """`plain`: the model's output before the priors. M = +30 everywhere (log sigmoid = -1e-13) gives it
    again; a random M changes it, every M gets a gradient, and three Adam steps (M undecayed) move every M."""
    for p in priors.values():
        p.set_logits(torch.full((n, n), 30.0))
    torch.testing.assert_close(_out(model, x), plain, atol=2e-5, rtol=1e-5)      # measured: <= 6e-7
    gen = torch.Generator().manual_seed(1)
    for p in priors.values():
        m = torch.randn(p.heads, n, n, generator=gen) * 3
        p.set_logits(_past(m) if p.causal else m)
    start = [p.bias.detach().clone() for p in priors.values()]
    assert (_out(model, x) - plain).abs().max() > 1e-3                            # measured: 0.009 (BERT) .. 0.45
    opt = torch.optim.Adam(mp.param_groups(model, 0.05), lr=1e-2)
    r = torch.randn(plain.shape, generator=gen)
    for step in range(3):
        opt.zero_grad()
        (_out(model, x).float() * r).sum().backward()
        if step == 0:
            assert all(p.bias.grad is not None and p.bias.grad.abs().max() > 0 for p in priors.values())
        opt.step()
    assert all((p.bias - s).abs().max() > 1e-3 for p, s in zip(priors.values(), start))
    decay = {id(q) for q in opt.param_groups[0]["params"]}
    assert not any(id(p.bias) in decay for p in priors.values())


@pytest.mark.parametrize("name", HF_MODELS)
def test_hugging_face_models_take_a_prior_per_layer(name):
    model, x, n = _hf(name)
    plain, impl = _out(model, x).detach(), model.config._attn_implementation
    band = mp.banded_pattern(n, 2) & (mp.causal_pattern(n) if name in HF_CAUSAL else True)
    priors = retrofit.add_mask_prior(model, band, param="full")
    layers = [m for m in model.modules() if hasattr(m, "mask_prior")]
    assert len(priors) == 2 and [p for p in priors.values()] == [m.mask_prior for m in layers]
    assert priors[next(iter(priors))] is not priors[list(priors)[1]]            # per layer, not one shared mask
    assert all(p.causal == (name in HF_CAUSAL) for p in priors.values())
    assert all(m.config._attn_implementation == retrofit.HF_ATTENTION for m in layers)         # each layer's view
    assert model.config._attn_implementation == impl and not hasattr(model.config, "mask_prior")   # nothing in
    assert list(retrofit.prior_record(model)["layers"]) == list(priors)          # the shared config: the model's record
    _prior_works(model, x, n, plain, priors)


def _timm(name: str = "vit_tiny_patch16_224", **kw):
    timm = _extra("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, img_size=32, patch_size=8, depth=2, **kw).eval()
    return model, torch.randn(2, 3, 32, 32), model.patch_embed.num_patches + model.num_prefix_tokens


@pytest.mark.parametrize("name", TIMM_MODELS)
def test_timm_vits_take_a_prior_per_layer(name):
    model, x, n = _timm(name)
    plain = _out(model, x).detach()
    priors = retrofit.add_mask_prior(model, mp.banded_pattern(n, 2))
    assert list(priors) == ["blocks.0.attn", "blocks.1.attn"] and all(p.n == n for p in priors.values())
    _prior_works(model, x, n, plain, priors)


@pytest.mark.parametrize("name", ["timm", "vit"])
def test_a_vit_of_timm_or_hugging_face_takes_a_grid_prior_that_serves_as_the_full_m_and_saves(name, tmp_path):
    """param='grid' on timm's and Hugging Face's ViT (the patch grid read off the model): one logit per head and
    displacement plus the class token's row and column, the same outputs as a full M from the same soft-bump
    logits (which depend on the displacement alone), the prior's usual behaviour (`_prior_works`'s steps), and a
    Hugging Face save loads it back as a grid. At 224 px, timm's ViT-Tiny gains 0.71% where a full M adds 24%."""
    model, x, n = _timm() if name == "timm" else _hf(name)
    heads = 3 if name == "timm" else 4
    soft = mp.soft_offset_logits(4, 4, mp.IMPULSE_OFFSETS[:heads], 0.5, 5.0, 5.0, n_prefix=1)
    full = copy.deepcopy(model)
    retrofit.add_mask_prior(full, logits=soft, param="full")
    priors = retrofit.add_mask_prior(model, logits=soft, param="grid")
    assert all(p.grid == (4, 4) and p.bias.shape == (heads, mp.grid_slots(4, 4, 1)) for p in priors.values())
    torch.testing.assert_close(_out(model, x), _out(full, x), atol=1e-5, rtol=1e-5)
    if name == "vit":
        model.save_pretrained(tmp_path / "grid")
        back = retrofit.from_pretrained(type(model), tmp_path / "grid")
        assert [p.grid for p in mp.mask_priors(back)] == [(4, 4)] * 2
        torch.testing.assert_close(_out(back.eval(), x), _out(model, x))
    else:
        big = _extra("timm").create_model("vit_tiny_patch16_224", pretrained=False)
        own = sum(p.numel() for p in big.parameters())
        grid = retrofit.add_mask_prior(big, logits=mp.soft_offset_logits(14, 14, mp.IMPULSE_OFFSETS[:3], 0.5, 5.0,
                                                                         5.0, n_prefix=1), param="grid")
        assert sum(p.bias.numel() for p in grid.values()) / own < 0.01 < 0.24 < 12 * 3 * 197 ** 2 / own
    plain = _out(full if name == "timm" else _hf(name)[0], x).detach()
    retrofit.remove_mask_prior(full) if name == "timm" else None
    plain = _out(full, x).detach() if name == "timm" else plain
    for p in priors.values():
        p.set_logits(torch.full((n, n), 30.0))
    torch.testing.assert_close(_out(model, x), plain, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["timm", "vit"])
def test_a_vit_given_an_image_of_another_size_is_served_by_the_grid_prior_its_refusal_names(name):
    """Issue 75: a timm ViT with dynamic_img_size (or Hugging Face's with interpolate_pos_encoding) given an image of
    another size was told to use prefix=True (right-padded text). A full prior refuses it in one line naming
    param='grid'; that call, run here, serves images of any size: each pair of patches reads its displacement's logit
    (on a smaller grid as on the prior's own, one past the prior's grid its last), a class token's row and column the
    nearest patch's, and M trains through it."""
    kw = {} if name == "timm" else {"interpolate_pos_encoding": True}
    model, x, n = _timm(dynamic_img_size=True) if name == "timm" else _hf(name)
    retrofit.add_mask_prior(model, mp.banded_pattern(n, 1))
    for size, tokens in ((24, 10), (48, 37)):
        with pytest.raises(ValueError, match=rf"^\w+\.0\.att\w*: this image gives {tokens} tokens .* e.g. ") as err:
            _run(model, torch.randn(1, 3, size, size), **kw)
    model, x, n = _timm(dynamic_img_size=True) if name == "timm" else _hf(name)
    plain = _out(model, x).detach()
    eval(_one_line(err).rpartition("e.g. ")[2], {"add_mask_prior": retrofit.add_mask_prior, "model": model,
                                                 "pattern": mp.banded_pattern(n, 1)})
    prior = mp.mask_priors(model)[0]
    torch.nn.init.normal_(prior.bias, std=3.0)
    torch.testing.assert_close(retrofit._grid_bias(prior, (4, 4), n), prior(n), atol=0, rtol=0)
    small, big, own = retrofit._grid_bias(prior, (3, 3), 10), retrofit._grid_bias(prior, (6, 6), 37), prior(n)
    sub = [1 + 4 * r + c for r in range(3) for c in range(3)]                  # the top-left 3 x 3 of the 4 x 4
    assert torch.equal(small[:, 1:, 1:], own[:, sub][:, :, sub]) and torch.equal(small[:, 0, 0], own[:, 0, 0])
    assert torch.equal(big[:, 1, 36], own[:, 1, 16]) and torch.equal(big[:, 36, 1], own[:, 16, 1])   # (5, 5): (3, 3)
    assert (_out(model, x) - plain).abs().max() > 1e-3
    for size in (24, 48):
        out = _run(model, torch.randn(2, 3, size, size), **kw)
        assert torch.isfinite(out).all()
        prior.bias.grad = None
        out.square().mean().backward()
        assert prior.bias.grad.abs().max() > 0
    # the hook that reads each image's grid scripts (a no-op there): TorchScript compiles a module's hooks with it,
    # as timm's own test_model_forward_fx_torchscript does for the patch projection an fx trace keeps
    conv = next(m for m in model.modules() if isinstance(m, nn.Conv2d))
    assert torch.equal(torch.jit.script(conv)(torch.ones(1, 3, 8, 8)), conv(torch.ones(1, 3, 8, 8)))


def test_param_grid_on_a_model_that_names_no_patch_grid_asks_for_grid_in_one_line():
    """nn.TransformerEncoder names no patch grid: param='grid' without grid= is one line, the model unchanged;
    with grid=(2, 4) its 8 tokens are a 2 x 4 grid."""
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"^add_mask_prior: param='grid' .* give grid=\(grid_h, grid_w\); no layer "
                                         r"was changed$"):
        retrofit.add_mask_prior(enc, mp.banded_pattern(8, 1), param="grid")
    assert not mp.mask_priors(enc)
    priors = retrofit.add_mask_prior(enc, mp.banded_pattern(8, 1), param="grid", grid=(2, 4))
    assert [p.bias.shape for p in priors.values()] == [(2, mp.grid_slots(2, 4))]


@pytest.mark.parametrize("name", ["timm", "vit"])
def test_the_impulse_init_writes_into_a_timm_or_hugging_face_vit_through_its_qk_view(name):
    """`retrofit.qk_view` hands the QK inits a timm or Hugging Face ViT: init_qk_svd_ at pos_scale 18 and the
    mimetic V-proj (the `impulse` recipe) write the layer's own weights: its query and key of the scaled
    positional pseudo input, read straight from the layer, give the attention mass on the impulse pattern the init
    reports, far above the drawn weights' (head_dim 64: nearly all; the Hugging Face toy's head_dim 8: 0.7)."""
    model, x, n = _timm() if name == "timm" else _hf(name)
    heads = 3 if name == "timm" else 4
    pat = mp.impulse_pattern(4, 4, mp.IMPULSE_OFFSETS[:heads], n_prefix=1)
    view = retrofit.qk_view(model)
    before = float(mp.pattern_mass(mp.pseudo_attention(view.sites[0], mp.pseudo_input(view)).unsqueeze(0), pat))
    report = mp.init_qk_svd_(view, pat, pos_scale=18.0, generator=torch.Generator().manual_seed(0))
    report.update(mp.init_mimetic_(view, qk=None, vo=(0.4, 0.4), generator=torch.Generator().manual_seed(0)))
    assert before < 0.2 and min(report["pseudo_mass"]) > (0.99 if name == "timm" else 0.6)
    assert report["vo_truncation_error"] == [0.0, 0.0]
    layer = model.blocks[1] if name == "timm" else model.layers[1]
    attn, norm = (layer.attn, layer.norm1) if name == "timm" else (layer.attention, layer.layernorm_before)
    pos = norm(view.pos_emb[0]).detach()
    dim = pos.shape[-1]
    q, k = ((attn.qkv(pos)[:, :dim], attn.qkv(pos)[:, dim:2 * dim]) if name == "timm"
            else (attn.q_proj(pos), attn.k_proj(pos)))
    q, k = (t.view(n, heads, -1).transpose(0, 1) for t in (q, k))
    a = (q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])).softmax(-1)
    assert float(mp.pattern_mass(a.unsqueeze(0).detach(), pat)) == pytest.approx(report["pseudo_mass"][1], abs=1e-4)
    with pytest.raises(ValueError, match=r"^qk_view: layers.0.self_attn \(MultiheadAttention\) is not a pre-LN"):
        retrofit.qk_view(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1))


def test_a_nanogpt_style_attention_takes_a_prior_through_its_mask_keyword():
    class NoKeyword(nn.Module):
        n_head = 4

        def forward(self, x):
            return x

    model, x, _ = _nanogpt()
    plain = model(x).detach()                                 # is_causal=True without a mask
    priors = retrofit.add_mask_prior(
        model, mp.causal_pattern(12), causal=True, modules=CausalSelfAttention, param="full"
    )
    assert list(priors) == ["0", "2"] and all(p.causal and p.heads == 4 for p in priors.values())
    _prior_works(model, x, 12, plain, priors)
    picked = retrofit.add_mask_prior(nn.Sequential(CausalSelfAttention()), mp.causal_pattern(12), causal=True,
                               modules=lambda name, m: name == "0")
    assert list(picked) == ["0"]
    with pytest.raises(ValueError, match=r"0 \(NoKeyword, 4 heads\) names no `attn_mask` parameter in its forward"):
        retrofit.add_mask_prior(nn.Sequential(NoKeyword()), mp.causal_pattern(12), modules=NoKeyword)


def test_nn_transformer_self_attention_gets_the_prior_and_cross_attention_only_when_asked():
    torch.manual_seed(0)
    model = nn.Transformer(32, 4, 2, 2, 64, dropout=0.0, batch_first=True)
    src, tgt = torch.randn(2, 10, 32), torch.randn(2, 7, 32)
    enc = retrofit.add_mask_prior(model.encoder, mp.banded_pattern(10, 1))
    dec = retrofit.add_mask_prior(model.decoder, mp.banded_pattern(7, 1) & mp.causal_pattern(7), causal=True)
    assert list(enc) == ["layers.0.self_attn", "layers.1.self_attn"]
    assert list(dec) == ["layers.0.self_attn", "layers.1.self_attn"]           # multihead_attn (cross) left alone
    assert not any(hasattr(layer.multihead_attn, "mask_prior") for layer in model.decoder.layers)
    y = model(src, tgt)                                                        # unequal lengths: cross-attention free
    cross = retrofit.add_mask_prior(model.decoder, torch.rand(4, 7, 10) > 0.5, cross_attention=True)
    assert list(cross) == ["layers.0.multihead_attn", "layers.1.multihead_attn"]
    assert cross["layers.0.multihead_attn"].bias.shape == (4, 7, 10)
    assert (model(src, tgt) - y).abs().max() > 1e-3
    whole = nn.Transformer(32, 4, 1, 1, 64, batch_first=True)
    assert list(retrofit.add_mask_prior(whole, mp.banded_pattern(8, 1))) == ["encoder.layers.0.self_attn",
                                                                      "decoder.layers.0.self_attn"]
    with pytest.raises(ValueError, match="holds only self-attention"):
        retrofit.add_mask_prior(nn.TransformerEncoderLayer(32, 4, batch_first=True), torch.ones(4, 4, dtype=torch.bool),
                          cross_attention=True)


def test_a_self_attention_prior_called_as_cross_attention_is_refused():
    """A layer the library cannot tell from its place (an nn.MultiheadAttention named plainly) gets a
    self-attention prior; called with keys that are not its queries, even of the same length, it refuses."""
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, x, memory=None):
            kv = x if memory is None else memory
            return self.attn(x, kv, kv)[0]

    model = Mixer()
    retrofit.add_mask_prior(model, mp.banded_pattern(6, 1))
    model(torch.randn(2, 6, 16))
    with pytest.raises(ValueError, match=r"attn: a self-attention prior, but this call's keys are not its queries"):
        model(torch.randn(2, 6, 16), torch.randn(2, 6, 16))


def test_add_mask_prior_checks_every_layer_before_changing_any():
    class TwoWidths(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.MultiheadAttention(16, 4, batch_first=True)
            self.b = nn.MultiheadAttention(16, 2, batch_first=True)

    model = TwoWidths()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"^add_mask_prior: b \(MultiheadAttention, 2 heads\) does not fit a pattern "
                                         r"of shape \(4, 6, 6\): give \(N, N\) or \(2, N, N\); no layer was changed$"):
        retrofit.add_mask_prior(model, torch.ones(4, 6, 6, dtype=torch.bool))
    assert not mp.mask_priors(model) and not model.a._forward_pre_hooks and not hasattr(model.a, "mask_prior")
    assert model.state_dict().keys() == before.keys()
    assert list(retrofit.add_mask_prior(model, mp.banded_pattern(6, 1))) == ["a", "b"]      # a corrected retry works
    vit, _, n = _timm()
    with pytest.raises(ValueError, match=rf"blocks.0.attn \(Attention, 3 heads\) sees {n} tokens, but the pattern has "
                                         rf"shape \(16, 16\)"):
        retrofit.add_mask_prior(vit, mp.banded_pattern(16, 1))
    assert not mp.mask_priors(vit) and not vit.blocks[0].attn._forward_pre_hooks
    with pytest.raises(ValueError, match="Linear holds no nn.MultiheadAttention, Hugging Face or timm attention"):
        retrofit.add_mask_prior(nn.Linear(4, 4), mp.banded_pattern(4, 1))
    gpt2, _, _ = _hf("gpt2")
    with pytest.raises(ValueError, match=r"transformer.h.0.attn \(GPT2Attention, 4 heads\) is causal, but "
                                         r"causal=False was asked"):
        retrofit.add_mask_prior(gpt2, mp.banded_pattern(8, 1), causal=False)
    with pytest.raises(ValueError, match=r"has at most 64 positions, but the pattern has shape \(65, 65\)"):
        retrofit.add_mask_prior(gpt2, mp.causal_pattern(65))
    assert not mp.mask_priors(gpt2) and gpt2.config._attn_implementation == "sdpa"
    gpt2.config._attn_implementation = "flash_attention_2"          # a kernel that takes no bias
    with pytest.raises(ValueError, match="runs attn_implementation 'flash_attention_2', which cannot add a bias"):
        retrofit.add_mask_prior(gpt2, mp.causal_pattern(8))


@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "gemma2"])
def test_generate_with_a_kv_cache_equals_decoding_without_it(name):
    model, x, n = _hf(name)
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(n, 4) + torch.randn(4, n, n), param="full")
    prompt = x[:, :6]
    kw = dict(max_new_tokens=12, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    plain = model.generate(prompt, use_cache=False, **kw)
    for cache in ("dynamic", "static"):          # a static cache holds empty slots: the rows come from the positions
        cached = model.generate(prompt, use_cache=True, cache_implementation=cache, **kw)
        assert torch.equal(cached.sequences, plain.sequences), cache
        for a, b in zip(cached.logits, plain.logits):             # measured: max |diff| 6e-8
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    prior = mp.mask_priors(model)[0]
    assert prior(2, k_len=5).shape == (4, 2, 5)
    torch.testing.assert_close(prior(2, k_len=5), prior(5)[:, 3:])         # the cache's rows are the last ones
    with pytest.raises(ValueError, match=rf"(queries at positions {n} .. {n} with {n + 1} keys do|a query at position "
                                         rf"{n} does) not fit the mask size {n}"):
        model.generate(prompt, max_new_tokens=n, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("name", HF_CAUSAL)
def test_a_relative_prior_generates_past_its_n_with_the_kv_cache_as_without(name):
    """A relative prior of n = 8 distances in every retrofitted causal family: generation to 26 tokens (past n, and
    past Mistral's and Gemma2's sliding window of 4) gives the same tokens and logits with a dynamic or static KV
    cache as without one (measured: <= 3e-7), and distances past 7 read the table's last logit."""
    model, x, n = _hf(name)
    priors = retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(8, 4))
    with torch.no_grad():
        for p in priors.values():
            p.bias.add_(torch.randn(p.bias.shape, generator=torch.Generator().manual_seed(0)))
    assert all(p.param == "relative" and p.bias.shape == (4, 8) for p in priors.values())
    prompt = x[:, :6]
    kw = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    plain = model.generate(prompt, use_cache=False, **kw)
    assert plain.sequences.shape == (2, 26)
    for cache in ("dynamic", "static"):
        cached = model.generate(prompt, use_cache=True, cache_implementation=cache, **kw)
        assert torch.equal(cached.sequences, plain.sequences), cache
        for a, b in zip(cached.logits, plain.logits):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    p = next(iter(priors.values()))
    assert torch.equal(p(1, k_len=26)[:, 0, :18], p(1, k_len=26)[:, 0, :1].expand(4, 18))
    twin, _, _ = _hf(name)                                    # the same prior as a full M of 26 positions
    i = torch.arange(26)
    for (name_, q), r in zip(retrofit.add_mask_prior(twin, logits=torch.zeros(4, 26, 26), param="full").items(),
                             priors.values()):
        q.set_logits(r.bias.detach()[:, (i[:, None] - i[None, :]).clamp(0, 7)].masked_fill(mp.future_keys(26), -5.0))
    full = twin.generate(prompt, use_cache=True, **kw)
    assert torch.equal(full.sequences, plain.sequences)
    for a, b in zip(full.logits, plain.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_lengths_a_padded_text_batch_is_served_at_its_positions():
    bert, ids, n = _hf("bert")
    retrofit.add_mask_prior(bert, logits=torch.randn(4, n, n) * 3, param="full")
    short = ids[:1, :12]
    alone = bert(short).last_hidden_state                     # 12 < N tokens: positions 0..11 of the prior
    padded = torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], 1)
    mask = torch.cat([torch.ones(1, 12), torch.zeros(1, 4)], 1).long()
    torch.testing.assert_close(bert(padded, attention_mask=mask).last_hidden_state[:, :12], alone, atol=1e-5,
                               rtol=1e-5)
    left, at = padded.roll(4, 1), (mask.flip(1).cumsum(-1) - 1).clamp(min=0)    # left-padded, at the positions
    torch.testing.assert_close(bert(left, attention_mask=mask.flip(1), position_ids=at).last_hidden_state[:, 4:],
                               alone, atol=1e-5, rtol=1e-5)             # the model reads too: the prior follows them
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False)
    retrofit.add_mask_prior(enc, mp.banded_pattern(8, 1), prefix=True)
    assert enc(torch.randn(2, 5, 16)).shape == (2, 5, 16)   # prefix=True: positions 0..4


@pytest.mark.slow
def test_hugging_face_save_pretrained_gives_the_prior_back_and_a_plain_load_is_loud(tmp_path):
    tf = _extra("transformers")
    for name in ("gpt2", "vit"):
        model, x, n = _hf(name)
        retrofit.add_mask_prior(model, logits=_past(torch.randn(4, n, n) * 3), param="full")
        model.save_pretrained(tmp_path / name)
        config = json.load(open(tmp_path / name / "config.json"))
        assert config["attn_implementation"] == retrofit.HF_SAVED and len(config["mask_prior"]["layers"]) == 2
        back = retrofit.from_pretrained(type(model), str(tmp_path / name)).eval()
        assert type(back) is type(model)
        torch.testing.assert_close(_out(back, x), _out(model, x), atol=0, rtol=0)
        for a, b in zip(mp.mask_priors(back), mp.mask_priors(model)):
            assert torch.equal(a.bias, b.bias)
        half = retrofit.from_pretrained(type(model), str(tmp_path / name), dtype=torch.bfloat16)
        for a, b in zip(mp.mask_priors(half), mp.mask_priors(model)):          # bf16 weights, M float32 and exact
            assert a.bias.dtype == torch.float32 and torch.equal(a.bias, b.bias)
        with pytest.raises(ValueError, match="maskprior: load it with "                 # loading fails, in this
                                             "maskprior_retrofit.from_pretrained$"):       # process too, naming the fix
            type(model).from_pretrained(tmp_path / name)                    # (its runtime name is another)
    model, x, n = _hf("gpt2")                                 # the prior on the base model, saved with the head
    retrofit.add_mask_prior(model.transformer, logits=_past(torch.randn(4, n, n)), param="full")
    model.save_pretrained(tmp_path / "head")
    base = retrofit.from_pretrained(tf.GPT2Model, str(tmp_path / "head"))
    torch.testing.assert_close(base(x).last_hidden_state, model.transformer(x).last_hidden_state, atol=0, rtol=0)
    base.save_pretrained(tmp_path / "base")
    assert list(json.load(open(tmp_path / "base" / "config.json"))["mask_prior"]["layers"]) == ["h.0.attn", "h.1.attn"]
    again = retrofit.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path / "base"))
    assert [p.where for p in mp.mask_priors(again)] == ["transformer.h.0.attn", "transformer.h.1.attn"]
    plain = [subprocess.Popen([sys.executable, "-c", "import transformers as tf; tf.GPT2LMHeadModel.from_pretrained("
                               f"{str(tmp_path / 'gpt2')!r}, attn_implementation={impl})"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)      # processes that never import maskprior_retrofit,
             for impl in ("None", "'sdpa'")]                          # started at once
    for p in plain:
        err = p.communicate(timeout=120)[1]
        assert p.returncode != 0 and "maskprior_retrofit.from_pretrained" in err.strip().splitlines()[-1]
    plain_dir = tmp_path / "plain"
    tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=10)).save_pretrained(plain_dir)
    with pytest.raises(ValueError, match="records no mask prior"):
        retrofit.from_pretrained(tf.GPT2LMHeadModel, str(plain_dir))
    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "gpt2", broken)
    json.dump(config, open(broken / "config.json", "w"))                    # the ViT's record on GPT-2's weights
    with pytest.raises(ValueError, match="records a prior on layers.0.attention, which GPT2LMHeadModel does not have"):
        retrofit.from_pretrained(tf.GPT2LMHeadModel, str(broken))


def test_a_config_read_from_a_saved_folder_loads_it_with_its_priors(tmp_path):
    """The config an Auto class passes on, or a user reads and edits: from_pretrained(cls, path, config=AutoConfig.
    from_pretrained(path)) loads the priors (it was transformers' "neither a safetensors file" error, from the mark
    that refuses plain loads, which that config carries), and the caller's config keeps its mark."""
    tf = _extra("transformers")
    model, x, n = _hf("gpt2")
    retrofit.add_mask_prior(model, logits=_past(torch.randn(4, n, n) * 3), param="full")
    model.save_pretrained(tmp_path)
    config = tf.AutoConfig.from_pretrained(tmp_path)
    back = retrofit.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path), config=config).eval()
    torch.testing.assert_close(_out(back, x), _out(model, x), atol=0, rtol=0)
    assert config.transformers_weights == retrofit.HF_SAVED and len(mp.mask_priors(back)) == 2


def test_the_prior_follows_sdpa_and_eager_and_refuses_an_implementation_without_a_bias():
    """The priors wrap the model's own implementation, read at every call: set_attn_implementation between 'sdpa' and
    'eager' keeps the prior (the same output); one that cannot add a bias is refused at the next forward."""
    model, x, n = _hf("gpt2")
    m = _past(torch.randn(4, n, n) * 3)
    retrofit.add_mask_prior(model, logits=m, param="full")
    sdpa = _out(model, x)
    model.set_attn_implementation("eager")
    assert model.transformer.h[0].attn.config._attn_implementation == retrofit.HF_ATTENTION
    torch.testing.assert_close(_out(model, x), sdpa, atol=1e-5, rtol=1e-5)         # measured: 2e-7
    mp.mask_priors(model)[0].set_logits(torch.full((n, n), 30.0))
    assert (_out(model, x) - sdpa).abs().max() > 1e-3                              # under eager, M still acts
    model.config._attn_implementation = "flash_attention_2"                        # a kernel that takes no bias
    with pytest.raises(RuntimeError, match="transformer.h.0.attn: attn_implementation is now 'flash_attention_2', "
                                           "which cannot add the prior's bias"):
        model(x)
    eager, x, n = _hf("gpt2")
    eager.set_attn_implementation("eager")                    # chosen before: the priors wrap GPT-2's eager function
    retrofit.add_mask_prior(eager, logits=m, param="full")
    assert retrofit.prior_record(eager)["base"] == "eager"
    torch.testing.assert_close(_out(eager, x), sdpa, atol=1e-5, rtol=1e-5)


def test_a_retrofitted_state_dict_loads_exactly_into_a_fresh_retrofit():
    for make in (lambda: _timm(), lambda: _hf("gpt2")):
        model, x, n = make()
        retrofit.add_mask_prior(model, logits=_past(torch.randn(n, n) * 3), param="full")
        twin, _, _ = make()
        retrofit.add_mask_prior(twin, mp.banded_pattern(n, 1) & mp.causal_pattern(n), param="full")
        twin.load_state_dict(model.state_dict())             # strict: every M has its place
        torch.testing.assert_close(_out(twin, x), _out(model, x), atol=0, rtol=0)
        for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):    # hooks and configs travel along
            assert torch.equal(_out(clone, x), _out(model, x))
            mp.mask_priors(clone)[0].set_logits(torch.full((n, n), 30.0))
            assert not torch.equal(_out(clone, x), _out(model, x))                  # the clone's own M


def test_m_stays_float32_in_a_half_precision_model_and_small_steps_survive():
    model, x, n = _hf("gpt2")
    priors = retrofit.add_mask_prior(model, mp.causal_pattern(n), m_on=5.0, m_off=8.0)
    model.to(torch.bfloat16)
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert all(p.bias.dtype == torch.float32 for p in priors.values())
    before = [p.bias.detach().clone() for p in priors.values()]
    opt = torch.optim.Adam([p.bias for p in priors.values()], lr=1e-3)
    model(x).logits.float().pow(2).mean().backward()
    opt.step()                                               # a bf16 M near 5-8 would round a 1e-3 step away
    moved = [(p.bias - b).abs() for p, b in zip(priors.values(), before)]
    assert all(0.5e-3 < m.max() <= 1.01e-3 for m in moved)
    prior = mp.MaskPrior(4, 2, pattern=mp.banded_pattern(4, 1))
    for cast in (lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.bfloat16()):
        assert cast(nn.Sequential(prior))[0].bias.dtype == torch.float32
    assert prior.double().bias.dtype == torch.float64          # a wider float is kept as asked


def test_optimiser_builders_leave_m_undecayed():
    timm_optim = _extra("timm.optim")
    vit, _, n = _timm()
    retrofit.add_mask_prior(vit, mp.banded_pattern(n, 1))
    names = mp.prior_parameter_names(vit)
    assert names == ["blocks.0.attn.mask_prior.bias", "blocks.1.attn.mask_prior.bias"]
    assert set(names) <= vit.no_weight_decay() and {"pos_embed", "cls_token"} <= vit.no_weight_decay()
    opt = timm_optim.create_optimizer_v2(vit, "adamw", lr=1e-3, weight_decay=0.05)
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert not any(id(p.bias) in decayed for p in mp.mask_priors(vit)) and decayed
    gpt2, _, n = _hf("gpt2")
    retrofit.add_mask_prior(gpt2, mp.causal_pattern(n))
    decay, keep = mp.param_groups(gpt2, 0.1)
    conv1d = [m.weight for m in gpt2.modules() if type(m).__name__ == "Conv1D"]
    assert len(conv1d) == 8 and {id(p) for p in decay["params"]} == {id(p) for p in conv1d}
    assert all(any(q is p.bias for q in keep["params"]) for p in mp.mask_priors(gpt2))


def test_the_probes_read_retrofitted_models():
    vit, pixels, n = _timm()
    pattern = mp.impulse_pattern(4, 4, mp.IMPULSE_OFFSETS[:3], n_prefix=1)
    retrofit.add_mask_prior(vit, pattern, m_off=10.0)
    start = mp.prior_snapshot(vit)
    mass, margin = mp.prior_probe(vit, pixels, pattern)
    assert len(mass) == 2 and all(m > 0.99 for m in mass) and all(math.isfinite(m) for m in margin)
    assert vit.blocks[0].attn.fused_attn                         # the explicit path only while probing
    assert mp.prior_drift(vit, start)["mask_drift"] == [0.0, 0.0]
    for name in ("gpt2", "llama"):
        model, ids, n = _hf(name)
        band = mp.banded_pattern(n, 2) & mp.causal_pattern(n)
        retrofit.add_mask_prior(model, band, m_off=8.0)
        mass, margin = mp.prior_probe(model, ids, band)
        assert len(mass) == 2 and all(m > 0.99 for m in mass), mass
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2, enable_nested_tensor=False)
    band = mp.banded_pattern(8, 1)
    retrofit.add_mask_prior(enc, band, m_off=8.0)
    assert all(m > 0.99 for m in mp.prior_mass(enc.eval(), torch.randn(2, 8, 16), band))

    class Own(nn.Module):
        num_heads = 2

        def forward(self, x, attn_mask=None):
            return x

    own = nn.Sequential(Own())
    retrofit.add_mask_prior(own, band, modules=Own)
    with pytest.raises(ValueError, match="0 gave 0 attention maps in one forward pass .* use mp.pattern_mass"):
        mp.prior_mass(own, torch.randn(2, 8, 16), band)
    with pytest.raises(ValueError, match="Linear has no maskprior Attention and no MaskPrior"):
        mp.prior_mass(nn.Linear(4, 4), torch.randn(2, 4), band)


def _seq2seq(name: str):
    """A small encoder-decoder (random weights), its encoder input and decoder ids: 10 source and 6 target tokens."""
    tf = _extra("transformers")
    tf.logging.set_verbosity_error()
    torch.manual_seed(0)
    ids, dec = torch.randint(3, 50, (2, 10)), torch.randint(3, 50, (2, 6))
    sizes = dict(vocab_size=50, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0,
                 pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, init_std=0.5)
    if name == "bart":
        model = tf.BartForConditionalGeneration(tf.BartConfig(max_position_embeddings=32, bos_token_id=0, **sizes))
    elif name == "marian":
        model = tf.MarianMTModel(tf.MarianConfig(max_position_embeddings=32, **sizes))
    elif name == "whisper":                             # 16 mel frames -> 8 encoder positions
        sizes.update(max_source_positions=8, max_target_positions=32, num_mel_bins=8, begin_suppress_tokens=None,
                     suppress_tokens=None, bos_token_id=0)
        model = tf.WhisperForConditionalGeneration(tf.WhisperConfig(**sizes))
        return model.eval(), {"input_features": torch.randn(2, 8, 16), "decoder_input_ids": dec}, 8
    else:
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=50, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                                          num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                                          pad_token_id=0, eos_token_id=1))
    return model.eval(), {"input_ids": ids, "decoder_input_ids": dec}, 10


def _diagonal(n: int, heads: int = 4) -> torch.Tensor:
    """M = +30 on the diagonal, -30 elsewhere: each query sees itself alone, which must change any layer's output."""
    return (torch.eye(n) * 60 - 30).expand(heads, n, n).clone()


@pytest.mark.parametrize("name", SEQ2SEQ)
def test_encoder_decoders_give_self_attention_a_prior_and_cross_attention_one_when_asked(name):
    """Encoder and decoder self-attention get priors (the decoder's causal); cross-attention (BART's encoder_attn,
    T5's EncDecAttention) keeps its own implementation until cross_attention=True gives it an (N_q, N_k) prior,
    whose rows follow the decoder's position under the KV cache: generate with the cache equals without."""
    model, inputs, n_src = _seq2seq(name)
    plain = model(**inputs).logits.detach()
    impl = model.config._attn_implementation
    selfs = retrofit.add_mask_prior(model, logits=torch.full((12, 12), 30.0))           # M = +30: the plain model
    assert len(selfs) == 2 and [p.causal for p in selfs.values()] == [False, True], list(selfs)
    named = dict(model.named_modules())
    cross = [s.name for s in retrofit.find_attention(model) if s.cross]
    assert len(cross) == 1 and not hasattr(named[cross[0]], "mask_prior")
    assert named[cross[0]].config._attn_implementation == impl                   # the shared config is not switched
    torch.testing.assert_close(model(**inputs).logits, plain, atol=2e-5, rtol=1e-5)
    for p in selfs.values():
        p.set_logits(_diagonal(12))
    moved = model(**inputs).logits.detach()
    assert (moved - plain).abs().max() > 1e-2                                      # measured: 0.05 (T5) .. 1.6
    priors = retrofit.add_mask_prior(model, logits=torch.randn(4, 8, n_src) * 3, cross_attention=True)
    assert list(priors) == cross and priors[cross[0]].bias.shape == (4, 8, n_src)
    out = model(**inputs).logits
    assert (out - moved).abs().max() > 1e-3
    out.float().pow(2).mean().backward()
    assert all(p.bias.grad.abs().max() > 0 for p in mp.mask_priors(model))
    source = {k: v for k, v in inputs.items() if k != "decoder_input_ids"}
    kw = dict(max_new_tokens=5, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        cached, fresh = model.generate(**source, use_cache=True, **kw), model.generate(**source, use_cache=False, **kw)
    assert torch.equal(cached.sequences, fresh.sequences)
    for a, b in zip(cached.logits, fresh.logits):                                  # measured: <= 5e-7
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    decoder_self = named[list(selfs)[1]]
    with pytest.raises(ValueError, match=rf"{list(selfs)[1]}: a self-attention prior, but this call's keys come from "
                                         rf"another sequence"):
        decoder_self(torch.randn(2, 6, 32), key_value_states=torch.randn(2, n_src, 32))


def test_layers_that_share_a_config_take_a_prior_in_any_subset_and_save_and_load(tmp_path):
    """BART's layers share one config: a prior on the encoder alone (a part of the model) leaves the decoder's layers
    running their own implementation; cross-attention alone, then the decoder's self-attention picked with modules=;
    the part's record is found again in the whole model (save_pretrained, retrofit.from_pretrained: exact). (A second
    part whose layers have the same names:
    test_an_encoder_decoders_parts_take_priors_in_either_order_and_load_back_exactly.)"""
    tf = _extra("transformers")
    model, inputs, _ = _seq2seq("bart")
    gen = torch.Generator().manual_seed(0)
    enc = retrofit.add_mask_prior(model.model.encoder, logits=torch.randn(4, 10, 10, generator=gen) * 3)
    assert list(enc) == ["layers.0.self_attn"]
    assert model.model.decoder.layers[0].self_attn.config is model.config
    model(**inputs)
    retrofit.add_mask_prior(model, logits=torch.randn(4, 6, 10, generator=gen) * 3, cross_attention=True)
    dec = retrofit.add_mask_prior(model, logits=_past(torch.randn(4, 6, 6, generator=gen) * 3),
                            modules=lambda name, m: name == "model.decoder.layers.0.self_attn")
    assert list(dec) == ["model.decoder.layers.0.self_attn"] and len(mp.mask_priors(model)) == 3
    out = model(**inputs).logits
    model.save_pretrained(tmp_path / "bart")
    back = retrofit.from_pretrained(tf.AutoModelForSeq2SeqLM, str(tmp_path / "bart")).eval()
    assert type(back) is type(model) and [p.where for p in mp.mask_priors(back)] == [
        "model.encoder.layers.0.self_attn", "model.decoder.layers.0.self_attn", "model.decoder.layers.0.encoder_attn"]
    torch.testing.assert_close(back(**inputs).logits, out, atol=0, rtol=0)


@pytest.mark.parametrize("name", LEFT_PADDED)
def test_left_padded_batches_read_each_rows_positions_so_batched_generate_equals_each_prompt(name):
    """A causal prior reads a key's distance as the keys its query sees after it, and a full M's row from the
    position ids: a left-padded batch generates what each prompt does alone (dynamic and static caches; Mistral and
    Gemma2 with a sliding window of 4, shorter than the prompts); a right-padded batch gives its real tokens the
    logits they have alone; packed sequences (position ids, no mask) the logits each has alone; a mask that lets a
    restarted sequence see the one before is refused in one line."""
    model, _, n = _hf(name)
    retrofit.add_mask_prior(
        model,
        logits=mp.causal_distance_logits(n, 4) + torch.randn(4, n, n, generator=torch.Generator().manual_seed(0)),
        param="full",
    )
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(1, 50, (1, 7), generator=gen), torch.randint(1, 50, (1, 4), generator=gen)
    pad = torch.zeros(1, 3, dtype=torch.long)
    left, mask = torch.cat([a, torch.cat([pad, b], 1)]), torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    alone = [model.generate(p, **kw) for p in (a, b)]
    for cache in ("dynamic", "static"):
        both = model.generate(left, attention_mask=mask, cache_implementation=cache, **kw)
        assert torch.equal(both.sequences[0], alone[0].sequences[0]), cache
        assert torch.equal(both.sequences[1, 3:], alone[1].sequences[0]), cache
        for step, (x, ya, yb) in enumerate(zip(both.logits, alone[0].logits, alone[1].logits)):   # measured: 1e-7
            torch.testing.assert_close(x, torch.cat([ya, yb]), atol=1e-5, rtol=1e-5)
    right = torch.cat([a, torch.cat([b, pad], 1)])
    logits = model(right, attention_mask=mask.flip(1)).logits
    torch.testing.assert_close(logits[1, :4], model(b).logits[0], atol=1e-5, rtol=1e-5)
    packed = model(torch.cat([a, b], 1), position_ids=torch.cat([torch.arange(7), torch.arange(4)])[None],
                   use_cache=False).logits                  # as in training: the model finds the packed blocks
    torch.testing.assert_close(packed[0], torch.cat([model(a).logits[0], model(b).logits[0]]), atol=1e-5, rtol=1e-5)
    ones = torch.ones(1, 15, dtype=torch.long)          # a mask that lets the second sequence see the first
    with pytest.raises(ValueError, match=r"a query sees more keys than there are positions up to its own, .* \(packed "
                                         r"sequences: pass their position_ids without an attention_mask"):
        model(torch.cat([a, a, pad[:, :1]], 1), attention_mask=ones, position_ids=torch.arange(15).remainder(7)[None])


def _untouched(model: nn.Module) -> dict:
    """What a refused add_mask_prior must leave as it was: parameter names, hooks, the configs' dicts."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    configs = [m.config.to_dict() if hasattr(m.config, "to_dict") else m.config for m in model.modules()
               if hasattr(m, "config")]
    return {"keys": list(model.state_dict()), "hooks": hooks, "configs": configs}


def _refused(name: str):
    """A model with a layer the prior cannot serve (UNREACHABLE), the pattern asked for, the line that refuses it and
    add_mask_prior's other arguments."""
    tf, timm = _extra("transformers"), _extra("timm")
    if name == "**kwargs":
        class Swallow(nn.Module):                       # attn_mask would vanish into **kwargs
            num_heads = 2

            def forward(self, x, **kwargs):
                return x * 2

        return (
            nn.Sequential(Swallow()),
            mp.banded_pattern(4, 1),
            (
                r"^add_mask_prior: 0 \(Swallow, 2 heads\) names no "
                r"`attn_mask` parameter in its forward \(a \*\*kwargs "
                r"catch-all is not trusted"
            ),
            {"modules": Swallow},
        )
    if name == "deberta-v2":
        torch.manual_seed(0)
        model = tf.DebertaV2Model(tf.DebertaV2Config(vocab_size=50, hidden_size=32, num_hidden_layers=1,
                                                     num_attention_heads=4, intermediate_size=64))
        return (
            model,
            mp.banded_pattern(8, 1),
            (
                r"DebertaV2Model holds no attention layer it can reach: "
                r"encoder.layer.0.attention.self \(DisentangledSelfAttention\) computes "
                r"its own softmax .* modules=DisentangledSelfAttention"
            ),
            {},
        )
    if name == "swin":
        return (
            _hf("swin")[0],
            mp.banded_pattern(64, 1),
            (
                r"encoder.layers.0.blocks.0.attention \(SwinAttention, 4 "
                r"heads\) sees 16 tokens, but the pattern has shape \(64, "
                r"64\): build it for 16 positions \(its attention window\)"
            ),
            {},
        )
    arch, kw = {"pit": ("pit_ti_224", dict(img_size=64)), "crossvit": ("crossvit_tiny_240", dict(img_size=[48, 48]))}[
        name
    ]
    torch.manual_seed(0)
    model = timm.create_model(arch, pretrained=False, num_classes=4, **kw)
    return model, mp.banded_pattern(8, 1), (rf"is in a timm model \({type(model).__name__}\) without one patch grid .* "
                                            rf"pooled stages or branches see other token counts"), {}


def test_a_layer_the_prior_cannot_reach_or_a_pattern_it_would_cut_is_refused_and_nothing_changes():
    """No silent no-op: a forward that would swallow the mask in **kwargs, an attention with its own softmax
    (DeBERTa-v2), timm models whose stages see other token counts (PiT, CrossViT), a pattern bigger than Swin's
    window (never cut to it): each one line naming the layer or class and what to do, the model as it was. CLIP's
    attention, named with modules= (its forward takes **kwargs), is served as the HF layer it is and moves."""
    tf = _extra("transformers")
    for name in UNREACHABLE:
        model, pattern, message, kw = _refused(name)
        before = _untouched(model)
        with pytest.raises(ValueError, match=message + ".*; no layer was changed$"):
            retrofit.add_mask_prior(model, pattern, **kw)
        assert _untouched(model) == before and not mp.mask_priors(model), name
    swin, pixels, _ = _hf("swin")
    plain = swin(pixels).last_hidden_state
    retrofit.add_mask_prior(swin, logits=_diagonal(16), param="full")
    assert (swin(pixels).last_hidden_state - plain).abs().max() > 1e-2
    clip, ids, n = _hf("clip-text")
    plain = clip(ids).last_hidden_state
    retrofit.add_mask_prior(clip, logits=_diagonal(n), modules=type(clip.encoder.layers[0].self_attn), param="full")
    out = clip(ids).last_hidden_state
    assert (out - plain).abs().max() > 1e-2                     # was 0.0: the mask went into **kwargs
    for p in mp.mask_priors(clip):
        p.set_logits(torch.zeros(n, n))                         # a prior that hides no key
    later = ids.clone()
    later[:, 15:] = 1                                           # CLIP's text tower stays causal under the prior
    torch.testing.assert_close(clip(later).last_hidden_state[:, :15], clip(ids).last_hidden_state[:, :15], atol=1e-6,
                               rtol=1e-6)

    class Bypass(nn.Module):                        # looks like an HF attention layer, never calls the interface
        is_causal, scaling, num_heads = False, 1.0, 2

        def __init__(self):
            super().__init__()
            self.config = tf.GPT2Config()
            self.config._attn_implementation = "sdpa"

        def forward(self, hidden_states):
            return hidden_states

    Bypass.__module__ = tf.models.gpt2.modeling_gpt2.__name__
    bypass = nn.Sequential(Bypass())
    retrofit.add_mask_prior(bypass, mp.banded_pattern(4, 1))
    with pytest.raises(RuntimeError, match="0: the layer ran without calling transformers' attention function, so its "
                                           "prior changed nothing"):
        bypass(torch.randn(1, 4, 8))


def test_peft_keeps_m_trainable_and_saved_with_the_adapter_or_says_how_in_one_line(tmp_path):
    """Prior first, then PEFT with modules_to_save=['mask_prior']: M trains, is saved with the adapter (a fresh
    base with a prior of that shape takes it back exactly), and the merged model saves and reloads with its priors.
    Without modules_to_save, the training forward that would leave M frozen is refused in one line; PEFT first, then
    the prior (whose adapter would not save M) is refused in one line, the model unchanged."""
    peft = _extra("peft")
    model, ids, n = _hf("llama")
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(n, 4))
    lora = dict(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    frozen = peft.get_peft_model(model, peft.LoraConfig(**lora)).train()
    with pytest.raises(RuntimeError, match=r"model.layers.0.self_attn: M is frozen: PEFT's get_peft_model froze it .* "
                                           r"pass modules_to_save=\['mask_prior'\]"):
        frozen(ids)
    with pytest.raises(RuntimeError, match=r"M is frozen"):
        frozen.eval()(ids)              # eval mode, gradients on: a hand loop that never called .train() (issue 65)
    with torch.no_grad():
        frozen.eval()(ids)                                      # inference with a frozen M is fine
    model, ids, n = _hf("llama")
    priors = retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(n, 4))
    start = [p.bias.detach().clone() for p in priors.values()]
    tuned = peft.get_peft_model(model, peft.LoraConfig(modules_to_save=["mask_prior"], **lora)).train()
    opt = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        opt.zero_grad()
        tuned(ids).logits.float().pow(2).mean().backward()
        opt.step()
    tuned.eval()
    moved = [m.mask_prior.bias for m in model.modules() if hasattr(m, "mask_prior")]   # the adapter's copies
    assert len(moved) == 2 and all(m.requires_grad and (m - s).abs().max() > 1e-3 for m, s in zip(moved, start))
    with torch.no_grad():
        out = tuned(ids).logits
    tuned.save_pretrained(tmp_path / "adapter")
    fresh, _, _ = _hf("llama")
    retrofit.add_mask_prior(fresh, mp.causal_pattern(n))
    again = peft.PeftModel.from_pretrained(fresh, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, out, atol=1e-6, rtol=1e-6)
    merged = tuned.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    back = retrofit.from_pretrained(type(merged), str(tmp_path / "merged")).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, out, atol=1e-5, rtol=1e-5)
    model, ids, n = _hf("llama")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(**lora))
    for target in (wrapped, model):
        before = _untouched(model)
        with pytest.raises(ValueError, match=r"is already wrapped by PEFT, whose adapter would not save M: add "
                                             r"the priors first, then get_peft_model with "
                                             r"modules_to_save=\['mask_prior'\]"):
            retrofit.add_mask_prior(target, mp.causal_pattern(n))
        assert _untouched(model) == before


def test_a_folder_saved_with_priors_refuses_a_plain_load_under_any_attn_implementation_naming_the_loader(tmp_path):
    """Issue 65: config.json names HF_SAVED as its weights file (`transformers_weights`), which transformers refuses
    before it builds a model, so a plain from_pretrained given attn_implementation='sdpa' or 'eager' is one line naming
    retrofit.from_pretrained (it loaded with every M dropped, the outputs changed); that loads it exactly, and the
    loaded model's config holds neither mark. The shared config never holds it."""
    tf = _extra("transformers")
    model, x, n = _hf("gpt2")
    retrofit.add_mask_prior(model, logits=_past(torch.randn(4, n, n) * 3), param="full")
    model.save_pretrained(tmp_path)
    assert json.load(open(tmp_path / "config.json"))["transformers_weights"] == retrofit.HF_SAVED
    assert "transformers_weights" not in model.config.to_dict()
    for loader, impl in ((tf.GPT2LMHeadModel, "sdpa"), (tf.GPT2LMHeadModel, "eager"),
                         (tf.AutoModelForCausalLM, "sdpa")):
        with pytest.raises(ValueError, match=r"maskprior: load it with maskprior_retrofit.from_pretrained$") as err:
            loader.from_pretrained(tmp_path, attn_implementation=impl)
        _one_line(err)
    back = retrofit.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path), attn_implementation="eager")
    torch.testing.assert_close(_out(back.eval(), x), _out(model, x), atol=1e-5, rtol=1e-5)          # eager vs sdpa
    assert not {"transformers_weights", "mask_prior"} & set(back.config.to_dict())


def _adapter_loads(peft, folder: str):
    """Each way to load a saved adapter onto a model, as (the loader's name, what makes the model ready for it or
    None, a call taking the model): PEFT's from_pretrained (its task classes' too) and load_adapter beside an adapter
    of its own, and transformers' load_adapter from the folder or from the adapter's weights and config."""
    from safetensors.torch import load_file
    state = {k.replace("base_model.model.", "", 1): v
             for k, v in load_file(os.path.join(folder, "adapter_model.safetensors")).items()}

    def own(m):
        return peft.get_peft_model(m, peft.LoraConfig(r=2, target_modules=["k_proj"]))
    return [("PeftModel.from_pretrained", None, lambda m: peft.PeftModel.from_pretrained(m, folder)),
            ("PeftModel.from_pretrained", None, lambda m: peft.PeftModelForCausalLM.from_pretrained(m, folder)),
            ("PeftModel.load_adapter", own, lambda m: m.load_adapter(folder, "tuned")),
            ("PeftAdapterMixin.load_adapter", None, lambda m: m.load_adapter(folder)),
            ("PeftAdapterMixin.load_adapter", None, lambda m: m.load_adapter(
                adapter_state_dict=state, peft_config=peft.PeftConfig.from_pretrained(folder)))]


def test_an_adapter_that_carries_m_is_refused_onto_a_model_without_priors_and_nothing_changes(tmp_path):
    """Issue 65: an adapter saved with M (modules_to_save=['mask_prior']) loaded onto a model without priors with
    every M dropped (no warning, other outputs), through every loader of adapters: PEFT's from_pretrained and
    load_adapter, transformers' load_adapter. Each is one line naming the fix, before PEFT wraps anything; a model
    with priors takes the adapter's M through each."""
    peft = _extra("peft")
    model, ids, n = _hf("llama")
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(n, 4))
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["mask_prior"]))
    for m in mp.mask_priors(tuned):
        torch.nn.init.normal_(m.bias)                                   # an M of its own, saved with the adapter
    tuned.save_pretrained(tmp_path)
    saved = [m.mask_prior.bias for m in model.modules() if "mask_prior_hooks" in m.__dict__]
    for where, ready, load in _adapter_loads(peft, str(tmp_path)):
        plain, _, _ = _hf("llama")
        plain = ready(plain) if ready else plain
        before = _untouched(plain)
        with pytest.raises(ValueError, match=rf"^{where}: the adapter .* carries M \(modules_to_save names "
                                             r"'mask_prior'\), but LlamaForCausalLM holds no MaskPrior to take "
                                             r"it .*; nothing was loaded$") as err:
            load(plain)
        _one_line(err)
        assert _untouched(plain) == before, where
        base, _, _ = _hf("llama")
        retrofit.add_mask_prior(base, mp.causal_pattern(n))
        base = ready(base) if ready else base
        load(base)
        loaded = [p for name, p in base.named_parameters() if "mask_prior.modules_to_save." in name]
        assert len(loaded) == 2 and all(torch.equal(a, b) for a, b in zip(loaded, saved)), (where, loaded)


@pytest.mark.slow
def test_an_adapter_saved_with_m_refuses_a_plain_load_in_a_process_that_never_imported_maskprior(tmp_path):
    """Issue 75: an adapter saved with M names retrofit.ADAPTER_SAVED after its peft_type, so PEFT's own loaders
    (PeftModel.from_pretrained, AutoPeftModelForCausalLM, transformers' load_adapter) refuse it in a process that
    never imported maskprior, naming maskprior_retrofit (they loaded it with every M dropped, other outputs, without
    a word); a model given its priors by the retrofit takes it back with the saved outputs."""
    peft = _extra("peft")
    model, ids, n = _hf("llama")
    model.config.save_pretrained(tmp_path / "base")
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(n, 4))
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["mask_prior"]))
    for m in mp.mask_priors(tuned):
        torch.nn.init.normal_(m.bias)
    tuned.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        saved = tuned.eval()(ids).logits
    assert json.load(open(tmp_path / "adapter" / "adapter_config.json"))["peft_type"] == (
        f"LORA, {retrofit.ADAPTER_SAVED}")
    folder = str(tmp_path / "adapter")
    script = f"""import sys, peft, transformers as tf
model = tf.LlamaForCausalLM(tf.AutoConfig.from_pretrained({str(tmp_path / 'base')!r}))
for load in (lambda: peft.PeftModel.from_pretrained(model, {folder!r}),
             lambda: peft.AutoPeftModelForCausalLM.from_pretrained({folder!r}), lambda: model.load_adapter({folder!r})):
    try:
        load()
        print('loaded')
    except Exception as e:
        print(type(e).__name__, str(e).replace(chr(10), ' '))
assert not any(m.startswith('maskprior') for m in sys.modules)
"""
    r = subprocess.run([sys.executable, "-W", "ignore", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    lines = r.stdout.strip().splitlines()
    assert r.returncode == 0 and len(lines) == 3, r.stderr[-3000:]
    assert all("maskprior_retrofit (add_mask_prior)" in line for line in lines), lines
    base, _, _ = _hf("llama")
    retrofit.add_mask_prior(base, mp.causal_pattern(n))
    with torch.no_grad():
        torch.testing.assert_close(peft.PeftModel.from_pretrained(base, folder).eval()(ids).logits, saved,
                                   atol=1e-6, rtol=1e-6)


def test_a_module_imported_after_the_retrofit_is_handed_to_its_hook_once(tmp_path, monkeypatch):
    """How PEFT learns to refuse an adapter carrying M whichever of the two is imported first (`_when_imported`): a
    module imported later is handed over right after its code ran (not when merely looked up, as transformers'
    is_peft_available does), once, and the finder leaves; one already imported, at once."""
    (tmp_path / "maskprior_probe_module.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "maskprior_probe_module", raising=False)
    seen = []
    retrofit._when_imported("maskprior_probe_module", lambda m: seen.append(m.value))
    assert importlib.util.find_spec("maskprior_probe_module") is not None and seen == []   # looked up, not loaded
    module = importlib.import_module("maskprior_probe_module")
    assert seen == [1] and not any(getattr(f, "name", None) == "maskprior_probe_module" for f in sys.meta_path)
    importlib.reload(module)
    assert seen == [1]
    retrofit._when_imported("maskprior_probe_module", lambda m: seen.append(m.value + 1))
    assert seen == [1, 2]
    monkeypatch.delitem(sys.modules, "maskprior_probe_module")


def test_a_transformer_encoder_says_once_that_its_nested_tensor_fast_path_is_off_and_gets_it_back():
    """Issue 65: add_mask_prior turns an nn.TransformerEncoder's nested-tensor fast path off (a padded batch there
    would skip the attn_mask) and says so in one warning per encoder where the path was on; none where it was off;
    remove_mask_prior turns it back on."""
    model = nn.Transformer(16, 2, 1, 1, 32, batch_first=True)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    for module, name in ((enc, ""), (model, " encoder")):
        assert module.use_nested_tensor if module is enc else module.encoder.use_nested_tensor
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            retrofit.add_mask_prior(module, mp.banded_pattern(8, 1))
        assert [str(w.message) for w in said] == [f"add_mask_prior: TransformerEncoder{name} now runs without its "
                                                  "nested-tensor fast path, whose padded batches would skip the "
                                                  "prior's attn_mask; remove_mask_prior turns it back on"]
        assert said[0].filename == __file__
    assert not enc.use_nested_tensor and not model.encoder.use_nested_tensor
    retrofit.remove_mask_prior(enc)
    assert enc.use_nested_tensor
    off = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        retrofit.add_mask_prior(off, mp.banded_pattern(8, 1))


def test_the_probes_under_peft_read_the_prior_each_layer_runs_not_the_original_peft_keeps_beside_it():
    """Issue 65: under PEFT's modules_to_save a layer holds its MaskPrior twice (PEFT's frozen original_module and the
    adapter's copy it runs): mask_priors, prior_snapshot and prior_drift list one per layer, the copy that runs (2
    for 2 layers, not 4); with the adapter disabled, the original."""
    peft = _extra("peft")
    model, ids, n = _hf("llama")
    retrofit.add_mask_prior(model, logits=mp.causal_distance_logits(n, 4))
    tuned = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["mask_prior"]))
    wrappers = [m.mask_prior for m in model.modules() if "mask_prior_hooks" in m.__dict__]
    running = [w.modules_to_save["default"] for w in wrappers]
    assert mp.mask_priors(tuned) == running
    start = mp.prior_snapshot(tuned)
    assert len(start) == 2
    with torch.no_grad():
        running[0].bias.add_(1.0)
    drift = mp.prior_drift(tuned, start)["mask_drift"]
    assert len(drift) == 2 and drift[0] > 0 and drift[1] == 0
    with tuned.disable_adapter():
        assert mp.mask_priors(tuned) == [w.original_module for w in wrappers]


def test_a_text_sequence_a_prior_cannot_serve_is_refused_without_speaking_of_an_image_of_another_size():
    """Issue 65: a shorter sequence fed to a retrofitted text model whose prior serves exactly N positions
    (nn.TransformerEncoder's default, BERT with prefix=False) is one line naming prefix=True and the size to build,
    never 'an image of another size'; BERT's default (prefix) serves it."""
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1, enable_nested_tensor=False)
    retrofit.add_mask_prior(enc, mp.banded_pattern(8, 1))
    bert, ids, n = _hf("bert")
    retrofit.add_mask_prior(bert, logits=torch.randn(4, n, n), param="full", prefix=False)
    for run, where, t in ((lambda: enc(torch.randn(2, 5, 16)), "layers.0.self_attn", 5),
                          (lambda: bert(ids[:, :12]), "encoder.layer.0.attention.self", 12)):
        with pytest.raises(ValueError, match=rf"^{where}: sequence length {t} does not fit the mask size .*: .*"
                                             rf"prefix=True") as err:
            run()
        assert "image" not in _one_line(err)
    served, _, _ = _hf("bert")
    retrofit.add_mask_prior(served, logits=torch.randn(4, n, n), param="full")
    assert served(ids[:, :12]).last_hidden_state.shape == (2, 12, 32)


@pytest.mark.filterwarnings("ignore:.*TransformerEncoder now runs without its nested-tensor fast path")
def test_remove_mask_prior_gives_the_plain_model_back_exactly():
    """remove_mask_prior takes out the priors, hooks, layer config views, config records and no_weight_decay names:
    the outputs equal the plain model's bit for bit, its state_dict keys and config are the plain ones, and a prior can
    be added again. A model with no prior is refused in one line."""
    class Own(nn.Module):
        num_heads = 2

        def forward(self, x, attn_mask=None):
            b, t, c = x.shape
            q = x.view(b, t, 2, c // 2).transpose(1, 2)
            return F.scaled_dot_product_attention(q, q, q, attn_mask=attn_mask).transpose(1, 2).reshape(b, t, c)

    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 1)
    bart, inputs, _ = _seq2seq("bart")
    cases = [(enc.eval(), torch.randn(2, 8, 16), lambda m: retrofit.add_mask_prior(m, logits=_diagonal(8, 2))),
             (nn.Sequential(Own()), torch.randn(2, 8, 16),
              lambda m: retrofit.add_mask_prior(m, logits=_diagonal(8, 2), modules=Own)),
             (*_timm()[:2], lambda m: retrofit.add_mask_prior(m, logits=_diagonal(17, 3))),
             (*_hf("gpt2")[:2], lambda m: retrofit.add_mask_prior(m, logits=_diagonal(24))),
             (bart, inputs, lambda m: (retrofit.add_mask_prior(m.model.encoder, logits=_diagonal(10)),
                                       retrofit.add_mask_prior(m, logits=_diagonal(10)[:, :6], cross_attention=True)))]
    for model, x, attach in cases:
        run = (lambda m: m(**x).logits) if isinstance(x, dict) else (lambda m: _out(m, x))
        plain, before = run(model).detach(), _untouched(model)
        wd = model.no_weight_decay() if hasattr(model, "no_weight_decay") else None
        attach(model)
        assert (run(model) - plain).abs().max() > 1e-3, type(model).__name__
        removed = retrofit.remove_mask_prior(model)
        assert removed and not mp.mask_priors(model) and _untouched(model) == before, type(model).__name__
        assert torch.equal(run(model), plain) and not any(hasattr(m, "mask_prior") for m in model.modules())
        assert wd is None or model.no_weight_decay() == wd
        assert getattr(model, "use_nested_tensor", None) == getattr(enc, "use_nested_tensor", None) or model is not enc
        attach(model)                                           # and back again
        assert (run(model) - plain).abs().max() > 1e-3
    with pytest.raises(ValueError, match="remove_mask_prior: Linear holds no prior from add_mask_prior"):
        retrofit.remove_mask_prior(nn.Linear(2, 2))


def test_from_pretrained_refuses_a_record_or_checkpoint_that_does_not_hold_every_m(tmp_path):
    """Issue 32: a config record with no layers, an M the record does not list, an M of another size under
    ignore_mismatched_sizes=True, and every malformed record (checked before any model is built) are one ValueError
    naming the layer and field; never a model with an M left at 0 or uninitialised. Auto classes load."""
    tf = _extra("transformers")
    model, x, n = _hf("gpt2")
    retrofit.add_mask_prior(model, logits=_past(torch.randn(4, n, n) * 3), param="full")
    model.save_pretrained(tmp_path / "good")
    config = json.load(open(tmp_path / "good" / "config.json"))
    auto = retrofit.from_pretrained(tf.AutoModelForCausalLM, str(tmp_path / "good"))
    assert type(auto) is tf.GPT2LMHeadModel and torch.equal(_out(auto.eval(), x), _out(model, x))
    with pytest.raises(ValueError, match="AutoModelForImageClassification is neither a model class nor an Auto class "
                                         "with a model for GPT2Config"):
        retrofit.from_pretrained(tf.AutoModelForImageClassification, str(tmp_path / "good"))
    layer = "transformer.h.0.attn"

    def record(change):
        c = json.loads(json.dumps(config))
        change(c["mask_prior"], c["mask_prior"]["layers"][layer])
        return c

    cases = [  # (the config.json, extra kwargs, the message)
        (record(lambda r, g: r.update(layers={})), {},
         r"the mask_prior record's layers are \{\}: expected a non-empty"),
        (record(lambda r, g: r["layers"].pop("transformer.h.1.attn")), {},
         r"holds transformer.h.1.attn.mask_prior.bias \(1 in all\) on a layer its config records no prior for"),
        (record(lambda r, g: g.update(n=20)), {"ignore_mismatched_sizes": True},
         r"holds transformer.h.0.attn.mask_prior.bias \(1 in all\) in another shape than its config records"),
        (record(lambda r, g: r.update(layers=[layer])), {}, r"the mask_prior record's layers are \['transformer"),
        (record(lambda r, g: g.pop("heads")), {}, rf"the mask_prior record of layer {layer} has no heads: expected a "
                                                  rf"positive int"),
        (record(lambda r, g: g.update(heads="4")), {}, rf"layer {layer} has heads '4': expected a positive int"),
        (record(lambda r, g: g.update(heads=None)), {}, rf"layer {layer} has heads None: expected a positive int"),
        (record(lambda r, g: g.update(n=-1)), {}, rf"layer {layer} has n -1: expected a positive int"),
        (record(lambda r, g: g.update(causal="yes")), {}, rf"layer {layer} has causal 'yes': expected true or false"),
        (record(lambda r, g: g.update(param="rel")), {},
         rf"layer {layer} has param 'rel': expected 'full', 'relative' or 'grid'"),
        (record(lambda r, g: g.update(grid=[0, 4])), {},
         rf"layer {layer} has grid \[0, 4\]: expected null or \[grid_h"),
        (record(lambda r, g: g.update(grid=[2, 2])), {},
         rf"{layer} .*param='grid' \(a 2-D relative M\) goes with grid"),
        (record(lambda r, g: r.pop("base")), {}, r"the mask_prior record has no base: expected 'sdpa' or 'eager'"),
        (record(lambda r, g: r.update(base="maskprior")), {}, r"the mask_prior record has base 'maskprior': expected"),
        ({**config, "mask_prior": "transformer.h.0.attn"}, {}, r"holds a mask_prior record that is a str"),
        (record(lambda r, g: r["layers"].update({"transformer.h.0.mlp": r["layers"].pop(layer)})), {},
         r"records a prior on transformer.h.0.mlp, a GPT2MLP, which is not an attention layer add_mask_prior reaches"),
        (record(lambda r, g: g.update(heads=2)), {}, rf"{layer} \(GPT2Attention, 4 heads\) does not fit a pattern of "
                                                     rf"shape \(2, 24, 24\)"),
        (record(lambda r, g: g.update(causal=False)), {}, rf"{layer} \(GPT2Attention, 4 heads\) is causal, but "
                                                          rf"causal=False was asked"),
    ]
    for i, (cfg, kwargs, message) in enumerate(cases):
        path = tmp_path / f"case{i}"
        shutil.copytree(tmp_path / "good", path)
        json.dump(cfg, open(path / "config.json", "w"))
        with pytest.raises(ValueError, match=rf"^from_pretrained: .*{message}.*"):
            retrofit.from_pretrained(tf.GPT2LMHeadModel, str(path), **kwargs)


def _encoder(n: int = 8) -> tuple[nn.TransformerEncoder, dict]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return enc, retrofit.add_mask_prior(
        enc, logits=torch.randn(4, n, n, generator=torch.Generator().manual_seed(1)) * 3
    )


def _gpt2(n: int = 24):
    tf = _extra("transformers")
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=50, bos_token_id=0, eos_token_id=0,
                        attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
    model = tf.GPT2LMHeadModel(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    return model, retrofit.add_mask_prior(
        model, logits=mp.causal_distance_logits(n, 4) + torch.randn(4, n, n, generator=gen), param="full"
    )


def test_add_mask_prior_refuses_a_pattern_given_with_logits_and_changes_nothing():
    layer = nn.TransformerEncoderLayer(32, nhead=4, dim_feedforward=64, batch_first=True)
    enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    with pytest.raises(ValueError, match=r"add_mask_prior: got both a pattern and logits, and one would be dropped; .*"
                                         r"give pattern= .* or logits= .*, not both") as err:
        retrofit.add_mask_prior(enc, mp.banded_pattern(8, 1), logits=torch.zeros(4, 8, 8))
    _one_line(err)
    assert mp.mask_priors(enc) == [] and not any(m._forward_pre_hooks for m in enc.modules())


def test_add_mask_prior_still_takes_causal_and_prefix_none_as_the_layers_own():
    enc, priors = _encoder()
    assert all(p.causal is False and p.prefix is False for p in priors.values())
    model, priors = _gpt2()
    assert all(p.causal is True for p in priors.values())


def _permuted(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """M read by role: position i, j of the example -> M[rows[i], cols[j]]."""
    return logits[:, rows][:, :, cols]


def test_prior_roles_reads_m_by_role_in_an_nn_transformer_encoder():
    """Each example's positions read M at their roles: identity roles = no roles, bit for bit; other roles give each
    example the output of a twin whose M is read at those roles; a batch of another size than the roles is refused."""
    enc, priors = _encoder()
    x = torch.randn(2, 8, 32)
    plain = enc(x)
    ident = torch.arange(8).expand(2, 8).clone()
    with mp.prior_roles(enc, ident, ident):
        torch.testing.assert_close(enc(x), plain, atol=0, rtol=0)
    rows = torch.stack([torch.arange(8), torch.tensor([3, 1, 4, 0, 5, 2, 7, 6])])
    cols = torch.stack([torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]), torch.tensor([3, 1, 4, 0, 5, 2, 7, 6])])
    with mp.prior_roles(enc, rows, cols):
        by_role = enc(x)
    for b in range(2):
        twin = copy.deepcopy(enc)
        for p in mp.mask_priors(twin):
            p.set_logits(_permuted(p.bias.detach(), rows[b], cols[b]))
        torch.testing.assert_close(by_role[b:b + 1], twin(x[b:b + 1]), atol=1e-5, rtol=1e-5)
        assert (by_role[b] - plain[b]).abs().max() > 1e-2                  # the roles moved the output
    with pytest.raises(ValueError, match=r"layers.0.self_attn: prior_roles gave roles for 2 examples, but this call's "
                                         r"batch holds 3") as err:
        with mp.prior_roles(enc, rows, cols):
            enc(torch.randn(3, 8, 32))
    _one_line(err)


@pytest.mark.parametrize("padded", [False, True], ids=["no mask", "right-padded mask"])
def test_prior_roles_reads_m_by_role_in_a_causal_gpt2(padded, monkeypatch):
    """GPT-2 with a causal prior (its causal path without a mask, and with HF's padding mask): rising roles (row 1
    reads M two positions on) give each example the logits of a twin whose M is read at those roles; identity roles
    are no roles; the future stays masked."""
    model, priors = _gpt2()
    calls = []
    real = retrofit._causal_bias
    monkeypatch.setattr(retrofit, "_causal_bias", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(1, 50, (2, 20), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(2, 20, dtype=torch.long)
    if padded:
        mask[1, 16:] = 0
    kw = {"attention_mask": mask} if padded else {}
    plain = model(ids, **kw).logits
    ident = torch.arange(24).expand(2, 24).clone()
    with mp.prior_roles(model, ident, ident):
        torch.testing.assert_close(model(ids, **kw).logits, plain, atol=1e-6, rtol=1e-6)
    shifted = (torch.arange(24) + 2).clamp(max=23)
    roles = torch.stack([torch.arange(24), shifted])
    with mp.prior_roles(model, roles, roles):
        by_role = model(ids, **kw).logits
    assert calls                                        # every causal call of a retrofitted HF layer
    real_tokens = 16 if padded else 20
    for b in range(2):
        twin = copy.deepcopy(model)
        with torch.no_grad():                                   # M itself: its future half moves too
            for p in mp.mask_priors(twin):
                p.bias.copy_(_permuted(p.bias, roles[b], roles[b]))
        alone = twin(ids[b:b + 1, :real_tokens] if b else ids[b:b + 1]).logits[0]
        torch.testing.assert_close(by_role[b, :alone.shape[0]], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(by_role[0], plain[0], atol=1e-6, rtol=1e-6)
    assert (by_role[1, :real_tokens] - plain[1, :real_tokens]).abs().max() > 1e-3
    with mp.prior_roles(model, roles, roles):                            # later tokens stay unseen
        early = model(ids[:, :5], **({"attention_mask": mask[:, :5]} if padded else {})).logits
    torch.testing.assert_close(early, by_role[:, :5], atol=1e-5, rtol=1e-5)


def test_peft_on_a_model_whose_encoder_has_a_prior_refuses_a_frozen_m_and_trains_a_saved_one():
    """The README's recipe: the prior on bart.model.encoder, then LoRA. Without modules_to_save=['mask_prior'] the
    training forward that would leave M frozen (and unsaved) is one line naming the fix; with it M trains. PEFT first,
    then a prior on a part of the wrapped model: refused (its adapter would not save M)."""
    peft = _extra("peft")
    lora = dict(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model, inputs, _ = _seq2seq("bart")
    retrofit.add_mask_prior(model.model.encoder, mp.banded_pattern(10, 2))
    frozen = peft.get_peft_model(model, peft.LoraConfig(**lora)).train()
    with pytest.raises(RuntimeError, match=r"^layers.0.self_attn: M is frozen: PEFT's get_peft_model froze it .* pass "
                                           r"modules_to_save=\['mask_prior'\] to the PEFT config") as err:
        frozen(**inputs)
    _one_line(err)
    with torch.no_grad():
        frozen.eval()(**inputs)                                          # inference with a frozen M is fine
    model, inputs, _ = _seq2seq("bart")
    prior = retrofit.add_mask_prior(model.model.encoder, mp.banded_pattern(10, 2))["layers.0.self_attn"]
    start = prior.bias.detach().clone()
    tuned = peft.get_peft_model(model, peft.LoraConfig(modules_to_save=["mask_prior"], **lora)).train()
    opt = torch.optim.Adam([p for p in tuned.parameters() if p.requires_grad], lr=1e-2)
    opt.zero_grad()
    tuned(**inputs).logits.pow(2).mean().backward()
    opt.step()
    trained = model.model.encoder.layers[0].self_attn.mask_prior.modules_to_save["default"].bias
    assert trained.requires_grad and (trained - start).abs().max() > 1e-3
    model, _, _ = _seq2seq("bart")
    peft.get_peft_model(model, peft.LoraConfig(**lora))
    with pytest.raises(ValueError, match=r"is already wrapped by PEFT, whose adapter would not save M"):
        retrofit.add_mask_prior(model.model.encoder, mp.banded_pattern(10, 2))
    assert mp.mask_priors(model) == []


def test_mean_attention_refuses_maps_of_a_model_whose_attention_is_nan():
    enc, priors = _encoder()
    with torch.no_grad():
        enc.layers[1].self_attn.in_proj_weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^mean_attention: the attention maps hold \d+ non-finite values"):
        mp.mean_attention(enc, torch.randn(2, 8, 32))


@pytest.mark.parametrize("order", ["encoder first", "decoder first"])
@pytest.mark.parametrize("name", ["marian", "bart"])
def test_an_encoder_decoders_parts_take_priors_in_either_order_and_load_back_exactly(name, order, tmp_path):
    """Priors on model.encoder and model.decoder, one call each in either order: both recorded, saved and loaded
    with retrofit.from_pretrained, the outputs equal bit for bit; a second prior on a layer that has one is refused;
    taking the decoder's prior out leaves the encoder's record, which loads back alone."""
    tf = _extra("transformers")
    model, inputs, _ = _seq2seq(name)
    gen = torch.Generator().manual_seed(0)
    parts = {"encoder": (model.model.encoder, torch.randn(4, 10, 10, generator=gen) * 3),
             "decoder": (model.model.decoder, _past(torch.randn(4, 6, 6, generator=gen) * 3))}
    for part in (("encoder", "decoder") if order == "encoder first" else ("decoder", "encoder")):
        module, logits = parts[part]
        assert list(retrofit.add_mask_prior(module, logits=logits)) == ["layers.0.self_attn"]
    assert sorted(retrofit.prior_record(model)["layers"]) == ["model.decoder.layers.0.self_attn",
                                                        "model.encoder.layers.0.self_attn"]
    out = model(**inputs).logits
    with pytest.raises(ValueError, match=r"layers.0.self_attn .* already has a MaskPrior"):
        retrofit.add_mask_prior(model.model.decoder, logits=parts["decoder"][1])
    model.save_pretrained(tmp_path / "both")
    back = retrofit.from_pretrained(tf.AutoModelForSeq2SeqLM, str(tmp_path / "both")).eval()
    assert sorted(p.where for p in mp.mask_priors(back)) == ["model.decoder.layers.0.self_attn",
                                                             "model.encoder.layers.0.self_attn"]
    torch.testing.assert_close(back(**inputs).logits, out, atol=0, rtol=0)
    for p, q in zip(mp.mask_priors(model), mp.mask_priors(back)):
        assert p.where.endswith(q.where.rpartition("model.")[2].split(".", 1)[1]) and p.causal == q.causal
    retrofit.remove_mask_prior(model.model.decoder)
    assert list(retrofit.prior_record(model)["layers"]) == ["model.encoder.layers.0.self_attn"]
    enc_only = model(**inputs).logits
    model.save_pretrained(tmp_path / "encoder")
    again = retrofit.from_pretrained(tf.AutoModelForSeq2SeqLM, str(tmp_path / "encoder")).eval()
    assert [p.where for p in mp.mask_priors(again)] == ["model.encoder.layers.0.self_attn"]
    torch.testing.assert_close(again(**inputs).logits, enc_only, atol=0, rtol=0)


def test_models_built_from_one_config_each_hold_their_own_prior_and_save_it_alone(tmp_path):
    """The record of a model's priors is the model's, read from it at each save, never written into the config it
    shares: two models from one config (and a third from model.config) each take a prior; one never given a prior
    saves and loads plainly; two BartEncoders of one config each save their own; the shared config is untouched."""
    tf = _extra("transformers")
    cfg = tf.GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64, vocab_size=50, bos_token_id=0, eos_token_id=0)
    before = cfg.to_dict()
    a, b = tf.GPT2LMHeadModel(cfg).eval(), tf.GPT2LMHeadModel(cfg).eval()
    retrofit.add_mask_prior(a, logits=mp.causal_distance_logits(64, 4))
    retrofit.add_mask_prior(b, logits=mp.causal_distance_logits(64, 4) * 2)
    copy = tf.GPT2LMHeadModel(a.config).eval()                        # a student of the same shape
    retrofit.add_mask_prior(copy, logits=mp.causal_distance_logits(64, 4))
    plain = tf.GPT2LMHeadModel(cfg).eval()
    assert cfg.to_dict() == before and not hasattr(cfg, "mask_prior")
    x = torch.randint(1, 50, (2, 9))
    for name, model in (("a", a), ("b", b), ("plain", plain)):
        model.save_pretrained(tmp_path / name)
    assert cfg.to_dict()["architectures"] == ["GPT2LMHeadModel"] and not hasattr(cfg, "mask_prior")
    assert "mask_prior" not in json.load(open(tmp_path / "plain" / "config.json"))
    again = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "plain").eval()          # plainly, as it was saved
    torch.testing.assert_close(again(x).logits, plain(x).logits, atol=0, rtol=0)
    for name, model in (("a", a), ("b", b)):
        back = retrofit.from_pretrained(tf.GPT2LMHeadModel, str(tmp_path / name)).eval()
        torch.testing.assert_close(back(x).logits, model(x).logits, atol=0, rtol=0)
        assert not hasattr(back.config, "mask_prior")                           # read, not kept: its own again
    bart, _, _ = _seq2seq("bart")
    other = type(bart.model.encoder)(bart.config).eval()                        # two parts of one class
    retrofit.add_mask_prior(bart.model.encoder, logits=torch.randn(4, 10, 10))
    retrofit.add_mask_prior(other, logits=torch.randn(4, 10, 10))
    assert retrofit.prior_record(bart)["layers"].keys() == {"model.encoder.layers.0.self_attn"}
    assert retrofit.prior_record(other)["layers"].keys() == {"layers.0.self_attn"}


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention with an `attn_mask` keyword (two lines added): what `modules=` reaches."""
    def __init__(self, dim=32, n_head=4):
        super().__init__()
        self.n_head, self.c_attn, self.c_proj = n_head, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x, attn_mask=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=attn_mask is None)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


def _torch_encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval(), torch.randn(2, 16, 32), 16


def _nanogpt():
    torch.manual_seed(0)
    return (
        nn.Sequential(CausalSelfAttention(), nn.LayerNorm(32), CausalSelfAttention()).eval(),
        torch.randn(2, 12, 32),
        12,
    )


@dataclasses.dataclass
class Family:
    """A row of the README's models table, as the behaviour matrix meets it: how to build a small one (model in eval
    mode, an input, the prior's N), what it is ("causal": a decoder LM; "text": an encoder of tokens; "image";
    "seq2seq"; "towers": a model of several towers, one add_mask_prior call for all; "torch": nn.TransformerEncoder;
    "keyword": an attention named with modules=), whether it is a transformers model, and add_mask_prior's other
    arguments."""
    build: Callable
    kind: str
    hf: bool = True
    attach: dict = dataclasses.field(default_factory=dict)


FAMILIES = {
    **{n: Family(lambda n=n: _hf(n), "causal" if n in HF_CAUSAL else "text" if n in ("bert", "clip-text") else "image")
       for n in HF_MODELS},
    **{n: Family(lambda n=n: _seq2seq(n), "seq2seq") for n in SEQ2SEQ},
    **{n: Family(lambda n=n: _timm(n), "image", hf=False) for n in TIMM_MODELS},
    "clip-both-towers": Family(_clip, "towers"),
    "gpt2-built-eager": Family(lambda: _eager("gpt2"), "causal"),
    "nn.TransformerEncoder": Family(_torch_encoder, "torch", hf=False),
    "nanoGPT-style": Family(_nanogpt, "keyword", hf=False, attach=dict(causal=True, modules=CausalSelfAttention)),
}


PRIORS = ("neutral", "real")


def _run(model, x, **kw):
    y = model(**x, **kw) if isinstance(x, dict) else model(x, **kw)
    return y if isinstance(y, torch.Tensor) else y[0]


def _attach(fam: Family, model, n: int, prior: str) -> dict:
    """A neutral prior (M = +30: log sigmoid(M) = -1e-13, the plain model's outputs) or a real one (ALiBi-like
    distances: causal layers store it by distance, the others in full)."""
    logits = torch.full((n, n), 30.0) if prior == "neutral" else mp.causal_distance_logits(n, 1)[0]
    param = None if fam.kind in ("causal", "keyword") else "full"
    return retrofit.add_mask_prior(model, logits=logits, param=param, **fam.attach)


def _same(a, b, atol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=atol, equal_nan=True)


def _built(name: str, prior: str):
    """A family's model with a prior, its input and N, and the plain model's output."""
    fam = FAMILIES[name]
    model, x, n = fam.build()
    with torch.no_grad():
        plain = _run(model, x)
    _attach(fam, model, n, prior)
    return fam, model, x, n, plain


def _behaves_from_one_config(name):
    """Several models from one config (and one from model.config): each holds its own prior, the shared config
    stays as it was, and one never given a prior records none."""
    model, x, n = FAMILIES[name].build()
    cfg, before = model.config, model.config.to_dict()
    twin, student, plain = (type(model)(c).eval() for c in (cfg, model.config, cfg))
    for prior, m in zip(("neutral", "real", "neutral"), (model, twin, student)):
        with torch.no_grad():
            alone = _run(m, x)
        _attach(FAMILIES[name], m, n, prior)
        if prior == "neutral":
            _same(_run(m, x), alone)
    assert cfg.to_dict() == before and retrofit.prior_record(plain) is None
    assert [len(retrofit.prior_record(m)["layers"]) for m in (model, twin, student)] == [len(mp.mask_priors(model))] * 3


def _behaves_eager_and_sdpa(name):
    """The prior follows the model's implementation: sdpa = eager with it (where the model has both); under a neutral
    prior, = the plain model."""
    for prior in PRIORS:
        fam, model, x, n, plain = _built(name, prior)
        outs = []
        for impl in ("sdpa", "eager") if type(model)._supports_sdpa else ("eager",):
            model.set_attn_implementation(impl)
            outs.append(_run(model, x))
        _same(outs[0], outs[-1], atol=1e-4)                            # measured: <= 2e-5
        if prior == "neutral":
            _same(outs[-1], plain, atol=1e-4)


def _generate(model, x, **kw):
    ids = ({k: v for k, v in x.items() if not k.startswith("decoder")} if isinstance(x, dict)
           else dict(inputs=x[:, :6]))
    out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=0, output_logits=True,
                         return_dict_in_generate=True, **kw)
    return out.sequences, torch.stack(out.logits)


def _behaves_with_the_kv_cache(name):
    """generate with the KV cache = without it; under a neutral prior, = the plain model's."""
    fam, model, x, n, _ = _built(name, "neutral")
    twin = fam.build()[0]
    for prior in PRIORS:
        cached, uncached = _generate(model, x, use_cache=True), _generate(model, x, use_cache=False)
        assert torch.equal(cached[0], uncached[0])
        _same(cached[1], uncached[1])
        if prior == "neutral":
            plain = _generate(twin, x)
            assert torch.equal(cached[0], plain[0])
            _same(cached[1], plain[1])
            fam, model, x, n, _ = _built(name, "real")


def _padded(ids: torch.Tensor, where: str, k: int = 3):
    """ids (1, T) padded with k pad tokens on the left, the right, or as a hole after its second token; the mask,
    the position ids the model gives them (attention_mask.cumsum(-1) - 1) and the real tokens' slots."""
    pad = torch.zeros(1, k, dtype=torch.long)
    parts = {"left": [pad, ids], "right": [ids, pad], "hole": [ids[:, :2], pad, ids[:, 2:]]}[where]
    mask = torch.cat([torch.zeros_like(p) if p is pad else torch.ones_like(p) for p in parts], 1)
    return torch.cat(parts, 1), mask, (mask.cumsum(-1) - 1).clamp(min=0), mask[0].bool()


def _behaves_padded(name):
    """Left and right padding and a hole, at the position ids the model reads: under a neutral prior, the plain
    model's outputs; under a real one, a padded sequence's real tokens get what they get alone, wherever the plain
    model's do (a sliding window counts pads: Mistral's hole is its own) and the model gives its attention the
    position ids (CLIP's text tower gives it none: there the prior reads slots, and right padding alone is exact)."""
    for prior in PRIORS:
        fam, model, x, n, _ = _built(name, prior)
        plain = fam.build()[0]
        ids = x[:1, :8]
        for where in ("left", "right", "hole"):
            padded, mask, pos, real = _padded(ids, where)
            kw = dict(attention_mask=mask, position_ids=pos)
            with torch.no_grad():
                out, base = _run(model, padded, **kw)[0], _run(plain, padded, **kw)[0]
                invariant = _close(base[real], _run(plain, ids)[0]) and (where == "right" or name != "clip-text")
            if prior == "neutral":
                _same(out[real], base[real])
            elif invariant:
                _same(out[real], _run(model, ids)[0])


def _close(a, b) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-5, rtol=1e-5))


def _behaves_packed(name):
    """Packed sequences (position ids that restart, no mask, as DataCollatorWithFlattening passes them): under a
    neutral prior, the plain model's logits; under a real one, each sequence's logits alone."""
    for prior in PRIORS:
        fam, model, x, n, _ = _built(name, prior)
        plain = fam.build()[0]
        a, b = x[:1, :7], x[1:, :5]
        kw = dict(position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None], use_cache=False)
        with torch.no_grad():
            packed, base = (m(torch.cat([a, b], 1), **kw).logits[0] for m in (model, plain))
            alone = torch.cat([model(a).logits[0], model(b).logits[0]])
        _same(packed, base if prior == "neutral" else alone)


def _behaves_compiled(name):
    """A static KV cache under torch.compile(fullgraph=True), as generate compiles it on a GPU: the tokens and
    logits of the uncompiled model (no value read back breaks the graph); under a neutral prior, the plain model's.
    One compiled model: its M set to the real prior's values afterwards is read by the same graph."""
    tf = _extra("transformers")
    fam, model, x, n, _ = _built(name, "neutral")
    cc = tf.CompileConfig(fullgraph=True, backend="eager")
    cc._compile_all_devices = True                               # on the CPU too
    for prior in PRIORS:
        if prior == "real":
            for p in mp.mask_priors(model):
                p.set_logits(mp.causal_distance_logits(n, 1)[0])
        eager = _generate(model, x, cache_implementation="static")
        compiled = _generate(model, x, cache_implementation="static", compile_config=cc)
        assert torch.equal(compiled[0], eager[0])
        _same(compiled[1], eager[1])
        if prior == "neutral":
            assert torch.equal(eager[0], _generate(fam.build()[0], x, cache_implementation="static")[0])
    torch._dynamo.reset()


def _behaves_traced(name):
    """torch.jit.trace and torch.fx, where the plain model traces: the traced model gives the model's outputs (a
    neutral prior's: the plain model's); torch.jit.script, which compiles every Python hook, is refused in one line
    naming what works."""
    for prior in PRIORS:
        fam, model, x, n, plain = _built(name, prior)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = torch.jit.trace(model, x, check_trace=False, strict=False)
            y = traced(x)
            y = y if isinstance(y, torch.Tensor) else next(iter(y.values())) if isinstance(y, dict) else y[0]
            _same(y, _run(model, x))
            if fam.kind == "image" and not fam.hf:               # timm's feature extraction traces with fx
                _same(torch.fx.symbolic_trace(model)(x), _run(model, x))
            if prior == "neutral":
                _same(y, plain)
        with pytest.raises(ValueError, match="torch.jit.script cannot compile a model that holds a MaskPrior .* "
                                             "trace it .* compile it .* or export it") as err:
            torch.jit.script(model)
        _one_line(err)


def _behaves_on_the_meta_device(name):
    """Built on the meta device (as large models and the peers' suites build), the prior added there with logits on
    the CPU, then to_empty: M has memory but no values (a prior that refuses to serve:
    test_an_m_that_to_empty_left_without_values_is_refused_until_set_or_loaded_and_torchscript_is_one_line) until
    the model's initialiser sets it (a transformers model's init_weights, else reset_parameters), to the logits it
    started from; under a neutral prior the outputs are the plain model's with the same weights."""
    for prior in PRIORS:
        fam = FAMILIES[name]
        model, x, n = fam.build()
        with torch.device("meta"):
            model = (type(model)(model.config) if fam.hf else fam.build()[0] if fam.kind != "image"
                     else _timm(name)[0]).eval()
        priors = _attach(fam, model, n, prior)
        assert all(p.bias.is_meta for p in priors.values())
        model.to_empty(device="cpu")
        assert all(p.unset for p in priors.values())                      # served only once set
        if fam.hf:
            model.init_weights()
        else:
            for m in model.modules():
                if hasattr(m, "reset_parameters") and not isinstance(m, nn.MultiheadAttention):
                    m.reset_parameters()
        assert all(torch.equal(p.bias, p.start) for p in priors.values())
        with torch.no_grad():
            out = _run(model, x)
            retrofit.remove_mask_prior(model)
            if prior == "neutral":
                _same(out, _run(model, x))


def _behaves_saved_and_loaded(name, tmp_path):
    """Saved and loaded: a transformers model through save_pretrained and retrofit.from_pretrained (with and without
    output_loading_info and the model's attn_implementation), anything else through its state_dict into a fresh
    retrofit: the outputs bit for bit (a model built eager, reloaded with the default dispatch: to rounding)."""
    for prior in PRIORS:
        fam, model, x, n, plain = _built(name, prior)
        if fam.hf:
            model.save_pretrained(tmp_path / prior)
            back = retrofit.from_pretrained(type(model), str(tmp_path / prior)).eval()
            again, info = retrofit.from_pretrained(type(model), str(tmp_path / prior), output_loading_info=True,
                                                   attn_implementation=model.config._attn_implementation)
            assert not info["missing_keys"] and not info["unexpected_keys"]
        else:
            back = fam.build()[0]
            _attach(fam, back, n, "real" if prior == "neutral" else "neutral")
            back.load_state_dict(model.state_dict())
            again = back
        # built eager: back has the dispatch transformers gives (sdpa), to rounding; again asked for eager
        exact = not fam.hf or back.config._attn_implementation == model.config._attn_implementation
        with torch.no_grad():
            for m, atol in ((back, 0 if exact else 1e-5), (again.eval(), 0)):
                _same(_run(m, x), _run(model, x), atol=atol)


def _behaves_with_gradient_checkpointing(name):
    """Gradient checkpointing, training: the same loss and M's gradient as without it."""
    for prior in PRIORS:
        fam, model, x, n, plain = _built(name, prior)
        model.train()
        grads = []
        for checkpointing in (False, True):
            if checkpointing:
                model.activation_checkpointing_enable({"use_reentrant": False})
            model.zero_grad()
            _run(model, x).float().pow(2).mean().backward()
            grads.append([p.bias.grad.clone() for p in mp.mask_priors(model)])
        for a, b in zip(*grads):
            _same(a, b)


TEXT = ("causal", "text")


BEHAVIOURS = {        # name: (the families' kinds it applies to (None: all), transformers only, the behaviour)
    "one config": (None, True, _behaves_from_one_config),
    "eager/sdpa": (None, True, _behaves_eager_and_sdpa),
    "KV cache": (("causal", "seq2seq"), True, _behaves_with_the_kv_cache),
    "padding, holes": (TEXT, True, _behaves_padded),
    "packed": (("causal",), True, _behaves_packed),
    "compiled static cache": (("causal",), True, _behaves_compiled),
    "trace, fx, script": (("torch", "image"), False, _behaves_traced),
    "meta device": (None, False, _behaves_on_the_meta_device),
    "save, load": (None, False, _behaves_saved_and_loaded),
    "checkpointing": (None, True, _behaves_with_gradient_checkpointing),
}


MATRIX = [(f, b) for b, (kinds, hf_only, _) in BEHAVIOURS.items() for f, fam in FAMILIES.items()
          if (kinds is None or fam.kind in kinds) and (fam.hf or not hf_only)]


@pytest.mark.slow
@pytest.mark.parametrize("family, behaviour", MATRIX)
def test_each_family_behaves_as_its_plain_model_with_a_prior(family, behaviour, tmp_path):
    """The peers' own suites (transformers', timm's) as a matrix of our own: each family of the README's models
    table x each behaviour it has (BEHAVIOURS), under a neutral prior the plain model's outputs, under a real one
    self-consistent (cache = no cache, padded = unpadded, saved = loaded). A family added to FAMILIES gets every
    behaviour of its kind."""
    run = BEHAVIOURS[behaviour][2]
    run(family, tmp_path) if "tmp_path" in inspect.signature(run).parameters else run(family)


@pytest.mark.slow
def test_bench_retrofit_prints_the_ratio_side_by_side(monkeypatch, capsys):
    _extra("timm"), _extra("transformers")
    code, out = _bench(monkeypatch, capsys, "bench_retrofit.py", "--tiny", "--steps", "1", "--rounds", "1")
    rows = out.splitlines()[2:]
    assert code == 0 and len(rows) == 9, out
    for plain, floor, prior, name in zip(rows[::3], rows[1::3], rows[2::3],
                                         ("timm ViT-Tiny", "GPT-2 toy", "nn.TransformerEncoder")):
        assert plain.startswith(name) and plain.split()[-1] == "1.000" and prior.startswith("  + prior")
        assert floor.startswith("  floor (M constant)") and float(floor.split()[-1]) > 0 < float(prior.split()[-1])
    code, out = _bench(monkeypatch, capsys, "bench_retrofit.py", "--tiny", "--steps", "1", "--rounds", "1",
                       "--models", "vit", "--grid")
    assert code == 0 and out.splitlines()[2].startswith("timm ViT-Tiny (17 tokens, grid M)"), out
    code, out = _bench(monkeypatch, capsys, "bench_retrofit.py", "--tiny", "--models", "gpt2,encoder", "--grid")
    assert code == 2 and out == ""                      # --grid without the ViT: refused before anything runs


def test_the_peer_plugin_gives_each_model_one_prior_and_the_runner_reads_junit(tmp_path, monkeypatch):
    """benchmarks/peer_plugin.py, which runs transformers' and timm's own suites with a prior on every model they
    build (benchmarks/peer_suites.py): a neutral prior at the model's positions, once per model (a second post_init
    adds none), a real one that moves the output, an encoder-decoder's on both parts; where maskprior_retrofit does
    not import, the plugin stops the run (it ran the plain models and reported nothing newly failing); peer_suites
    reads a JUnit file's passed, failed and skipped."""
    tf = _extra("transformers")
    monkeypatch.syspath_prepend(os.path.join(HERE, "benchmarks"))
    import peer_plugin
    import peer_suites
    for mode in ("neutral", "real"):
        monkeypatch.setattr(peer_plugin, "MODE", mode)
        model, x, _ = _hf("gpt2")
        plain = _out(model, x)
        peer_plugin.attach(model)
        peer_plugin.attach(model)
        priors = mp.mask_priors(model)
        assert len(priors) == 2 and all(p.n == 64 and p.param == "relative" for p in priors)
        changed = (_out(model, x) - plain).abs().max()
        assert changed < 1e-5 if mode == "neutral" else changed > 1e-3
    bert = tf.BertModel(tf.BertConfig(num_hidden_layers=1, num_attention_heads=2, hidden_size=8, intermediate_size=8,
                                      max_position_embeddings=16, vocab_size=10))
    peer_plugin.attach(bert)
    assert [p.param for p in mp.mask_priors(bert)] == ["relative"]          # a text encoder's, by distance
    for name in ("bart", "t5"):        # every layer by distance (a full M on the encoder: refused); T5 at its buckets'
        seq2seq = _seq2seq(name)[0]
        peer_plugin.attach(seq2seq)
        assert {(p.param, p.causal) for p in mp.mask_priors(seq2seq)} == {("relative", False), ("relative", True)}
    monkeypatch.setitem(sys.modules, "maskprior_retrofit", None)             # not importable
    with pytest.raises(ImportError, match="maskprior_retrofit"):
        peer_plugin.pytest_configure(None)
    xml = tmp_path / "run.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="a" name="t1"/><testcase classname="a" name="t2">'
                   '<failure message="x"/></testcase><testcase classname="a" name="t3"><skipped/></testcase>'
                   '</testsuite></testsuites>')
    assert peer_suites.outcomes(str(xml)) == {"a::t1": "passed", "a::t2": "failed", "a::t3": "skipped"}


def _shown(names) -> str:
    return ", ".join(SHOWN[n] for n in names)


MODEL_TABLE = [  # (model or use, what the prior does there, the test that runs it)
    (
        "`nn.MultiheadAttention`, `nn.Transformer`",
        "works; cross-attention when asked",
        "test_nn_transformer_self_attention_gets_the_prior_and_cross_attention_only_when_asked",
    ),
    (
        f"HF {_shown(HF_MODELS)}",
        "works per layer: M = +30 is the plain model, M moves the output and trains",
        "test_hugging_face_models_take_a_prior_per_layer",
    ),
    (
        f"HF {_shown(SEQ2SEQ)}",
        "works: encoder and decoder self-attention; cross-attention when asked; generate with the cache = without",
        "test_encoder_decoders_give_self_attention_a_prior_and_cross_attention_one_when_asked",
    ),
    (
        "HF layers sharing one config",
        "works for any subset (a part, `modules=`), saved and loaded",
        "test_layers_that_share_a_config_take_a_prior_in_any_subset_and_save_and_load",
    ),
    (
        f"HF batched generate, left padding, sliding window ({_shown(LEFT_PADDED)})",
        "works: each row's positions",
        "test_left_padded_batches_read_each_rows_positions_so_batched_generate_equals_each_prompt",
    ),
    (f"timm {_shown(TIMM_MODELS)}", "works", "test_timm_vits_take_a_prior_per_layer"),
    (
        "timm `dynamic_img_size`, HF ViT `interpolate_pos_encoding`: another image size",
        '`param="grid"` serves it by patch displacement; another prior: refused, naming it',
        "test_a_vit_given_an_image_of_another_size_is_served_by_the_grid_prior_its_refusal_names",
    ),
    (
        "your attention with an `attn_mask` keyword",
        "works (`modules=`)",
        "test_a_nanogpt_style_attention_takes_a_prior_through_its_mask_keyword",
    ),
    (
        'PEFT: the prior first, `modules_to_save=["mask_prior"]`',
        "works: M trains, is saved with the adapter, merged "
        "and reloaded; without it, or PEFT first: refused in one line naming it",
        "test_peft_keeps_m_trainable_and_saved_with_the_adapter_or_says_how_in_one_line",
    ),
    (
        "an adapter saved with M, loaded by plain PEFT",
        "refused anywhere, naming `maskprior_retrofit`; onto a model given its priors: M back",
        "test_an_adapter_saved_with_m_refuses_a_plain_load_in_a_process_that_never_imported_maskprior",
    ),
    (
        f"{_shown(UNREACHABLE[:-1])}; a pattern larger than Swin's window",
        "refused in one line, the model unchanged",
        "test_a_layer_the_prior_cannot_reach_or_a_pattern_it_would_cut_is_refused_and_nothing_changes",
    ),
    (
        "`retrofit.remove_mask_prior(model)`",
        "the plain model back, exactly",
        "test_remove_mask_prior_gives_the_plain_model_back_exactly",
    ),
    (
        "`retrofit.from_pretrained(Model or Auto*, path)`",
        "the priors back, exactly; a record or checkpoint without every M: refused",
        "test_from_pretrained_refuses_a_record_or_checkpoint_that_does_not_hold_every_m",
    ),
    (
        "each family above x " + ", ".join(BEHAVIOURS),
        "neutral M: the plain model; real M: cache = no cache, padded = "
        "alone, saved = loaded; `torch.jit.script`: refused in one line",
        "test_each_family_behaves_as_its_plain_model_with_a_prior",
    ),
]


def test_readme_table_of_models_is_what_the_tests_run():
    """The README's table of models is MODEL_TABLE, built from the lists the retrofit tests are parametrized with,
    and every row names a test that exists."""
    readme = open(os.path.join(HERE, "README.md")).read()
    table = readme.split("<!-- models -->\n", 1)[1].split("<!-- /models -->", 1)[0]
    rows = ["| model or use | the prior | test |", "|---|---|---|"] + [
        f"| {a} | {b} | `{c}` |" for a, b, c in MODEL_TABLE
    ]
    assert table.strip().splitlines() == rows
    assert all(callable(globals().get(c)) for _, _, c in MODEL_TABLE)
