"""Signals from models, run by the scorer role (actors/scorer.py): reward models scored as TRL scores them. Imports
`rlpipe.config`, the model-file checks and Hub ids of `rlpipe.models`, and the naming rules of `rlpipe.rewards`;
no Ray."""
