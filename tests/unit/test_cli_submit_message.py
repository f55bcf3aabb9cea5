"""What `apportion submit` says once the dispatcher queued the job, held (`--hold`) or not."""

from __future__ import annotations

from apportion.cli.jobs import queued_message


def test_a_held_job_says_it_waits_for_release() -> None:
    assert queued_message("j-1", True) == (
        "queued, held: it will not be placed until `apportion release j-1` (see `apportion queue`)"
    )


def test_a_job_not_held_says_only_queued() -> None:
    assert queued_message("j-1", False) == "queued by the dispatcher (see `apportion queue`)"
