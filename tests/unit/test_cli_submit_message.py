"""What `apportion submit` says once the dispatcher queued the job, held (`--hold`) or not."""

from __future__ import annotations

from apportion import client
from apportion.cli.jobs import queued_message


def test_a_held_job_says_it_waits_for_release() -> None:
    assert queued_message("j-1", True) == "queued, held until `apportion release j-1`"


def test_a_held_jobs_line_fits_80_columns_for_a_generated_id_of_a_long_user_name() -> None:
    job_id = client.new_job_id("apportion-u-alice")  # 30 characters
    assert len(queued_message(job_id, True)) <= 80


def test_a_job_not_held_says_only_queued() -> None:
    assert queued_message("j-1", False) == "queued by the dispatcher (see `apportion queue`)"
