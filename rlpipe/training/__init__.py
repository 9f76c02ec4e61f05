"""The learner's side of a step: one learner rank (learner.py) around its train engine (train_engine.py), the
forward passes over packed rows (forward.py), LoRA adapters (lora.py) and the learner's view of each weight form
(weight_views.py), and checkpoints with exact resume and streamed export (checkpoint.py). It builds on the models,
kernels, parallel, algo, hardware and weightsync rooms; it never imports the rollout side, the actors or the run."""
