"""The devices: the learner's device kinds and their backends (device.py), TPU host environment variables and chip
binding (tpu_env.py), how a TPU slice's hosts and chips are laid out (tpu_layout.py), and which GPUs the learner
ranks and engines take (gpu_layout.py). A base room: it imports only the configuration, so every other room may
import it."""
