"""
The scripts behind the `trl-topr` command, each also runnable as a module (`python -m trl_topr.scripts.train`):

- `train`: offline TOPR training on a dataset of scored completions (the embedded arithmetic demo by default);
- `sample`: a TOPR dataset sampled from a prompts dataset, with rewards and behavior log-probs;
- `eval`: pass@1 (greedy and sampled), maj@k and invalid rate of a policy.

Each exposes `make_parser()` and `main(...)`, as TRL's scripts do; `utils` holds their shared helpers.
"""
