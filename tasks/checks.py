"""System checks of the task queue's settings: a bad schedule or retention age fails
``manage.py check`` (and every command) with the reason, not the scheduler thread at run time."""

from __future__ import annotations

from typing import Any

from django.core.checks import CheckMessage, Error, Warning, register
from django.core.exceptions import ImproperlyConfigured


@register()
def check_task_settings(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    from tasks.conf import get_settings
    from tasks.maintenance.partitions import PartitionError, days_ahead_setting
    from tasks.maintenance.retention import retention_policy
    from tasks.maintenance.schedule_specs import load_schedules

    try:
        get_settings()
    except ValueError as exc:  # every other check reads the settings too: this one says what is wrong
        return [Error(str(exc), id="tasks.E100")]
    errors: list[CheckMessage] = []
    try:
        load_schedules()
    except ImproperlyConfigured as exc:
        errors.append(Error(str(exc), hint="See docs/howto/periodic-tasks.md.", id="tasks.E101"))
    try:
        retention = retention_policy()
    except ValueError as exc:
        errors.append(Error(str(exc), hint="See docs/howto/recovery-and-retention.md, 'Retention'.", id="tasks.E102"))
    else:
        errors += history_retention_warnings(retention)
    errors += retry_policy_errors(get_settings().RETRY_POLICIES)
    errors += rate_limit_errors(get_settings().RATE_LIMITS)
    errors += fair_queue_errors(get_settings().FAIR_QUEUES)
    errors += redaction_errors(get_settings().REDACT_ARGUMENTS)
    hours = get_settings().HISTORY_HOURS
    if isinstance(hours, bool) or not isinstance(hours, int) or not 1 <= hours <= MAX_HISTORY_HOURS:
        errors.append(
            Error(
                f"LEASING_TASKS['HISTORY_HOURS'] must be a whole number of hours from 1 to {MAX_HISTORY_HOURS},"
                f" got {hours!r}",
                hint="See docs/reference/dashboard.md, 'History'.",
                id="tasks.E111",
            )
        )
    try:
        days_ahead_setting()
    except PartitionError as exc:
        errors.append(
            Error(
                str(exc),
                hint="See docs/howto/recovery-and-retention.md, 'Finished tasks' partitions'.",
                id="tasks.E122",
            )
        )
    try:
        from tasks.maintenance.archive import archive_after

        archive_after()
    except ValueError as exc:
        errors.append(
            Error(
                f"LEASING_TASKS['ARCHIVE_AFTER']: {exc}",
                hint="See docs/explanation/finished-storage.md.",
                id="tasks.E123",
            )
        )
    try:
        from tasks.maintenance.archive import archive_busy_fraction

        archive_busy_fraction()
    except ValueError as exc:
        errors.append(
            Error(
                f"LEASING_TASKS['ARCHIVE_BUSY_FRACTION']: {exc}",
                hint="See docs/explanation/finished-storage.md.",
                id="tasks.E124",
            )
        )
    return errors


def redaction_errors(value: Any) -> list[CheckMessage]:
    """LEASING_TASKS["REDACT_ARGUMENTS"]: key names, or the dotted path of a callable (tasks/redaction.py)."""
    from tasks.redaction import setting_problem

    problem = setting_problem(value)
    if problem is None:
        return []
    return [
        Error(
            f"LEASING_TASKS['REDACT_ARGUMENTS'] {problem}",
            hint="See docs/reference/settings.md and docs/reference/dashboard.md, 'Redacted arguments'.",
            id="tasks.E121",
        )
    ]


def rate_limit_errors(rates: Any) -> list[CheckMessage]:
    """LEASING_TASKS["RATE_LIMITS"]: queue name -> "14/s" or (count, seconds) (tasks/lifecycle/ratelimits.py)."""
    from tasks.lifecycle.ratelimits import parse_queue_rates

    try:
        parse_queue_rates(rates)
    except ValueError as exc:
        return [Error(str(exc), hint="See docs/howto/rate-limits.md.", id="tasks.E110")]
    return []


#: A year and a day: the rollup keeps hours x keys rows, and the page draws every hour.
MAX_HISTORY_HOURS = 8784


def fair_queue_errors(queues: Any) -> list[CheckMessage]:
    """LEASING_TASKS["FAIR_QUEUES"]: queue names (tasks/lifecycle/claim.py, PICK_FAIR)."""
    hint = "See docs/howto/pausing-and-keys.md, 'Fair queues'."
    return [
        Error(
            f"LEASING_TASKS['FAIR_QUEUES'] holds {name!r}: each must be a queue name of 1 to 100 characters",
            hint=hint,
            id="tasks.E120",
        )
        for name in queues
        if not isinstance(name, str) or not 0 < len(name) <= 100
    ]


def retry_policy_errors(policies: Any) -> list[CheckMessage]:
    """LEASING_TASKS["RETRY_POLICIES"]: queue name -> a policy of dotted paths (tasks/lifecycle/policy.py)."""
    from tasks.lifecycle.policy import policy_problems

    hint = "See docs/howto/retries.md."
    if not isinstance(policies, dict):
        return [
            Error("LEASING_TASKS['RETRY_POLICIES'] must map queue names to retry policies", hint=hint, id="tasks.E109")
        ]
    return [
        Error(f"LEASING_TASKS['RETRY_POLICIES'][{queue!r}] {problem}", hint=hint, id="tasks.E109")
        for queue, spec in policies.items()
        for problem in policy_problems(spec, paths_only=True)
    ]


@register()
def check_pooled_databases(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """What a transaction pooler needs of a pooled alias (docs/howto/pgbouncer.md)."""
    from django.conf import settings

    from tasks.conf import get_settings
    from tasks.lifecycle.listening import parsable

    hint = "See docs/howto/pgbouncer.md."
    try:
        conf = get_settings()
    except ValueError:
        return []  # reported where the settings are read
    messages: list[CheckMessage] = []
    for name, aliases in (("POOLED_DATABASES", conf.POOLED_DATABASES), ("LISTEN_URLS", tuple(conf.LISTEN_URLS))):
        for alias in aliases:
            if alias not in settings.DATABASES:
                messages.append(
                    Error(
                        f"LEASING_TASKS[{name!r}] names {alias!r}, which is not in DATABASES",
                        hint=hint,
                        id="tasks.E103",
                    )
                )
    for alias, url in conf.LISTEN_URLS.items():
        if url and not parsable(url):
            messages.append(
                Error(
                    # Not libpq's message: it quotes the token it could not read, a password maybe.
                    f"LEASING_TASKS['LISTEN_URLS'][{alias!r}] is not a connection URL or conninfo string libpq "
                    "can parse",
                    hint="Percent-encode reserved characters (%, @, :, /) in the user name and password. " + hint,
                    id="tasks.E106",
                )
            )
    for alias in conf.POOLED_DATABASES:
        if alias not in settings.DATABASES:
            continue  # tasks.E103 above
        database = settings.DATABASES[alias]
        options = database.get("OPTIONS") or {}
        if options.get("server_side_binding") and options.get("prepare_threshold", 5) is not None:
            # psycopg prepares a statement on the server after a few runs; through transaction
            # pooling the next run may land on a server connection that never saw it.
            messages.append(
                Error(
                    f"DATABASES[{alias!r}] is pooled (LEASING_TASKS['POOLED_DATABASES']) but uses server-side "
                    "binding with psycopg's prepared statements",
                    hint="Leave OPTIONS['server_side_binding'] off (Django's default), or set "
                    "OPTIONS['prepare_threshold'] = None. " + hint,
                    id="tasks.E104",
                )
            )
        if not database.get("DISABLE_SERVER_SIDE_CURSORS"):
            messages.append(
                Warning(
                    f"DATABASES[{alias!r}] is pooled (LEASING_TASKS['POOLED_DATABASES']) but server-side cursors "
                    "are enabled: a QuerySet.iterator() outside a transaction breaks through transaction pooling",
                    hint="Set DATABASES[alias]['DISABLE_SERVER_SIDE_CURSORS'] = True (Django's own advice). " + hint,
                    id="tasks.W105",
                )
            )
    return messages


@register()
def check_task_framework(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """Django's task framework as this package needs it: Django 6's own, or on Django 5.2 the
    django-tasks backport, recent enough and installed as an app (its logging and checks)."""
    from django.apps import apps

    from tasks import compat

    hint = "See the README, 'Add it to your project'."
    if compat.FRAMEWORK != "django_tasks":
        return []
    messages: list[CheckMessage] = []
    version = compat.backport_version()
    if version is not None and version < compat.BACKPORT_MINIMUM:
        shown = ".".join(map(str, version))
        messages.append(
            Error(
                f"django-tasks {shown} is installed; django-leasing needs {compat.BACKPORT_REQUIREMENT} on Django 5.2",
                hint=f'pip install "{compat.BACKPORT_REQUIREMENT}". ' + hint,
                id="tasks.E107",
            )
        )
    if not apps.is_installed("django_tasks"):
        messages.append(
            Error(
                '"django_tasks" is not in INSTALLED_APPS: on Django 5.2 the backport provides the task framework '
                "(its signal logging and checks run only as an installed app)",
                hint='Add "django_tasks" to INSTALLED_APPS. ' + hint,
                id="tasks.E108",
            )
        )
    return messages


def history_retention_warnings(retention: dict[str, Any] | None) -> list[CheckMessage]:
    """A finished task is counted into the history once its hour has been over for FINAL_AFTER
    (tasks/maintenance/history.py): up to an hour and five minutes after it finished. A retention
    shorter than that prunes it first, and the history shows its hour without it."""
    import datetime as dt

    from tasks.maintenance.history import FINAL_AFTER

    needed = dt.timedelta(hours=1, seconds=FINAL_AFTER)
    return [
        Warning(
            f"LEASING_TASKS['RETENTION'][{kind!r}] keeps finished tasks {age}, less than the {needed} the history"
            " rollup needs to count them: the history will miss them",
            hint="Keep finished tasks at least 65 minutes (docs/reference/dashboard.md, 'History').",
            id="tasks.W111",
        )
        for kind, age in (retention or {}).items()
        if kind in ("SUCCESSFUL", "FAILED", "CANCELLED") and age is not None and age < needed
    ]
