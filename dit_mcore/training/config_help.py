"""Every section and field of a run's configuration with its type, default and docstring: what
``recipes/pretrain_xl.py --help-config`` prints (nemo-run's ``--help`` knows the task's sections, not
their fields). The docstrings are the ones under each field in the config classes' source, read with
:mod:`ast`, so the reference cannot drift from the code."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Optional


def field_docs(cls) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass: the string literal right under each annotated field
    (base classes first, so a subclass's own text wins)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):  # no source (a frozen build): types and defaults still print
            continue
        body = tree.body[0].body
        for node, after in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _type_name(kind) -> str:
    if isinstance(kind, str):
        return kind
    if typing.get_origin(kind) is not None:
        return str(kind).replace("typing.", "")
    return getattr(kind, "__name__", str(kind))


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "(required)"


def config_help(sections: Optional[dict] = None, only: Optional[str] = None, width: int = 100) -> str:
    """The reference of every section (or of ``only``) of ``sections`` (``{name: config dataclass}``, e.g.
    ``validate.config_sections(task)``; default: a training run's, ``RunConfig``'s)."""
    if sections is None:
        from dit_mcore.training.config import RunConfig
        sections = typing.get_type_hints(RunConfig)
    if only is not None and only not in sections:
        raise ValueError(f"--help-config {only}: no such section; use one of {sorted(sections)}")
    lines = ["Every field is set on the command line as section.field=value, e.g. trainer.max_steps=20 "
             "(a recipe's own values are its defaults; see each recipe's docstring).", ""]
    for name, cls in sections.items():
        if only not in (None, name):
            continue
        module = inspect.getmodule(cls)
        lines.append(f"{name}: {cls.__name__} ({module.__name__ if module else '?'})")
        docs, types = field_docs(cls), typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init or f.name.startswith("_"):
                continue
            lines.append(f"  {name}.{f.name}: {_type_name(types.get(f.name, f.type))} = {_default(f)}")
            for paragraph in docs.get(f.name, "").split("\n\n"):
                if paragraph.strip():
                    lines += textwrap.wrap(" ".join(paragraph.split()), width, initial_indent=" " * 6,
                                           subsequent_indent=" " * 6)
        lines.append("")
    return "\n".join(lines)
