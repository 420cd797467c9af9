"""Cost model: cluster spec, collective costs, and the event simulator."""
