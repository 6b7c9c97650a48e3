"""``--help-config``: every section and field of a run, with its type, default and docstring."""
import dataclasses
import typing

import pytest

from dit_mcore.training.config import RunConfig
from dit_mcore.training.config_help import config_help, field_docs


def test_every_field_of_every_section_is_listed_with_its_type_default_and_docstring():
    text = config_help()
    for section, cls in typing.get_type_hints(RunConfig).items():
        docs = field_docs(cls)
        assert f"{section}: {cls.__name__}" in text
        for f in dataclasses.fields(cls):
            if f.name.startswith("_"):
                continue
            assert f"  {section}.{f.name}: " in text, f"{section}.{f.name} missing"
            assert docs.get(f.name), f"{section}.{f.name} has no docstring in {cls.__qualname__}"
            first_words = " ".join(docs[f.name].split()[:4])
            assert first_words in " ".join(text.split()), f"{section}.{f.name}'s docstring missing"
    assert "  trainer.max_steps: int = " in text and "  model.input_size: Optional[int] = None" in text


def test_one_section_and_an_unknown_one():
    text = config_help(only="diffusion")
    assert "  diffusion.objective: " in text and "  trainer.max_steps: " not in text
    with pytest.raises(ValueError, match="no such section; use one of"):
        config_help(only="trainr")
