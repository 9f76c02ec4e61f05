"""Example reward functions for rlpipe (and TRL's GRPOTrainer): see examples/reward_package/README.md."""

from example_rewards.answers import brevity, final_number

__all__ = ["brevity", "final_number"]
