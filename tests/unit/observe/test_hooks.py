"""Hook argv templates: placeholders, escapes and refusals."""

from __future__ import annotations

import pytest

from daemon.observe.hooks import FIELDS, check_template, fill

VALUES = {name: f"<{name}>" for name in FIELDS}


def test_fill_replaces_placeholders_and_keeps_the_rest() -> None:
    """Values go in as they are (no shell: `$`, `;` and braces in a value stay text)."""
    values = {**VALUES, "error": "it {broke}; $HOME"}
    out = fill(["/bin/notify", "{workflow}:{workflow_id}", "{error}", "{{literal}}"], values)
    assert out == ["/bin/notify", "<workflow>:<workflow_id>", "it {broke}; $HOME", "{literal}"]


@pytest.mark.parametrize("bad", ["{nope}", "{workflow.__class__}", "{0}", "{}"])
def test_unknown_placeholders_are_refused(bad: str) -> None:
    """Only the documented names are placeholders: no attribute access, no positions."""
    with pytest.raises(ValueError, match="unknown placeholder"):
        check_template(["/bin/x", bad])
