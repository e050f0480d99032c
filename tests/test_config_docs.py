"""Options and their help come from the config dataclasses (pipeline/config.py add_arguments): a
field's help is the docstring under it, found in the class that declares it or a base class."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from pipeline.config import DPOConfig, RewardConfig, SFTConfig, TrainerConfig, add_arguments, field_docs


@dataclass
class Base:
    shared: int = 1
    """Declared once, for every subclass."""
    redeclared: int = 2
    """The base's word."""


@dataclass
class Child(Base):
    own: str = "x"
    """The child's own field."""
    redeclared: int = 3
    """The child's word wins."""


def test_field_docs_reads_docstrings_along_the_class_hierarchy():
    assert field_docs(Child) == {"own": "The child's own field.", "shared": "Declared once, for every subclass.",
                                 "redeclared": "The child's word wins."}
    assert field_docs(Base) == {"shared": "Declared once, for every subclass.", "redeclared": "The base's word."}


def test_an_inherited_field_is_an_option_with_its_base_class_help():
    parser = argparse.ArgumentParser()
    add_arguments(parser, Child)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert helps["shared"].startswith("Declared once, for every subclass.")
    assert helps["redeclared"].startswith("The child's word wins.")
    assert parser.parse_args(["--shared", "5"]).shared == 5


def test_every_trainer_option_has_help():
    for cls in (RewardConfig, DPOConfig, SFTConfig):
        parser = argparse.ArgumentParser()
        add_arguments(parser, cls)
        assert all(a.help for a in parser._actions if a.dest != "help"), cls.__name__


def test_the_trainers_shared_options_are_declared_once_in_their_base():
    shared = {f.name for f in dataclasses.fields(TrainerConfig)}
    assert {"grad_accum", "max_length", "max_steps", "max_grad_norm", "save_every", "seed"} <= shared
    for cls in (RewardConfig, DPOConfig, SFTConfig):
        assert issubclass(cls, TrainerConfig)
        assert not shared & set(cls.__annotations__), f"{cls.__name__} declares a shared field again"
        assert {name: field_docs(cls)[name] for name in shared} == field_docs(TrainerConfig)
