"""The examples in the docstrings run and print what they say."""

import doctest

import pytest

import trl_topr.composition
import trl_topr.curation
import trl_topr.data
import trl_topr.loss
import trl_topr.online
import trl_topr.rewards
import trl_topr.sampling
import trl_topr.trainer


@pytest.mark.parametrize(
    "module",
    [trl_topr.loss, trl_topr.composition, trl_topr.curation, trl_topr.data, trl_topr.online, trl_topr.rewards,
     trl_topr.sampling, trl_topr.trainer],
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    if module is not trl_topr.trainer:  # the trainer's example needs the Hub
        assert result.attempted > 0
