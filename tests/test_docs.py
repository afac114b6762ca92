"""The examples in the docstrings run and print what they say."""

import doctest
import re
from pathlib import Path

import pytest

import trl_topr.baseline
import trl_topr.curation
import trl_topr.data
import trl_topr.distributed
import trl_topr.evaluation
import trl_topr.generation.settings
import trl_topr.loop
import trl_topr.loop_config
import trl_topr.loss
import trl_topr.online
import trl_topr.precision
import trl_topr.rewards
import trl_topr.sampling
import trl_topr.trainer
import trl_topr.trajectories
import trl_topr.verifier


@pytest.mark.parametrize(
    "module",
    [
        trl_topr.loss,
        trl_topr.baseline,
        trl_topr.curation,
        trl_topr.data,
        trl_topr.evaluation,
        trl_topr.online,
        trl_topr.precision,
        trl_topr.rewards,
        trl_topr.sampling,
        trl_topr.trainer,
        trl_topr.verifier,
        trl_topr.generation.settings,
        trl_topr.distributed,
        trl_topr.loop,
        trl_topr.loop_config,
        trl_topr.trajectories,
    ],
)
def test_docstring_examples(module):
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0
    if module is not trl_topr.trainer:  # the trainer's example needs the Hub
        assert result.attempted > 0


def test_ci_runs_both_of_readme_commands_verbatim():
    # README opens with two commands (the embedded default, the tests): CI must run exactly those, not variants.
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    commands = [
        line
        for line in readme.split("```bash", 1)[1].split("```", 1)[0].splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert len(commands) == 2 and "recipes/gsm8k.py" in commands[0] and "pytest" in commands[1]
    ci = (root / ".ci" / "run").read_text()
    for command in commands:
        assert command in ci, command
    # Under `set -e`, a failure inside an `a && b && c` list does not stop the script: the test command's line must
    # end the script itself when it fails, or CI would go on to report success.
    (line,) = [line for line in ci.splitlines() if commands[1] in line]
    assert line.rstrip().endswith("|| exit 1"), line


def test_the_readme_is_read_in_minutes_and_no_docs_page_runs_long():
    # README: what TOPR is, install, a way in for each trainer, the CLI, one figure and a small table of the answers a
    # user acts on, each linking to its page; the rest lives in docs/, one question a page
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    assert readme.count("<!-- value:") <= 15  # the quoted numbers
    figures = re.findall(r"!\[[^\]]+\]\(([^)]+\.png)\)", readme)
    assert figures and all((root / figure).exists() for figure in figures)
    for way_in in ("TOPRTrainer(", "run_topr_loop(", "TOPRGRPOTrainer(", "TOPRAsyncGRPOTrainer", "trl-topr train"):
        assert way_in in readme, way_in
    for page in (root / "docs").glob("*.md"):
        assert len(page.read_text().splitlines()) <= 700, page.name
    # every link of the README leads to a page and a heading there (mkdocs checks the docs' own links, not these)
    from markdown.extensions.toc import slugify

    for target, anchor in re.findall(r"\]\((docs/[\w./-]+\.md)(?:#([\w-]+))?\)", readme):
        assert (root / target).exists(), target
        headings = re.findall(r"^#{1,6} (.*)$", (root / target).read_text(), re.M)
        assert not anchor or anchor in {slugify(h, "-") for h in headings}, f"{target}#{anchor}"
