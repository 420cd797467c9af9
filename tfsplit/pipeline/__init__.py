"""Pipeline parallelism: stage partition and schedules expressed as control edges."""
