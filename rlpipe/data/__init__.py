"""Prompts: datasets read into prompt sets with their answers and a resumable sampler (prompts.py), and verifiers'
task sets as a data source (verifiers.py). It imports the configuration, the rewards (the built-in scorers of the
sources it reads) and the shared types; the tools, the start-up checks and the run import it."""
