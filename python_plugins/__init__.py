"""Built-in Rollout plugins: a Hugging Face policy, rewards, data, callbacks and environments.

Reference them from a run config as ``"python_plugins.<module>:<Class>"``.
"""
