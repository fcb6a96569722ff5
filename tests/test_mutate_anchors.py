"""``make mutate``'s breakages still apply: each one's text is in its file exactly once (a refactor that moves the
code must move the mutation with it, or ``make mutate`` silently tests nothing)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.mutate import MUTATIONS

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.name for m in MUTATIONS])
def test_each_mutation_finds_its_code_once(mutation):
    path = ROOT / mutation.path
    assert path.is_file(), f"{mutation.path} is gone"
    assert path.read_text().count(mutation.old) == 1, f"{mutation.name!r}: its text is not in {mutation.path} once"
    assert mutation.new != mutation.old
