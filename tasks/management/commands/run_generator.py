from __future__ import annotations

from typing import Any

from django.core.management.base import CommandError, CommandParser

from tasks.demo import generator
from tasks.management.commands._common import LongRunningCommand, configure_logging, positive_float, stop_on_signals


class Command(LongRunningCommand):
    help = (
        "Run the demo generator (leader-elected: one instance generates, the others stand by), "
        "or change its shared desired state with --start/--stop/--rate, or print --status."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--name", default="default")
        action = parser.add_mutually_exclusive_group()
        action.add_argument("--start", action="store_true", help="set the desired state to running and exit")
        action.add_argument("--stop", action="store_true", help="set the desired state to stopped and exit")
        action.add_argument("--status", action="store_true", help="print the state and the leader, and exit")
        parser.add_argument("--rate", type=positive_float, help="tasks per second")
        parser.add_argument("--max-sleep", type=positive_float, help="largest sleep of a generated task, seconds")
        parser.add_argument("--ttl", type=positive_float, default=10.0, help="generator lease TTL, seconds")
        parser.add_argument("--tick", type=positive_float, default=0.25, help="seconds between rounds")
        parser.add_argument("--instance-id", help="holder id of this instance (default host:pid:random)")

    def handle(
        self,
        *,
        name: str,
        start: bool,
        stop: bool,
        status: bool,
        rate: float | None,
        max_sleep: float | None,
        ttl: float,
        tick: float,
        instance_id: str | None,
        verbosity: int,
        **options: Any,
    ) -> None:
        configure_logging(verbosity)
        try:
            if start or stop or rate is not None or max_sleep is not None:
                running = True if start else False if stop else None
                generator.set_state(name, running=running, rate=rate, max_sleep=max_sleep)
                self._print_status(name)
                return
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if status:
            self._print_status(name)
            return
        instance = generator.Generator(name, ttl=ttl, tick=tick, instance_id=instance_id)
        self.stdout.write(f"generator instance {instance.instance_id} standing by for {generator.lease_name(name)}")
        with stop_on_signals(instance.stop):
            instance.run()

    def _print_status(self, name: str) -> None:
        state = generator.status(name)
        leader = state.leader or "none (no instance holds the lease)"
        desired = "running" if state.running else "stopped"
        seen = "running" if state.observed_running else "stopped"
        self.stdout.write(
            f"generator {state.name}: desired={desired} rate={state.rate}/s "
            f"generated={state.generated} leader={leader} leader_sees={seen}"
        )
