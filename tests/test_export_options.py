"""ExportOptions: one record of an export's options, checked when built, and the same record from
the command line, the Data tab's form and a round's snapshot."""

import datetime as dt

import gradio as gr
import pytest

from annotate import admin
from store.__main__ import _parser, options_from_args
from store.export_options import ExportOptions, InvalidOption


@pytest.mark.parametrize("field, value, message", [
    ("format", "csv", "format must be one of jsonl, parquet, datasets, not 'csv'"),
    ("trl_format", "chatml", "trl_format must be one of conversational, text, not 'chatml'"),
    ("rounds", "1", "rounds must be round ids, not '1'"),
    ("rounds", [1, True], "rounds must be round ids"),
    ("annotators", [1.5], "annotators must be account names or ids, not [1.5]"),
    ("min_agreement", 2, "min_agreement must be between 0 and 1, not 2"),
    ("min_quality", "yes", "min_quality must be between 0 and 1, not 'yes'"),
    ("min_quality", float("nan"), "min_quality must be between 0 and 1"),
    ("test_fraction", 1.0, "test_fraction must be in [0, 1), not 1.0"),
    ("test_fraction", True, "test_fraction must be in [0, 1), not True"),
    ("since", "yesterday", "since must be a date or time such as 2024-06-01, not 'yesterday'"),
    ("until", 20240601, "until must be a date or time such as 2024-06-01"),
    ("include_imported", None, "include_imported must be True or False, not None"),
    ("quality_weights", "yes", "quality_weights must be True or False, not 'yes'"),
    ("seed", 1.5, "seed must be a whole number, not 1.5"),
    ("license", "two\nlines", "license must be one short line such as 'cc-by-4.0'"),
    ("license", "  ", "license must be one short line"),
    ("license", "x" * 101, "license must be one short line"),
])
def test_a_bad_option_is_refused_by_name(field, value, message):
    with pytest.raises(InvalidOption) as info:
        ExportOptions(**{field: value})
    assert str(info.value).startswith(message) and info.value.field == field


def test_options_are_kept_in_one_form():
    options = ExportOptions(rounds=3, annotators="ann", min_agreement="0.5", since="2024-06-01",
                            until=dt.datetime(2024, 7, 1, 2, tzinfo=dt.timezone(dt.timedelta(hours=2))),
                            license=" cc-by-4.0 ")
    assert options.rounds == (3,) and options.annotators == ("ann",) and options.min_agreement == 0.5
    assert options.since == dt.datetime(2024, 6, 1) and options.until == dt.datetime(2024, 7, 1)  # naive UTC
    assert options.license == "cc-by-4.0"
    assert ExportOptions(rounds=[1, 2], annotators=["ann", 7]) == ExportOptions(rounds=(1, 2), annotators=("ann", 7))


def test_the_command_line_builds_the_options():
    def parsed(*argv):
        return options_from_args(_parser().parse_args(["export", "--out", "x", *argv]))

    assert parsed() == ExportOptions()
    assert parsed("--format", "parquet", "--trl-format", "text", "--margin-column", "--license", "cc-by-4.0",
                  "--round", "1", "--round", "2", "--annotator", "ann", "--min-agreement", "0.5",
                  "--since", "2024-06-01", "--until", "2024-07-01", "--include-all-bad", "--no-imported",
                  "--min-quality", "0.6", "--quality-weights", "--test-fraction", "0.2", "--seed", "3",
                  "--overwrite") == ExportOptions(
        format="parquet", trl_format="text", margin_column=True, license="cc-by-4.0", rounds=(1, 2),
        annotators=("ann",), min_agreement=0.5, since="2024-06-01", until="2024-07-01", include_all_bad=True,
        include_imported=False, min_quality=0.6, quality_weights=True, test_fraction=0.2, seed=3, overwrite=True)
    with pytest.raises(InvalidOption, match="test_fraction must be in"):
        parsed("--test-fraction", "1.5")


def test_the_data_tabs_form_builds_the_options():
    """A blank field, no annotator and a minimum at 0 set nothing; a blank license is 'unknown'."""
    assert admin.ExportForm().options() == ExportOptions()
    assert admin.ExportForm(annotators=[], since="  ", min_agreement=0, test_fraction="", license="",
                            min_quality=0.0).options() == ExportOptions()
    assert admin.ExportForm(fmt="datasets", annotators=["ann"], since=" 2024-06-01 ", min_agreement=0.5,
                            test_fraction=0.1, trl_format="text", margin_column=True, license="cc-by-4.0",
                            min_quality=0.6, quality_weights=True).options() == ExportOptions(
        format="datasets", annotators=("ann",), since="2024-06-01", min_agreement=0.5, test_fraction=0.1,
        trl_format="text", margin_column=True, license="cc-by-4.0", min_quality=0.6, quality_weights=True)


@pytest.mark.parametrize("form, message", [
    (dict(fmt="csv"), "Format must be one of jsonl, parquet, datasets, not 'csv'."),
    (dict(since="yesterday"), "Since must be a date or time such as 2024-06-01, not 'yesterday'."),
    (dict(min_agreement=False), "Minimum agreement must be between 0 and 1, not False."),
    (dict(min_quality=1.5), "Minimum annotator quality must be between 0 and 1, not 1.5."),
    (dict(test_fraction="half"), "Test fraction must be in [0, 1), not 'half'."),
    (dict(quality_weights="yes"), "Weight pairs by annotator quality must be True or False, not 'yes'."),
    (dict(license="two\nlines"), "License must be one short line such as 'cc-by-4.0', not 'two\\nlines'."),
])
def test_the_form_names_a_refused_field_by_its_label(form, message):
    with pytest.raises(gr.Error) as info:
        admin.ExportForm(**form).options()
    assert info.value.message == message
