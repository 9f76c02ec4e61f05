"""A run, as the driver drives it: the GRPO loop and its start-up (controller.py), held-out evaluation
(evaluation.py), Ray job submission (submit.py) and publishing an export to the Hub (hub_push.py). The top of the
library: it may import every other room and the actors; nothing but rlpipe/api.py, rlpipe/cli.py and the benchmarks
imports it."""
