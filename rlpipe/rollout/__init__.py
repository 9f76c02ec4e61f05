"""The rollout side of a step: one vLLM engine with rlpipe's weight writer and episode runner (engine.py), rlpipe's
model registered in vLLM (vllm_model.py) and the worker extension that writes synced weights into vLLM's model
(vllm_worker.py). It builds on the models, tools, weightsync and training.lora modules; the actors drive it, and it
never imports the learner's engine, the actors or the run."""
