"""framework/base/testing/variants.py: a run's overrides as a config file of the sweep, and the one-lane experiment."""

from __future__ import annotations

import pytest
import yaml

from framework.base.testing.variants import run_variants, variant_yaml


def test_a_variant_file_sets_group_choices_in_its_defaults_and_keys_as_values_the_last_word_winning():
    text = variant_yaml(["parallelism=ddp", "trainer.max_steps=12", "resilience=skip_step", "trainer.max_steps=6"])
    assert text.startswith("# @package _global_\n")
    doc = yaml.safe_load(text)
    assert doc["defaults"] == [{"override /parallelism": "ddp"}, {"override /resilience": "skip_step"}, "_self_"]
    assert doc["trainer"] == {"max_steps": 6}


def test_an_experiment_of_its_own_is_refused_for_more_than_one_lane_before_any_run(tmp_path):
    with pytest.raises(ValueError, match="experiment='faults' needs lanes=1"):
        run_variants(
            tmp_path, [], {"a": ["parallelism=single"], "b": ["parallelism=ddp"]}, lanes=2, experiment="faults"
        )
    assert not list(tmp_path.iterdir()), "nothing written"
