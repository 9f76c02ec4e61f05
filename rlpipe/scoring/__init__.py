"""Signals from models, run by the scorer role (actors/scorer.py): reward models scored as TRL scores them, the built-in
LLM judge, and a distillation teacher's log-probs. Imports `rlpipe.config`, the model-file checks, folders and Hub
ids of `rlpipe.models`, the naming rules of `rlpipe.rewards`, `rlpipe.data.templating` (chat markers kept as text),
and (to start a judge's engine) the rollout side's KV block size; no Ray."""
