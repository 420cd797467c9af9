"""Calibration: measuring op, step, device and collective costs on this
machine for a CostTable (`tfsplit calibrate`). graphs builds the synthetic
graphs that are timed, measure runs and times graphs (Session traces and
TF2 function calls), devices measures over logical CPUs (concurrency,
collectives, transfers, pipeline stages), and run.calibrate sequences it
all into one table; the arithmetic that fits the times is
tfsplit.cost.fitting. The package sits above tfsplit.runtime, whose timing
and graph functions it uses; nothing below it imports it.
"""
