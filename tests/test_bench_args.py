"""The two-node benchmark's command line (bench/nodes.py): what (g) runs."""
import argparse

import pytest

from bench.nodes import WHOLE_CONFIGS, whole_configs


def test_whole_configs_give_each_service_its_threads():
    assert whole_configs("sequential:2, pipelined:2/1,sequential:3/1") == [(False, 2, 2), (True, 2, 1), (False, 3, 1)]


def test_the_default_whole_configs_parse():
    configs = whole_configs(WHOLE_CONFIGS)  # argparse parses the default on every run, --help included
    assert configs and all(target >= 1 and draft >= 1 for _, target, draft in configs)


@pytest.mark.parametrize("spec", ["sequential", "pipelined:0", "pipelined:2/0", "pipelined:2/", "greedy:2", "sequential:a/1"])
def test_bad_whole_configs_are_refused(spec):
    with pytest.raises(argparse.ArgumentTypeError, match="--whole-configs"):
        whole_configs(spec)
