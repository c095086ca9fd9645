"""What a task row can go through: its states and transitions, every statement that changes a task
or a worker row, the values those statements return, what jsonb can store, which database holds a
queue and the concurrency-key admission. Imports only ``leasing`` and the package's foundation
(``tasks.conf``, ``tasks.compat``, ``tasks.exceptions``)."""
