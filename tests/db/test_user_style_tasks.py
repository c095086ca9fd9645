"""Tests as a project that uses django-leasing writes them, with the helpers the package ships: the
pytest plugin's fixtures (found through its ``pytest11`` entry point: nothing here imports the
plugin) and the ``TaskTestMixin`` of a Django ``TestCase``. The application code is
``tests/testapp/testing_handlers.py``: ``sign_up`` (a view's work) enqueues ``send_welcome``.

The last tests show that these assertions fail when the task is not enqueued (a test that expects
the AssertionError); tests/db/test_testing_plugin.py runs such a file in a pytest of its own."""

# A Django TestCase is written with unittest's assertions, as users write it.
# ruff: noqa: PT009, PT027

from __future__ import annotations

import pytest
from asgiref.sync import sync_to_async
from django.test import TestCase

from tasks.models import TaskStatus
from tasks.testing import TaskTestMixin
from tests.testapp.models import Once
from tests.testapp.testing_handlers import send_welcome, sign_up

# -- pytest style -------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_signing_up_enqueues_the_welcome_mail(enqueued_tasks):
    sign_up("a@example.com")
    enqueued_tasks.assert_enqueued(send_welcome, args=["a@example.com"], kwargs={"lang": "fr"}, count=1)
    assert [task.status for task in enqueued_tasks.tasks] == [TaskStatus.READY]  # enqueued, not run


@pytest.mark.django_db
def test_the_welcome_mail_is_sent_when_the_queue_runs(enqueued_tasks, run_tasks):
    sign_up("a@example.com")
    assert run_tasks().succeeded == 1
    assert Once.objects.get(key="welcome:a@example.com").value == {"lang": "fr"}
    (task,) = enqueued_tasks.assert_enqueued(send_welcome)
    task.refresh_from_db()
    assert task.return_value == "sent to a@example.com"


@pytest.mark.django_db
def test_eagerly_the_mail_is_sent_before_sign_up_returns(eager_tasks):
    sign_up("a@example.com")
    assert Once.objects.filter(key="welcome:a@example.com").exists()
    assert eager_tasks.drained.succeeded == 1


# -- Django TestCase style ------------------------------------------------------------------------------


class SignUpTests(TaskTestMixin, TestCase):
    def test_signing_up_enqueues_the_welcome_mail(self):
        sign_up("b@example.com")
        self.assertEnqueued(send_welcome, args=["b@example.com"], kwargs={"lang": "fr"})
        self.assertNotEnqueued(send_welcome, args=["someone@else.com"])

    def test_the_welcome_mail_is_sent_when_the_queue_runs(self):
        sign_up("b@example.com")
        drained = self.run_until_empty()
        self.assertEqual((drained.succeeded, drained.failed), (1, 0))
        self.assertTrue(Once.objects.filter(key="welcome:b@example.com").exists())


class EagerSignUpTests(TaskTestMixin, TestCase):
    eager_tasks = True

    def test_the_mail_is_sent_before_sign_up_returns(self):
        sign_up("c@example.com")
        self.assertTrue(Once.objects.filter(key="welcome:c@example.com").exists())
        (task,) = self.enqueued_tasks()
        self.assertEqual(task.status, TaskStatus.SUCCESSFUL)


class AsyncSignUpTests(TaskTestMixin, TestCase):
    eager_tasks = True

    async def test_an_async_enqueue_runs_eagerly_too(self):
        await send_welcome.aenqueue("async@example.com")
        self.assertTrue(await Once.objects.filter(key="welcome:async@example.com").aexists())
        # The assertions read the database: from async code, through sync_to_async.
        await sync_to_async(self.assertEnqueued)(send_welcome, args=["async@example.com"])


# -- the same assertions fail when the view does not enqueue ------------------------------------------------


@pytest.mark.django_db
def test_the_fixture_fails_when_the_task_is_not_enqueued(enqueued_tasks):
    sign_up("d@example.com", send=False)
    with pytest.raises(AssertionError, match=r"expected at least one enqueued .*send_welcome.*found 0"):
        enqueued_tasks.assert_enqueued(send_welcome, args=["d@example.com"])
    enqueued_tasks.assert_not_enqueued(send_welcome)


class SignUpWithoutMailTests(TaskTestMixin, TestCase):
    def test_the_mixin_fails_when_the_task_is_not_enqueued(self):
        sign_up("e@example.com", send=False)
        with self.assertRaisesRegex(AssertionError, "Nothing was enqueued"):
            self.assertEnqueued(send_welcome)
        self.assertEqual(self.run_until_empty().attempts, 0)

    def test_the_mixin_fails_when_a_task_is_enqueued_that_should_not_be(self):
        sign_up("f@example.com")
        with self.assertRaisesRegex(AssertionError, "expected no enqueued .*send_welcome.*found 1"):
            self.assertNotEnqueued(send_welcome)


class ForgotSuperSetUp(TaskTestMixin, TestCase):
    def setUp(self):  # no super().setUp(): the capture never began
        pass

    def test_a_clear_error_says_what_is_missing(self):
        with self.assertRaisesRegex(RuntimeError, r"must call super\(\).setUp\(\)"):
            self.assertEnqueued(send_welcome)
