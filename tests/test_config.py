"""ZoffConfig is the one list of zoff's options: ZoffStrategy's keywords, README's option table and
conf/strategy/zoff.yaml follow it, and a test fails when one of them drifts."""

from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from lightning_zoff import ZoffFabricStrategy, ZoffStrategy
from lightning_zoff.config import ZoffConfig, defaults, markdown_table

ROOT = Path(__file__).resolve().parents[1]
# the Hydra config's deliberate choices, each for a reason written beside it in the yaml
YAML_CHOICES = {"start_method": "fork", "timeout": None}


def test_the_strategys_keywords_are_the_configs_fields_with_their_defaults():
    signature = inspect.signature(ZoffStrategy.__init__)
    keywords = {name: p.default for name, p in signature.parameters.items() if p.kind is p.KEYWORD_ONLY}
    assert keywords == defaults()
    assert list(keywords) == [f.name for f in fields(ZoffConfig)]  # in the same order, as the table lists them


def test_readme_lists_every_option_as_the_config_documents_it():
    readme = (ROOT / "README.md").read_text()
    assert markdown_table() in readme


def test_the_hydra_config_lists_every_option_with_its_default():
    listed = yaml.safe_load((ROOT / "conf" / "strategy" / "zoff.yaml").read_text())
    listed.pop("_target_")
    assert list(listed) == [f.name for f in fields(ZoffConfig)]
    for name, default in defaults().items():
        expected = YAML_CHOICES.get(name, default)
        assert listed[name] == expected, name


@pytest.mark.parametrize(("options", "message"), [
    (dict(wrap_policy=["Block"]), r"wrap_policy=\['Block'\]\): expected module classes"),
    (dict(activation_checkpointing_policy="all"), r"activation_checkpointing_policy='all'\): expected module classes"),
    (dict(state_dict_type="dcp"), r"state_dict_type='dcp'; choose 'sharded' or 'full'"),
    (dict(accelerator_state=2), r"accelerator_state=2; choose 'auto', 'none' or a fraction"),
    (dict(activation_checkpointing_policy=-1), r"activation_checkpointing_policy=-1; a number of blocks is 0 or more"),
])
def test_a_bad_option_is_named_with_what_it_accepts(options, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ZoffConfig(**options)


REMOVAL = (r"the option was removed: a one-step-stale update ended 19% above exact training on the main job at step"
           r" 200, 7% even after 150 exact steps \(bench/README\.md, \"`update_lag`, removed\"\)")


@pytest.mark.parametrize("door", [ZoffStrategy, ZoffFabricStrategy])
@pytest.mark.parametrize("value", [1, 0])
def test_a_removed_option_is_refused_with_why_it_went(door, value):
    with pytest.raises(TypeError, match=rf"^{door.__name__}\(update_lag={value}\): {REMOVAL}$"):
        door(update_lag=value)
    with pytest.raises(TypeError, match="unexpected keyword argument 'update_lags'"):  # any other name: Python's own
        door(update_lags=1)


def test_options_are_stored_in_their_normal_form():
    from lightning_zoff.examples.gpt import Block

    config = ZoffConfig(wrap_policy=[Block], activation_checkpointing_policy=None, accelerator_state="0.5")
    assert config.wrap_policy == frozenset({Block})
    assert config.activation_checkpointing_policy == frozenset()
    assert config.accelerator_state == 0.5
