"""What a run reports: the quiet terminal and the run log (logs.py), per-step metrics (metrics.py), curves
(plots.py) and experiment trackers (trackers.py). It imports the configuration, the shared types and the callables registry; the
actors, the run and the command line import it."""
