"""A PostgreSQL task queue whose workers hold each task under a lease."""
