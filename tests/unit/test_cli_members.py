"""`budget set --members`: a list of user names, never an empty list that would lock everyone out."""

from __future__ import annotations

import pytest
import typer

from apportion.cli.budgets import parse_members


def test_names_are_split_on_commas_and_trimmed() -> None:
    assert parse_members("alice, bob") == ("alice", "bob")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param("", "give at least one user", id="empty"),
        pytest.param(" , ", "give at least one user", id="only commas"),
        pytest.param("a b", "'a b' is not a user name", id="a space inside a name"),
        pytest.param("alice,,bob", "'' is not a user name", id="an empty name between commas"),
    ],
)
def test_bad_lists_exit_2_with_the_reason(text: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(typer.Exit) as err:
        parse_members(text)
    assert err.value.exit_code == 2
    assert message in capsys.readouterr().err
