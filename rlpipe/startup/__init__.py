"""What is checked before a run starts: the recipe against the cluster, the data, the model folder and the reward
functions (preflight.py), and each role's Python interpreter, asked what it imports (interpreters.py). The actors
import it to size the cluster; it imports the configuration, data, models, rewards, tools, hardware and the checkpoints of
training/, never the actors or the run."""
