"""pytest plugin: run transformers' and timm's own model tests with a prior on every model they build.

    MASKPRIOR_PEER=neutral|real python -m pytest -p peer_plugin ...   (benchmarks/ on PYTHONPATH)

`neutral`: logits = +30 everywhere (log sigmoid(30) ~ -1e-13: the outputs must equal the plain model's);
`real`: `causal_distance_logits` (nothing may crash). N is the model's positions: its config's
max_position_embeddings / n_positions (T5: relative_attention_max_distance), or a timm ViT's patch grid plus
prefix tokens. Every model is given the prior when its outermost constructor returns (transformers: the
model whose post_init ends the construction; timm: create_model), so a model built inside another is not given
a second one. A folder saved with priors is loaded the way a user of the prior loads it, through
`retrofit.from_pretrained`. MASKPRIOR_PEER_LOG=FILE appends a JSON line per model: attached, refused or skipped (why).
"""
import functools
import importlib.util
import json
import os

import torch

MODE = os.environ.get("MASKPRIOR_PEER", "off")
LOG = os.environ.get("MASKPRIOR_PEER_LOG")
_state = {"test": None, "building": [], "loading": 0}


def _log(**event):
    if LOG:
        with open(LOG, "a") as f:
            f.write(json.dumps({"test": _state["test"], **event}) + "\n")


def _positions(model) -> int | None:
    embed = getattr(model, "patch_embed", None)
    if embed is not None and isinstance(getattr(embed, "num_patches", None), int):
        return embed.num_patches + int(getattr(model, "num_prefix_tokens", 0))
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for attr in ("max_position_embeddings", "n_positions", "relative_attention_max_distance"):   # the last: T5's
        if isinstance(getattr(cfg, attr, None), int):
            return getattr(cfg, attr)
    return None


def attach(model) -> None:
    import maskprior as mp
    import maskprior_retrofit as retrofit
    if mp.mask_priors(model):                    # post_init called again on a built model
        return
    n = _positions(model)
    sites = retrofit.find_attention(model) if n else []
    if not sites:
        _log(event="skipped", cls=type(model).__name__, why="no positions" if not n else "no attention")
        return
    heads = sites[0].heads or 1
    with torch.device("cpu"):                    # values, also where the test builds on the meta device
        logits = torch.full((n, n), 30.0) if MODE == "neutral" else mp.causal_distance_logits(n, heads)
    # a text model's M by distance (the library's default for a causal layer; a full one on an encoder, 2M parameters
    # on BERT's 512 positions, fails the suite's own size check), an image model's in full (a prior on its grid)
    param = "full" if hasattr(model, "patch_embed") else "relative"
    try:
        priors = retrofit.add_mask_prior(model, logits=logits, param=param)
    except ValueError as e:
        _log(event="refused", cls=type(model).__name__, error=str(e)[:400])
        raise
    _log(event="attached", cls=type(model).__name__, layers=len(priors), n=n)


def _install_transformers() -> None:
    from transformers import AutoConfig, PreTrainedModel
    import maskprior_retrofit as retrofit
    init, post_init = PreTrainedModel.__init__, PreTrainedModel.post_init
    load = PreTrainedModel.from_pretrained.__func__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        _state["building"].append(self)
        init(self, *args, **kwargs)

    @functools.wraps(post_init)
    def post_init_(self, *args, **kwargs):
        post_init(self, *args, **kwargs)
        building = _state["building"]
        if self in building:
            building.remove(self)
        if not building and not _state["loading"]:
            attach(self)

    @functools.wraps(load)
    def from_pretrained(cls, *args, **kwargs):
        path, saved = args[0] if args else kwargs.get("pretrained_model_name_or_path"), None
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, "config.json")):
            saved = getattr(AutoConfig.from_pretrained(path), "mask_prior", None)
        if not saved or len(args) > 1 or _state["loading"]:          # retrofit.from_pretrained's own call: as it is
            return load(cls, *args, **kwargs)
        kwargs.pop("pretrained_model_name_or_path", None)
        _state["loading"] += 1
        try:
            return retrofit.from_pretrained(cls, path, **kwargs)
        finally:
            _state["loading"] -= 1

    PreTrainedModel.__init__, PreTrainedModel.post_init = __init__, post_init_
    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _install_timm() -> None:
    import timm
    import timm.models._factory as factory
    create = factory.create_model

    @functools.wraps(create)
    def create_model(*args, **kwargs):
        model = create(*args, **kwargs)
        attach(model)
        return model
    factory.create_model = timm.create_model = timm.models.create_model = create_model


def pytest_configure(config):
    if MODE == "off":
        return
    import maskprior_retrofit  # noqa: F401  (ours must import: missing, it is this error, not a plain run)
    for peer, install in (("transformers", _install_transformers), ("timm", _install_timm)):
        if importlib.util.find_spec(peer) is not None:
            install()


def pytest_runtest_setup(item):
    _state["test"], _state["building"] = item.nodeid, []
