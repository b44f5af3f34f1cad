"""What every `pdserve bench ...` shares, so that a benchmark keeps only what is its own.

  report.py   the head of a report (date, the command that reproduces it, the machine: CPU
              model, cores, load average), markdown tables, targets, JSON and markdown writing;
  servers.py  starting a server on a free port and waiting until it serves, running a load of
              `bench/load/` (the HTTP client and its summary) against its URL;
  timing.py   in-process timers (median of repeats), random prompts, an engine bench's flags;
  plots.py    matplotlib without a display, figures saved and closed.
Percentiles are `pdserve.percentiles` (one definition for bench, router, simulator and chaos).
"""
