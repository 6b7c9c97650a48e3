"""The one sampling home: items in, latents out, for the ``generate`` command and the training
previews alike.

A batch of :class:`~dit_mcore.generate.items.Item` becomes the model's conditioning (class labels, or
prompts through the dataset's text encoder), its noise comes from each item's own generator, and the
objective's sampler integrates it with classifier-free guidance, batched in one call or split over
two ranks (CFG-parallel). The model is reached through the family's ``image_model_fn``, i.e. the
training-time calling convention, on a pipelined model as on a plain one.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional, Sequence

import torch

from dit_mcore.errors import ConfigError
from dit_mcore.diffusion import sample
from dit_mcore.generate.items import Item, item_noise, item_seed
from dit_mcore.generate.pipefusion import check_sampler
from dit_mcore.models.text import TextContext

log = logging.getLogger(__name__)

_SAMPLER_NOISE = 0x5EED_0F_A5CE  # the stream of a stochastic sampler's noise differs from the start noise's

TextEncode = Callable[[list], list]
"""``encode(prompts) -> [L_i, text_dim]`` tensors, one per prompt."""


def latent_shape(model_config, *, frames: Optional[int] = None, height: Optional[int] = None,
                 width: Optional[int] = None) -> tuple:
    """The latent of one item: ``(C, H, W)``, or ``(C, T, H, W)`` when ``frames`` is given; sides
    default to the model's ``input_size``. Refuses sizes the patches do not tile."""
    height = model_config.input_size if height is None else height
    width = model_config.input_size if width is None else width
    p, pt = model_config.patch_size, getattr(model_config, "patch_size_t", 1) or 1
    for name, side in (("height", height), ("width", width)):
        if side < p or side % p:
            raise ConfigError(f"--{name} {side}: latents must be a positive multiple of the model's patch size "
                              f"{p} (the model was trained at {model_config.input_size})")
    if frames is None:
        if pt != 1:
            raise ConfigError(f"the model patches {pt} frames per token: give --frames (a multiple of {pt})")
        return (model_config.in_channels, height, width)
    if frames < pt or frames % pt:
        raise ConfigError(f"--frames {frames}: must be a positive multiple of the model's temporal patch size {pt}")
    return (model_config.in_channels, frames, height, width)


def conditioning(items: Sequence[Item], model_config, encode: Optional[TextEncode], device=None) -> dict:
    """The sampler's ``labels``/``null_label``/``text`` for ``items``. A text model conditioned on
    labels too samples its prompts with the null class (prompts name no class)."""
    if model_config.text_dim:
        if any(it.prompt is None for it in items):
            raise ConfigError("this model is conditioned on text: give --prompts or --prompt-file, not --labels")
        if encode is None:
            raise ConfigError("no text encoder for this model's prompts: the run's dataset recorded none "
                              "(energon_data.prepare --text-encoder), and the built-in ones are moving_digits'")
        text = TextContext.from_list([e.float() for e in encode([it.prompt for it in items])]).to(device)
        if not model_config.num_classes:
            return {"text": text}
        if not model_config.use_cfg_embedding:
            raise ConfigError("this text model also takes class labels but has no null class "
                              "(trained with model.class_dropout_prob=0), so prompts alone cannot drive it")
        null = model_config.num_classes
        return {"text": text, "null_label": null,
                "labels": torch.full((len(items),), null, dtype=torch.long, device=device)}
    if not model_config.num_classes:
        return {}
    if any(it.label is None for it in items):
        raise ConfigError("this model is conditioned on class labels: give --labels, not --prompts")
    bad = [it.label for it in items if not 0 <= it.label < model_config.num_classes]
    if bad:
        raise ConfigError(f"--labels {bad[0]}: out of range; this model has classes 0..{model_config.num_classes - 1}")
    return {"labels": torch.tensor([it.label for it in items], dtype=torch.long, device=device),
            "null_label": model_config.num_classes if model_config.use_cfg_embedding else None}


def check_guidance(model_config, cfg_scale: float) -> None:
    """Guidance needs the unconditional model: a null class or the null text."""
    if cfg_scale != 1.0 and not model_config.text_dim and not model_config.num_classes:
        raise ConfigError(f"--cfg-scale {cfg_scale}: this model is unconditional, so there is nothing to guide by; "
                          "use --cfg-scale 1")
    if cfg_scale != 1.0 and not model_config.text_dim and not model_config.use_cfg_embedding:
        raise ConfigError(f"--cfg-scale {cfg_scale}: this model has no null class (trained with "
                          "model.class_dropout_prob=0), so it cannot be guided; use --cfg-scale 1")


@torch.no_grad()
def sample_items(model_fn, model_config, objective, items: Sequence[Item], *, shape: Sequence[int], seed: int,
                 steps: int, cfg_scale: float, sampler: Optional[str] = None, encode: Optional[TextEncode] = None,
                 device=None, cfg_group=None, pipefusion=None) -> torch.Tensor:
    """Latents ``[len(items), *shape]`` for ``items``: each one's noise from ``(seed, item.index)``, the
    objective's ``sampler`` (None: its default) over ``steps``, guided with ``cfg_scale`` (split over
    the two ranks of ``cfg_group`` when given). ``model_fn``: the family's ``image_model_fn``;
    ``pipefusion``: a :class:`~dit_mcore.generate.pipefusion.PipeFusion`, which runs the sampler patch by
    patch through its pipeline instead (``model_fn`` unused)."""
    check_guidance(model_config, cfg_scale)
    cond = conditioning(items, model_config, encode, device)
    noise = item_noise(items, seed, shape, device)
    if objective.name == "ddpm":  # stochastic samplers: each row's fresh noise from its own item too
        cond["noise_seed"] = [item_seed(seed, it.index) ^ _SAMPLER_NOISE for it in items]
    if pipefusion is not None:
        check_sampler(sampler)
        return pipefusion.sample(lambda fn, x: sample(objective, fn, x, steps=steps, sampler=sampler,
                                                      cfg_scale=cfg_scale, cfg_group=cfg_group, **cond), noise)
    return sample(objective, model_fn, noise, steps=steps, sampler=sampler, cfg_scale=cfg_scale,
                  cfg_group=cfg_group, **cond)


def dataset_text_encoder(data) -> Optional[TextEncode]:
    """``encode(prompts)`` with the text encoder of the run's dataset: the one ``energon_data.prepare``
    recorded, or the tiny encoder of the built-in ``moving_digits`` captions; None if unknown."""
    from energon_data.encoders import build_text_encoder
    if data.path:
        from energon_data.prepare import prepare_record
        record = prepare_record(data.path)
        if record is None:
            return None
        config = record.get("config", {})
        try:
            return build_text_encoder(config.get("text_encoder", "tiny"), config.get("text_encoder_path"),
                                      **config.get("text_encoder_opts", {})).encode
        except Exception as exc:  # an encoder we cannot build here is reported, not fatal for a preview
            log.warning("cannot build the dataset's text encoder (%s)", exc)
            return None
    if data.name == "moving_digits":
        from energon_data.datasets import moving_digits_text_encoder
        return moving_digits_text_encoder().encode
    return None
