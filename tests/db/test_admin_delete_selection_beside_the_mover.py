"""A selection's delete confirmed while the mover takes one of the selected tasks: what the admin says
("Successfully deleted N"), what it logs (a DELETION entry per task) and what is left in the tables
agree. Real connections: the admin's request on one, a lock on the log table on another (it holds the
request between Django reading the selection and the delete), the mover's move on the test's own."""

from __future__ import annotations

import psycopg
import pytest
from django.contrib.admin.models import DELETION, LogEntry
from django.db import connection
from django.test import Client

from tests.db.test_finished_lists import days, ended, move, where  # noqa: F401 (days: the autouse fixture)
from tests.helpers import wait_until
from tests.helpers.connections import OnItsOwnConnection, waits_for_a_lock

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_selection_deleted_while_the_mover_takes_one_of_it_is_deleted_as_said_and_logged(staff: Client) -> None:
    taken, other = ended("FAILED"), ended("SUCCESSFUL")
    log = psycopg.connect(**connection.get_connection_params(), autocommit=True)
    try:
        log.execute("BEGIN")
        log.execute("LOCK TABLE django_admin_log IN EXCLUSIVE MODE")  # reads pass, inserts wait
        admin = OnItsOwnConnection(
            lambda: staff.post(
                "/admin/tasks/task/",
                {"action": "delete_selected", "_selected_action": [taken, other], "post": "yes"},
                follow=True,
            )
        )
        admin.start()
        # Django has read the selection (len(queryset): both in tasks_task) and waits to log it.
        wait_until(lambda: waits_for_a_lock(admin.pid), 20, what="the admin's log entries to wait")
        move(taken)  # the mover takes one selected task meanwhile (committed)
        log.execute("COMMIT")
        response = admin.outcome()
    finally:
        log.close()
    body = response.content.decode()
    said_deleted = "Successfully deleted 2" in body
    logged = set(LogEntry.objects.filter(action_flag=DELETION).values_list("object_id", flat=True))
    left = {task_id: where(task_id) for task_id in (taken, other)}
    if said_deleted:
        assert logged == {str(taken), str(other)}
        assert left == {taken: None, other: None}, f"said and logged deleted, but left: {left}"
    else:
        assert left[taken] == "tasks_finished" and str(taken) not in logged, (left, logged, body[-1500:])
