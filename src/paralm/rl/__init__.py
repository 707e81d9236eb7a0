"""Reinforcement learning from verifiable rewards (`paralm rl`, docs/rl.md): GRPO and its variants on a
paralm run. `prompts` reads and checks what the policy is prompted with, `rewards` scores its completions
(built-ins and the user's functions), `objective` turns rewards into advantages and the clipped policy
loss, `rollout` samples completions on the training layout, `reference` keeps the frozen policy of the KL
term, `policy_step` runs the update, `engine` alternates rollouts and updates, and `cli` is the verb.
"""
