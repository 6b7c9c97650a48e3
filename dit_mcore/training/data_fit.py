"""The model fits its data by default: the shape fields a run leaves unset (``None``: "the preset's") come
from the data, and a set one that contradicts the data fails before anything is built.

From a prepared dataset (``data.path``, its ``prepare_state.json``): the latent channels, the latent side
(when every latent shape the record lists is square and of one size), the number of classes of a
class-conditional model (its label map; a dataset without labels makes it unconditional; a text model whose
preset has no classes keeps none) and, for the text families, the text width. A resumed run keeps the shape
its checkpoint records for every field it leaves unset. From the
built-in sources: what they generate (grey pixels of ``data.image_size``, ten digit classes, the tiny text
encoder's width). ``data.name=mock`` follows the model, and a blend is not read (each part may differ).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Optional

from dit_mcore.errors import ConfigError
from dit_mcore.models import get_family


@dataclasses.dataclass(frozen=True)
class DataShape:
    """What the data says about the model (None: it does not say)."""

    source: str
    in_channels: Optional[int] = None
    input_size: Optional[int] = None
    num_classes: Optional[int] = None
    text_dim: Optional[int] = None


def data_shape(data) -> Optional[DataShape]:
    """The shape ``data`` (a ``DataConfig``) fixes, or None where it fixes nothing."""
    if data.blend:
        return None
    if data.path:
        from energon_data.prepare import prepare_record
        record = prepare_record(data.path) if Path(data.path).is_dir() else None
        if not record or not record.get("shards"):
            return None  # a metadataset yaml, or a dataset prepared elsewhere
        shapes = latent_shapes(record)
        sides = {(h, w) for _, _, h, w in shapes}
        (height, width), = sides if len(sides) == 1 else [(None, None)]
        labels = record.get("labels", ...)  # (absent: prepared before labels were recorded)
        return DataShape(f"the dataset at data.path={data.path!r}",
                         in_channels=shapes.pop()[0], input_size=height if height == width else None,
                         num_classes=None if labels is ... else len(labels or ()),
                         text_dim=record["shards"][0].get("text_dim"))
    if data.name not in ("digits", "moving_digits"):
        return None
    from energon_data.datasets import moving_digits_text_encoder
    return DataShape(f"data.name={data.name}", in_channels=1, input_size=data.image_size, num_classes=10,
                     text_dim=moving_digits_text_encoder().dim if data.name == "moving_digits" else None)


def latent_shapes(record: dict) -> set[tuple]:
    """The latent shapes (channels, frames, rows, columns) a prepared dataset's record (``prepare_record``)
    lists over its shards."""
    return {tuple(shape) for shard in record["shards"] for shape in shard.get("latent_shapes", [shard["latent_shape"]])}


def _preset_classes(model) -> Optional[int]:
    from dit_mcore.models.dit.config import DiTConfig
    presets = get_family(model.family).presets()
    return presets.get(model.preset, {}).get("num_classes", DiTConfig.__dataclass_fields__["num_classes"].default)


def _wanted(cfg) -> tuple[Optional[DataShape], dict]:
    shape = data_shape(cfg.data)
    if shape is None:
        return None, {}
    wanted = {"in_channels": shape.in_channels, "input_size": shape.input_size}
    if cfg.model.num_classes or _preset_classes(cfg.model):  # class-conditional (a text model may have none)
        wanted["num_classes"] = shape.num_classes
    if "text" in get_family(cfg.model.family).conditioning:
        wanted["text_dim"] = shape.text_dim
    return shape, {name: value for name, value in wanted.items() if value is not None}


def _contradictions(shape: Optional[DataShape], wanted: dict, model) -> list[str]:
    problems = []
    for name, value in wanted.items():
        current = getattr(model, name)
        if current is None or current == value:
            continue
        if name != "num_classes":
            problems.append(f"model.{name}={current} but {shape.source} has {value}: set model.{name}={value}, "
                            "or leave it unset to take the data's")
        elif 0 < current < value:
            problems.append(f"model.num_classes={current} but {shape.source} has {value} classes: set "
                            f"model.num_classes={value} (or more; 0: unconditional), or leave it unset")
    return problems


def contradictions(cfg) -> list[str]:
    """One line for each shape field ``cfg.model`` sets that contradicts ``cfg.data``, with both values and
    the fix (a model may have more classes than its data, or none)."""
    return _contradictions(*_wanted(cfg), cfg.model)


def data_fields(cfg) -> set[str]:
    """The ``cfg.model`` fields ``cfg.data`` fixes (:func:`fit_model_to_data` fills them)."""
    return set(_wanted(cfg)[1])


def fit_model_to_data(cfg, recorded: Callable[[], Optional[dict]] = lambda: None) -> dict[str, int]:
    """Set the unset shape fields of ``cfg.model`` from ``cfg.data`` and return them; raises a
    :class:`ConfigError` listing the :func:`contradictions` first. ``recorded()``: the architecture the
    checkpoint a run resumes from records (``checkpoint.architecture``), read only where the data says
    something; its values win, so a run keeps the shape it was trained with."""
    shape, wanted = _wanted(cfg)
    problems = _contradictions(shape, wanted, cfg.model)
    if problems:
        raise ConfigError(problems[0] if len(problems) == 1 else
                          "the model does not fit its data:\n  " + "\n  ".join(problems))
    unset = [name for name in wanted if getattr(cfg.model, name) is None]
    kept = (recorded() or {}) if unset else {}
    filled = {name: wanted[name] if kept.get(name) is None else kept[name] for name in unset}
    for name, value in filled.items():
        setattr(cfg.model, name, value)
    return filled


def describe(filled: dict) -> str:
    """The log line for what :func:`fit_model_to_data` set."""
    return "the model's shape from its data: " + " ".join(f"model.{k}={v}" for k, v in filled.items())
