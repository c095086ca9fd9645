"""Leader-elected rounds that keep the queue healthy: recovery of crashed attempts, retention, and
the scheduler of periodic tasks (with the schedules it reads from settings)."""
