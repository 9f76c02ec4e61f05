"""Code rlpipe does not trust or does not own: the sandbox that runs model-written programs under the kernel's
isolation (sandbox.py) and the registry of users' callables that travel to workers by value (callables.py). The
rewards, the tools, the trackers and the export all import it; it imports nothing of rlpipe but rlpipe/orphans.py."""
