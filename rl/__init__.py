"""The rank-free mathematics of RL for flow-matching models: the sampler with its log-probabilities,
seeded noise, advantages, which timesteps are trained, the loss, the algorithms built from them,
the non-finite guard and the conditioning records that cross ranks.

Imports nothing of the project (a leaf layer): every role, parallel/, models/ and the planner use it."""
