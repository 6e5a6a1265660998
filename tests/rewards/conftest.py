"""Shared fixtures of the reward tests, and a "reward numbers" section at the end of the pytest output
(OCR scores, classifier accuracies) so the measured values are visible without ``-s``."""
from pathlib import Path

import pytest
import torch

_REPORT = pytest.StashKey[list]()
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def report(request):
    """``report("ocr mean 0.98")``: a line for the summary section, prefixed by the test's name."""
    lines = request.config.stash.setdefault(_REPORT, [])
    return lambda line: lines.append(f"{request.node.name}: {line}")


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(_REPORT, [])
    if lines:
        terminalreporter.write_sep("-", "reward numbers")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def one_thread():
    """Small tensors: one intra-op thread is fastest, and on shared busy cores spinning OpenMP workers
    made training the digit CNN ~20x slower."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def digit_cache(tmp_path_factory):
    """A fresh cache folder per session, so the tests train the digit classifiers (seconds) rather than
    load whatever an earlier version left in ~/.cache."""
    return tmp_path_factory.mktemp("digit_cache")
